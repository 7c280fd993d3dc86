"""TorchServe handler for alstm-zoo language models: ``score`` and ``generate`` over HTTP.

Why a custom handler: TorchServe's ``BaseHandler`` unpickles full models (``torch.load`` without
``weights_only``); this one loads the checkpoint the archive carries (config.json +
model.safetensors + vocab.json, or an ONNX export through the library's backends) with the
library's own loader, and parses, validates and runs every request through the framework-free service
core (:mod:`zoo.service`: the one request schema the demo and the CLI use too), so the server answers
exactly what the Python API answers.

Request bodies (decoded here, never by the worker: ``decode_input_request=false``):

* ``application/json``: ``{"task": "score", "texts": [...], "return_tokens": false}`` (``"dynamic": true``,
  dynamic evaluation, is refused here with a 400: the server does not enable it) or
  ``{"task": "generate", "prompt": "...", "max_new_tokens": 50, "temperature": 1.0, "top_k": 0,
  "top_p": 1.0, "seed": null, "stop_at_eos": false, "allow_unk": true, "stream": false}``;
* ``text/plain`` (or no content type): the body is one text to score (a JSON object without a content type is
  refused: it was almost surely meant as JSON).

Every bad input is answered for its own request with HTTP 400 and
``{"code": 400, "type": "BadRequest", "field": ..., "message": ...}``; a request over the token budget (score:
its texts' tokens; generate: prompt tokens + ``max_new_tokens``; :class:`zoo.service.Limits`) with 413 before any
model work; a generation while every generation place is taken with 503 and ``Retry-After``. The other requests
of the batch are still served and the worker never dies (anything unforeseen fails its own request with a 500,
never the batch).

Fair sharing (:mod:`zoo.scheduler`, where the reasons are written down): every request is a job cut into bounded
steps (at most ``step_tokens`` tokens: a chunk of a score request's own texts, the state carried exactly as the
library scores long texts, or one generated token), and each handler call gives every job in progress one step
per round, score chunks and generation steps alike. Texts of different requests are never padded to each
other's length, so a request's latency depends on its own size, and a client looping the largest request moves
another client's latency by a bounded factor (``benchmarks/serving.py``). Generations hold at most
``max_generations`` of the batch's places (default: half of ``batchSize``); the rest are kept for scoring.

The archive runs with TorchServe's continuous batching (``continuousBatching: true``): a request stays in the
batch until its reply is complete, and the frontend hands the worker the new requests that arrived meanwhile
together with the jobs still running. A call runs rounds for ``gen_slice_ms`` or until a job finishes, whichever
is first (a short request is answered in the call that starts it, and a finished reply leaves at once); a call
that only closes finished replies runs none. Each call answers every request of its batch: finished ones with
their reply (``ts_stream_next: false``), running ones with their next chunk (``ts_stream_next: true``): NDJSON
lines for a streamed generation, nothing until the whole JSON reply otherwise.

Three parts, so that another wire format (a dialect) is a new parser and formatter, never a scheduler change:
parsing a request into a job (:meth:`ZooDialect.parse`), scheduling and running jobs (:class:`zoo.scheduler.
Scheduler`), formatting a job's progress into bytes (:meth:`ZooDialect.chunk`). A request picks its dialect with
the ``X-Zoo-Api`` header (:data:`DIALECTS`; absent: the zoo's own; unknown: 400 naming the header): ``openai`` is
OpenAI's completions API (:class:`OpenAIDialect`, :mod:`zoo.completions`), which the front door sets on
``POST /v1/completions`` (and removes from every other request, so a client cannot choose it on the native route).

Ready means ready: :meth:`ZooService.initialize` scores a short text and takes one generation step before it
returns, so TorchServe reports the model READY only once it can answer at full speed (the compiled loops are
built at install, ``zoo build-ext``; loading them here takes well under a second).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

try:
    import torch

    from zoo.completions import CompletionRequest, error_of, parse_completion
    from zoo.errors import InvalidRequest, ServerBusy, ZooError
    from zoo.generation import SamplingParams
    from zoo.pretrained import ZooModel
    from zoo.scheduler import STEP_TOKENS, Job, Scheduler
    from zoo.service import (
        GenerateRequest,
        Limits,
        Request,
        ScoreRequest,
        Service,
        error_body,
        error_status,
        parse_body,
        to_json,
    )
except ImportError as e:  # the worker's Python must be the project's environment (zoo serve sets it)
    raise ImportError(f"the TorchServe worker cannot import the zoo library ({e}); start the server with "
                      f"`zoo serve start`, which runs the workers with the project's Python") from None

JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"
SSE_TYPE = "text/event-stream"
PHRASES = {400: "Bad Request", 404: "Not Found", 413: "Payload Too Large", 500: "Internal Server Error",
           503: "Service Unavailable"}
TOKENS_METRIC = "zoo_tokens_scored_total"
INTERNAL = {"code": 500, "type": "InternalServerError", "message": "{what} failed; see model_log.log"}


# -- the wire format: parse a request into a job, format a job's progress into bytes -----------------------------
class ZooDialect:
    """The zoo's own request and reply bodies (the module docstring). A front end with another wire format parses
    into the same requests and formats the same :class:`~zoo.scheduler.Job` s; the scheduler never sees it."""

    def parse(self, raw: Any, content_type: str, limits: Limits) -> Request:
        return parse_body(raw, content_type, limits)

    def content_type(self, job: Job) -> str:
        return NDJSON_TYPE if getattr(job.request, "stream", False) else JSON_TYPE

    def error(self, err: Exception | None, what: str = "request") -> dict[str, Any]:
        """The body of a failed request: the service core's error shape."""
        if isinstance(err, ZooError):
            return error_body(err)
        return {**INTERNAL, "message": INTERNAL["message"].format(what=what)}

    def chunk(self, job: Job, pieces: list[str]) -> bytes:
        """What this call sends for a job whose status line went out already: a streamed generation its new NDJSON
        lines (and the closing line when done), anything else nothing until its whole JSON reply (an error after
        the 200 status line is the error body: the client sees a 200 whose body has ``code`` >= 400)."""
        if not getattr(job.request, "stream", False):
            if not job.done:
                return b""
            return to_json(job.result if job.error is None else self.error(job.error, job.request.task))
        body = b"".join(to_json({"text": piece}) + b"\n" for piece in pieces)
        if job.done:
            last: dict[str, Any] = {"text": "", "done": True, "num_tokens": len(job.pieces),
                                    "warnings": list(job.request.warnings)}
            if job.error is not None:
                last["error"] = self.error(job.error, job.request.task)
            body += to_json(last) + b"\n"
        return body


ZOO = ZooDialect()
#: The wire formats, by the ``X-Zoo-Api`` request header's value (absent: ``zoo``).
DIALECTS: dict[str, ZooDialect] = {"zoo": ZOO}


class OpenAIDialect:
    """OpenAI's completions API (:mod:`zoo.completions`), for the one model this worker serves: the request becomes
    a :class:`~zoo.completions.CompletionRequest`, whose progress is its :class:`~zoo.completions.CompletionRun`'s;
    replies and errors are OpenAI's shapes, a stream is server-sent events ending with ``data: [DONE]``."""

    def __init__(self, tokenizer: Any, served: str):
        self.tokenizer, self.served = tokenizer, served

    def parse(self, raw: Any, content_type: str, limits: Limits) -> CompletionRequest:
        media = (content_type or "").split(";")[0].strip().lower()
        if media not in ("", JSON_TYPE):
            raise InvalidRequest("Content-Type", f"unsupported {media[:40]!r}; send application/json")
        try:
            text = bytes(raw).decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
            payload = json.loads(text, parse_constant=_no_constant) if isinstance(text, str) else None
        except (ValueError, RecursionError):
            raise InvalidRequest("body", "is not valid JSON (UTF-8)") from None
        return parse_completion(payload, self.tokenizer, limits, served=self.served)

    def content_type(self, job: Job) -> str:
        return SSE_TYPE if job.request.stream else JSON_TYPE

    def error(self, err: Exception | None, what: str = "request") -> dict[str, Any]:
        return error_of(err if err is not None else RuntimeError(what))[1]

    def chunk(self, job: Job, pieces: list[str]) -> bytes:
        """A stream's new events (an error once events went out is one more ``data: {"error": ...}`` event and
        ``[DONE]``); otherwise nothing until the whole reply (an error after the 200 status line is its body)."""
        if job.error is not None:
            body = to_json(self.error(job.error, "completion"))
            return b"data: " + body + b"\n\ndata: [DONE]\n\n" if job.request.stream else body
        if job.request.stream:
            return job.run.events()
        return to_json(job.result) if job.done else b""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


# -- the service ----------------------------------------------------------------------------------------------
class ZooService:
    """Loads the archived checkpoint once per worker and serves batches through :class:`zoo.scheduler.Scheduler`."""

    def __init__(self) -> None:
        self.service: Service | None = None
        self.scheduler: Scheduler | None = None
        #: the wire format of each request in progress, by TorchServe request id (:data:`DIALECTS`)
        self.dialects: dict[str, Any] = {}
        #: the wire formats this worker speaks: :data:`DIALECTS` and, once its model is loaded, ``openai``
        self.apis: dict[str, Any] = dict(DIALECTS)
        self.tokens_metric: Any = None
        self.model_name = "model"
        #: requests whose whole reply went out in the previous call, closed by an empty last chunk in this one
        self.closing: set[str] = set()
        #: requests answered with an error (a whole response): TorchServe drops them when their connection closes
        self.dropping: set[str] = set()
        self.slice_s = 0.02

    @property
    def model(self) -> ZooModel | None:
        return self.service.model if self.service is not None else None

    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties["model_dir"]
        self.model_name = context.model_name
        cfg = dict((getattr(context, "model_yaml_config", None) or {}).get("handler") or {})
        limits = Limits.from_mapping(cfg)
        self.slice_s = max(0.0, float(cfg.get("gen_slice_ms", 20))) / 1000
        if int(cfg.get("threads", 0)) > 0:
            torch.set_num_threads(int(cfg["threads"]))
        torch.set_flush_denormal(True)
        model = ZooModel.from_pretrained(model_dir, source="torchserve archive", name=context.model_name)
        backend = str(cfg.get("backend", "eager"))
        if backend != "eager":
            # The library's ONNX Runtime runner; it finds the export the archive carries (<model_dir>/onnx/)
            # and checks that its manifest names these exact weights.
            from zoo.backends import attach_backend

            attach_backend(model, backend)
        device = worker_device(context.system_properties.get("gpu_id"))
        if device != "cpu":  # the GPU TorchServe gave this worker (`zoo serve start --gpus N`)
            model.to(device)
        self.service = Service(model, limits)
        self.apis["openai"] = OpenAIDialect(model.tokenizer, context.model_name)
        batch = int(context.system_properties.get("batch_size") or 8)
        gens = int(cfg.get("max_generations") or max(1, batch // 2))
        # a quarter of the places (at least one) kept for requests that fit one step (zoo.scheduler.Scheduler)
        long = int(cfg.get("max_long") or max(1, batch - max(1, batch // 4)))
        self.scheduler = Scheduler(self.service, int(cfg.get("step_tokens") or STEP_TOKENS), gens, long)
        self._warm_up()
        try:
            from ts.metrics.metric_type_enum import MetricTypes

            self.tokens_metric = context.metrics.add_metric_to_cache(
                TOKENS_METRIC, unit="count", dimension_names=["ModelName"], metric_type=MetricTypes.COUNTER)
        except Exception:  # metrics are an extra; serving must not depend on them
            logger.warning("custom metric %s unavailable", TOKENS_METRIC, exc_info=True)
        logger.info("zoo handler ready: %r, limits %s, %d generation place(s) of %d", model, limits, gens, batch)

    def _warm_up(self) -> None:
        """One short score and one generation step before TorchServe calls the model ready: the first request
        then meets loaded weights, loaded compiled loops and warm allocator caches."""
        assert self.service is not None
        started = time.perf_counter()
        reply = self.service.score([ScoreRequest(("the",))])[0]
        if isinstance(reply, Exception):
            raise RuntimeError(f"the model cannot score: {reply}")
        next(iter(self.service.stream(GenerateRequest("the", SamplingParams(max_new_tokens=1, seed=0)))), None)
        logger.info("warm-up scored and generated in %.0f ms", 1000 * (time.perf_counter() - started))

    # Each request of a batch gets its own status, content type and body.
    @staticmethod
    def _header(context: Any, idx: int, name: str) -> str:
        headers = context.get_all_request_header(idx) or {}
        for key, value in headers.items():
            if isinstance(value, str) and key.lower() == name:
                return value
        for value in headers.values():
            if isinstance(value, dict) and value.get(name):
                return str(value[name])
        return ""

    def _dialect(self, context: Any, idx: int, rid: str) -> Any:
        """The wire format of request ``idx`` (its ``X-Zoo-Api`` header; the zoo's own by default), kept for the
        rest of its reply."""
        name = self._header(context, idx, "x-zoo-api").strip().lower() or "zoo"
        if name not in self.apis:
            raise InvalidRequest("X-Zoo-Api", f"unknown API {name[:40]!r}; known: {', '.join(sorted(self.apis))}")
        self.dialects[rid] = self.apis[name]
        return self.apis[name]

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        """Answer every request of the batch; a failure is confined to its own request (never raised).

        The batch holds new requests and, under continuous batching, the jobs still running (their request ids
        are the scheduler's keys; the frontend sends no body for them again)."""
        assert self.scheduler is not None
        started = time.perf_counter()
        n = len(data)
        ids = [str(context.request_ids[i]) for i in range(n)]
        present = set(ids)
        gone = (set(self.scheduler.jobs) | set(self.dialects)) - present  # the frontend dropped them (client gone)
        self.scheduler.forget(gone)
        for rid in gone:
            self.dialects.pop(rid, None)
        self.closing &= present
        self.dropping &= present
        out: list[bytes] = [b""] * n
        more: list[bool | None] = [False] * n
        fresh: set[int] = set()
        closing = False
        for i, row in enumerate(data):
            if ids[i] in self.closing:
                self.closing.discard(ids[i])  # its empty last chunk (more: False)
                closing = True
            elif ids[i] in self.dropping:
                more[i] = None  # its error went out whole; the frontend drops it once its connection is closed
            elif ids[i] not in self.scheduler.jobs:
                fresh.add(i)
                out[i], more[i] = self._start(context, i, ids[i], row, n)
        running = [ids[i] for i in range(n) if ids[i] in self.scheduler.jobs]
        # rounds for the slice or until a job finishes (its reply leaves at once); a call that only closes replies
        # runs none (it costs no model time, and the next call follows at once)
        if fresh or not closing:
            self.scheduler.run(running, self.slice_s)
        for i in range(n):
            job = self.scheduler.jobs.get(ids[i])
            if job is not None:
                out[i], more[i] = self._progress(context, i, ids[i], job, first=i in fresh)
        context.stopping_criteria = [lambda _reply, go_on=go_on: None if go_on is None else not go_on
                                     for go_on in more]
        logger.debug("batch of %d request(s) (%d running) served in %.1f ms", n, len(running),
                     1000 * (time.perf_counter() - started))
        return out

    def _start(self, context: Any, idx: int, rid: str, row: Any, n: int) -> tuple[bytes, bool | None]:
        """Parse a new request and admit it as a job: ``(b"", True)``, or its whole error reply and ``None``."""
        assert self.scheduler is not None and self.service is not None
        try:
            context.set_response_header(idx, "X-Zoo-Batch-Size", str(n))
            raw = row.get("body", row.get("data")) if isinstance(row, dict) else None
            request = self._dialect(context, idx, rid).parse(raw, self._header(context, idx, "content-type"),
                                                             self.service.limits)
            self.scheduler.admit(rid, request)
            return b"", True
        except ZooError as e:  # bad input, over the budget, no generation place: its own 4xx/503
            if isinstance(e, ServerBusy):
                context.set_response_header(idx, "Retry-After", str(e.retry_after_s))
            return self._whole(context, idx, rid, error_status(e), self.dialects.get(rid, ZOO).error(e)), None
        except Exception:  # a bug in parsing: this request alone fails
            logger.exception("parsing request %d failed", idx)
            return self._whole(context, idx, rid, 500, self.dialects.get(rid, ZOO).error(None, "parsing")), None

    def _progress(self, context: Any, idx: int, rid: str, job: Job, first: bool) -> tuple[bytes, bool | None]:
        """This call's bytes for a job and whether it goes on (TorchServe's ``ts_stream_next``: True = more to
        come, False = last chunk, None = no header, a whole response).

        TorchServe 0.12's frontend (RestJob, ContinuousBatching) makes three cases of a reply that starts and ends
        in one call: an error (>= 400) goes out whole, and the frontend closes that connection, which drops the
        request from the batch; a 200 cannot (without the header the request would stay in the batch on its
        kept-alive connection, and a lone last chunk loses the status line), so it goes out as an opening chunk
        and the request is closed by an empty last chunk in the next call, which the frontend makes at once."""
        assert self.scheduler is not None
        dialect = self.dialects.get(rid, ZOO)
        pieces = job.take_pieces()
        if first and job.done and job.error is not None:  # nothing sent yet: an ordinary error reply
            self.scheduler.forget([rid])
            return self._whole(context, idx, rid, job.status, dialect.error(job.error, job.request.task)), None
        if first:
            context.set_response_content_type(idx, dialect.content_type(job))
        body = dialect.chunk(job, pieces)
        if not job.done:
            return body, True
        self.scheduler.forget([rid])
        self._count(job)
        if first:  # a whole 200 reply in one call: closed by an empty last chunk in the next
            self.closing.add(rid)
            return body, True
        return body, False

    def _whole(self, context: Any, idx: int, rid: str, code: int, body: dict[str, Any]) -> bytes:
        """A whole error response (status, JSON body); the frontend drops the request once it is sent."""
        context.set_response_status(code, PHRASES.get(code, "Error"), idx)  # the reason phrase stays ASCII
        context.set_response_content_type(idx, JSON_TYPE)
        self.dropping.add(rid)
        return to_json(body)

    def _count(self, job: Job) -> None:
        """The scored-tokens metric, for a score request answered."""
        if self.tokens_metric is None or not isinstance(job.request, ScoreRequest) or job.result is None:
            return
        try:
            self.tokens_metric.add_or_update(job.result["corpus"]["num_tokens"], [self.model_name])
        except Exception:
            logger.warning("could not update %s", TOKENS_METRIC, exc_info=True)


_service = ZooService()


def worker_device(gpu_id: Any) -> str:
    """The device of a worker: ``cuda:<gpu_id>`` where TorchServe assigned it a GPU (its ``number_of_gpu``, set by
    ``zoo serve start --gpus N``; 0 by default, and then ``gpu_id`` is None), else the CPU."""
    return "cpu" if gpu_id is None or not torch.cuda.is_available() else f"cuda:{int(gpu_id)}"


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[bytes] | None:
    """TorchServe's module-level entry point: called once with ``data=None`` to load, then per batch."""
    if _service.service is None:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
