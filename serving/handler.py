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
``{"code": 400, "type": "BadRequest", "field": ..., "message": ...}``; the other requests of the
batch are still served and the worker never dies (anything unforeseen fails its own request with a
500, never the batch). The score requests of a batch go through one
``ZooModel.score`` call over all their texts (batched scores equal unbatched ones to float
tolerance).

Generation never holds scoring up: the archive runs with TorchServe's continuous batching
(``continuousBatching: true``), so a generation is not computed in one go but advanced a time slice at a
time (``gen_slice_ms`` of the handler config, shared round-robin by the generations in progress; one token
each when the call also carries other replies), and the frontend hands the worker the new requests that
arrived meanwhile together with the generations still running. A score request therefore waits for at most
one slice of generation, not for whole generations
(measured by ``benchmarks/serving.py``'s mixed load). Each handler call answers every request of its batch:
finished ones with their reply (``ts_stream_next: false``), running generations with their next chunk
(``ts_stream_next: true``): NDJSON lines when streamed, nothing until the whole JSON reply otherwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

try:
    import torch

    from zoo.errors import InvalidRequest, ZooError
    from zoo.pretrained import ZooModel
    from zoo.service import (
        GenerateRequest,
        Limits,
        ScoreRequest,
        Service,
        error_body,
        generate_reply,
        parse_body,
        to_json,
    )
except ImportError as e:  # the worker's Python must be the project's environment (zoo serve sets it)
    raise ImportError(f"the TorchServe worker cannot import the zoo library ({e}); start the server with "
                      f"`zoo serve start`, which runs the workers with the project's Python") from None

JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"
PHRASES = {400: "Bad Request", 500: "Internal Server Error"}
TOKENS_METRIC = "zoo_tokens_scored_total"


# -- the service ----------------------------------------------------------------------------------------------
@dataclass
class Generation:
    """A generation in progress, kept across handler calls under its TorchServe request id."""

    job: GenerateRequest
    pieces: Iterator[str]
    text: list[str] = field(default_factory=list)
    done: bool = False
    error: tuple[int, dict[str, Any]] | None = None  # (status, body) when it failed

    def advance(self) -> str | None:
        """One more token's piece (None once finished or failed; a failure is kept, never raised)."""
        try:
            piece = next(self.pieces)
        except StopIteration:
            self.done = True
            return None
        except ZooError as e:  # the caller's own problem: its 400
            self.done, self.error = True, (400, error_body(e))
            return None
        except Exception:  # a bug, not bad input: this generation alone fails
            logger.exception("generation failed")
            self.done, self.error = True, (500, {"code": 500, "type": "InternalServerError",
                                                 "message": "generation failed; see model_log.log"})
            return None
        self.text.append(piece)
        return piece


class ZooService:
    """Loads the archived checkpoint once per worker and serves batches through :class:`zoo.service.Service`."""

    def __init__(self) -> None:
        self.service: Service | None = None
        self.tokens_metric: Any = None
        self.model_name = "model"
        #: generations in progress, by TorchServe request id (continuous batching)
        self.running: dict[str, Generation] = {}
        #: requests whose whole reply went out in the previous call, closed by an empty last chunk in this one
        self.closing: set[str] = set()
        #: requests answered with an error (a whole response): TorchServe drops them when their connection closes
        self.dropping: set[str] = set()
        self._codes: dict[int, int] = {}  # the status of each reply of the current call, by batch index
        self.gen_slice_s = 0.02

    @property
    def model(self) -> ZooModel | None:
        return self.service.model if self.service is not None else None

    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties["model_dir"]
        self.model_name = context.model_name
        cfg = dict((getattr(context, "model_yaml_config", None) or {}).get("handler") or {})
        limits = Limits.from_mapping(cfg)
        self.gen_slice_s = max(0.0, float(cfg.get("gen_slice_ms", 20))) / 1000
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
        try:
            from ts.metrics.metric_type_enum import MetricTypes

            self.tokens_metric = context.metrics.add_metric_to_cache(
                TOKENS_METRIC, unit="count", dimension_names=["ModelName"], metric_type=MetricTypes.COUNTER)
        except Exception:  # metrics are an extra; serving must not depend on them
            logger.warning("custom metric %s unavailable", TOKENS_METRIC, exc_info=True)
        logger.info("zoo handler ready: %r, limits %s", model, limits)

    # Each request of a batch gets its own status, content type and body.
    @staticmethod
    def _content_type(context: Any, idx: int) -> str:
        headers = context.get_all_request_header(idx) or {}
        for key, value in headers.items():
            if isinstance(value, str) and key.lower() == "content-type":
                return value
        for value in headers.values():
            if isinstance(value, dict) and value.get("content-type"):
                return str(value["content-type"])
        return ""

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        """Answer every request of the batch; a failure is confined to its own request (never raised).

        The batch holds new requests and, under continuous batching, the generations still running (their
        request ids are in :attr:`running`; the frontend sends no body for them again)."""
        started = time.perf_counter()
        n = len(data)
        out: list[bytes] = [b""] * n
        ids = [str(context.request_ids[i]) for i in range(n)]
        present = set(ids)
        for rid in set(self.running) - present:  # the frontend dropped it (client gone, timeout): forget it
            del self.running[rid]
        self.closing &= present
        self.dropping &= present
        self._codes = {}
        closing = {i for i in range(n) if ids[i] in self.closing}
        self.closing -= {ids[i] for i in closing}
        dropping = {i for i in range(n) if ids[i] in self.dropping}
        jobs: dict[int, ScoreRequest] = {}
        gens: dict[int, Generation] = {}
        fresh: set[int] = set()
        for i, row in enumerate(data):
            if i in closing or i in dropping:
                continue
            if ids[i] in self.running:
                gens[i] = self.running[ids[i]]
                continue
            try:
                context.set_response_header(i, "X-Zoo-Batch-Size", str(n))
                raw = row.get("body", row.get("data")) if isinstance(row, dict) else None
                job = parse_body(raw, self._content_type(context, i), self.service.limits)
                if isinstance(job, GenerateRequest):
                    gens[i] = self.running[ids[i]] = Generation(job, self.service.stream(job))
                    fresh.add(i)
                else:
                    jobs[i] = job
            except InvalidRequest as e:
                out[i] = self._reply(context, i, 400, error_body(e))
            except Exception:  # a bug in parsing: this request alone fails
                logger.exception("parsing request %d failed", i)
                out[i] = self._internal_error(context, i, "parsing")
        if jobs:
            self._score(list(jobs), jobs, out, context)
        if gens:
            # Replies waiting on this call (scores, errors, closing chunks) leave as soon as every generation has
            # made one step; only a call that carries nothing but generations spends the whole slice on them.
            urgent = len(gens) < n
            chunks = self._advance(gens, 0.0 if urgent else self.gen_slice_s)
            for i, g in gens.items():
                out[i] = self._generation_chunk(context, i, g, chunks[i], first=i in fresh)
                if g.done:
                    self.running.pop(ids[i], None)
        # Whether each request goes on, for TorchServe (its `ts_stream_next` response header: True = more to come,
        # False = last chunk, None = no header, a whole response). TorchServe 0.12's frontend (RestJob,
        # ContinuousBatching) makes three cases of a reply that starts and ends in this call: an error (>= 400)
        # goes out whole, and the frontend closes that connection, which drops the request from the batch; a
        # 200 cannot (without the header the request would stay in the batch on its kept-alive connection, and a
        # lone last chunk loses the status line), so it goes out as an opening chunk and the request is closed
        # by an empty last chunk in the next call, which the frontend makes at once (no batch delay).
        more: list[bool | None] = [False] * n
        for i in range(n):
            if i in closing:
                continue
            if i in dropping:  # its error went out whole; the frontend drops it once its connection is closed
                more[i] = None
                continue
            if i in gens and not gens[i].done:
                more[i] = True
            elif i in gens and i not in fresh:
                more[i] = False  # the last chunk of a response already under way
            elif self._codes.get(i, 200) >= 400:
                more[i] = None
                self.dropping.add(ids[i])
            else:
                more[i] = True
                self.closing.add(ids[i])
        context.stopping_criteria = [lambda _reply, go_on=go_on: None if go_on is None else not go_on
                                     for go_on in more]
        logger.debug("batch of %d request(s) (%d generating) served in %.1f ms", n, len(gens),
                     1000 * (time.perf_counter() - started))
        return out

    @staticmethod
    def _advance(gens: dict[int, Generation], budget_s: float) -> dict[int, list[str]]:
        """Advance the running generations round-robin, one token each per round, for ``budget_s`` seconds
        (every one gets at least one token per call, so each makes progress whatever the budget)."""
        chunks: dict[int, list[str]] = {i: [] for i in gens}
        live = [i for i, g in gens.items() if not g.done]
        deadline = time.perf_counter() + budget_s
        while live:
            for i in live:
                piece = gens[i].advance()
                if piece is not None:
                    chunks[i].append(piece)
            live = [i for i in live if not gens[i].done]
            if time.perf_counter() >= deadline:
                break
        return chunks

    def _generation_chunk(self, context: Any, idx: int, gen: Generation, pieces: list[str], first: bool) -> bytes:
        """What this call sends for one generation: a streamed request gets its new NDJSON lines (and the closing
        line when done), a plain one nothing until its whole JSON reply. A failure before anything was sent is
        a normal error reply; after that, a streamed request gets an error line."""
        job = gen.job
        if gen.error is not None:
            if first:  # nothing sent yet: an ordinary error reply
                return self._reply(context, idx, *gen.error)
            if not job.stream:  # the status line went out with the first (empty) chunk
                return to_json(gen.error[1])
        if not job.stream:
            if gen.done:
                return self._reply(context, idx, 200, generate_reply(job, gen.text))
            if first:
                context.set_response_content_type(idx, JSON_TYPE)
            return b""
        if first:
            context.set_response_content_type(idx, NDJSON_TYPE)
        body = b"".join(to_json({"text": piece}) + b"\n" for piece in pieces)
        if gen.done:
            last: dict[str, Any] = {"text": "", "done": True, "num_tokens": len(gen.text),
                                    "warnings": list(job.warnings)}
            if gen.error is not None:
                last["error"] = gen.error[1]
            body += to_json(last) + b"\n"
        return body

    def _reply(self, context: Any, idx: int, code: int, body: dict[str, Any]) -> bytes:
        self._codes[idx] = code
        if code != 200:
            context.set_response_status(code, PHRASES.get(code, "Error"), idx)  # the reason phrase stays ASCII
        context.set_response_content_type(idx, JSON_TYPE)
        return to_json(body)

    def _internal_error(self, context: Any, idx: int, what: str) -> bytes:
        return self._reply(context, idx, 500, {"code": 500, "type": "InternalServerError",
                                               "message": f"{what} failed; see model_log.log"})

    def _score(self, ids: list[int], jobs: dict[int, ScoreRequest], out: list[bytes], context: Any) -> None:
        """All score requests of the batch through the service core (one library call, isolated on failure)."""
        assert self.service is not None
        replies = self.service.score([jobs[i] for i in ids])
        scored = 0
        for i, reply in zip(ids, replies, strict=True):
            if isinstance(reply, ZooError):  # the caller's own problem, e.g. over the token limit: its own 400
                out[i] = self._reply(context, i, 400, error_body(reply))
                continue
            if isinstance(reply, Exception):
                out[i] = self._internal_error(context, i, "scoring")
                continue
            scored += reply["corpus"]["num_tokens"]
            out[i] = self._reply(context, i, 200, reply)
        if self.tokens_metric is not None and scored:
            try:
                self.tokens_metric.add_or_update(scored, [self.model_name])
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
