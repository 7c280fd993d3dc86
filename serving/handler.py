"""TorchServe handler for alstm-zoo language models: only TorchServe's side of the worker.

Why a custom handler: TorchServe's ``BaseHandler`` unpickles full models (``torch.load`` without
``weights_only``); this one loads the checkpoint the archive carries (config.json +
model.safetensors + vocab.json, or an ONNX export through the library's backends) with the
library's own loader. Everything else is the library's wire package, :mod:`zoo.api`, so the server answers exactly
what the Python API answers:

* a request's wire format (dialect) is the one its ``X-Zoo-Api`` header names (:mod:`zoo.api.dialects`; absent:
  the native route, :mod:`zoo.api.native`; ``openai``: :mod:`zoo.api.completions`, which the front door sets on
  ``POST /v1/completions`` and removes from every other request; unknown: 400 naming the header). The dialect
  parses the body (bad input: its own 4xx, in that dialect's error shape, :mod:`zoo.api.http`), says whether the
  request generates and gives its steps, and formats its progress into bytes;
* :class:`zoo.api.scheduler.Scheduler` runs every request as a job cut into bounded steps, round-robin, at most
  ``max_generations`` generations at once (default: half of ``batchSize``; over it a generation is answered 503
  with ``Retry-After`` in its dialect's shape), where the reasons are written down.

The other requests of a batch are still served when one fails, and the worker never dies (anything unforeseen
fails its own request with a 500, never the batch).

The archive runs with TorchServe's continuous batching (``continuousBatching: true``): a request stays in the
batch until its reply is complete, and the frontend hands the worker the new requests that arrived meanwhile
together with the jobs still running. A call runs the new requests first (those that fit one step together, in one
model call: :meth:`zoo.api.scheduler.Scheduler.run`), then turns for ``gen_slice_ms`` or until a job finishes,
whichever is first; each call answers every request of its batch: a reply that starts and ends in it whole, 200 or
error, running ones with their next chunk (``ts_stream_next: true``), a reply over several calls ending with its last
chunk (``ts_stream_next: false``; :meth:`TorchServeHandler._progress` has the protocol). Each request's client (the
front door's ``X-Zoo-Client``: the peer's address) is the scheduler's, for fair turns and shares between clients.

Ready means ready: :meth:`TorchServeHandler.initialize` scores a short text and takes one generation step before it
returns, so TorchServe reports the model READY only once it can answer at full speed (the compiled loops are
built at install, ``zoo build-ext``; loading them here takes well under a second).
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

try:
    import torch

    from zoo.api.dialects import Dialect, choose, load_dialects
    from zoo.api.http import JSON_TYPE, REASONS, to_json
    from zoo.api.scheduler import STEP_TOKENS, Job, Scheduler
    from zoo.api.service import GenerateRequest, Limits, ScoreRequest, Service
    from zoo.errors import ServerBusy, ZooError
    from zoo.generation import SamplingParams
    from zoo.zoo_model import ZooModel
except ImportError as e:  # the worker's Python must be the project's environment (zoo serve sets it)
    raise ImportError(f"the TorchServe worker cannot import the zoo library ({e}); start the server with "
                      f"`zoo serve start`, which runs the workers with the project's Python") from None

TOKENS_METRIC = "zoo_tokens_scored_total"
#: Who sent a request: the front door sets it to the connection's peer address (a client's own value is replaced;
#: without the front door, absent: each request is a client of its own). Turns and shares are fair between clients.
CLIENT_HEADER = "x-zoo-client"


# -- the adapter ----------------------------------------------------------------------------------------------
class TorchServeHandler:
    """TorchServe's side of the worker: loads the archived checkpoint once, then answers each batch TorchServe hands
    it (its request ids, headers, continuous-batching close/drop protocol) through :class:`zoo.api.scheduler.
    Scheduler`, each request in the wire format (:mod:`zoo.api.dialects`) its ``X-Zoo-Api`` header names."""

    def __init__(self) -> None:
        self.service: Service | None = None
        self.scheduler: Scheduler | None = None
        #: the wire formats this worker speaks (all of :data:`zoo.api.dialects.DIALECTS`), once its model is loaded
        self.dialects: dict[str, Dialect] = {}
        self.tokens_metric: Any = None
        self.model_name = "model"
        self.slice_s = 0.02
        self.scored = 0  # tokens scored by the requests answered in this call (the metric, once per call)

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
        self.dialects = load_dialects(self.service, context.model_name)
        batch = int(context.system_properties.get("batch_size") or 8)
        gens = int(cfg.get("max_generations") or max(1, batch // 2))
        # a quarter of the places (at least one) kept for requests that fit one step (zoo.api.scheduler.Scheduler)
        long = int(cfg.get("max_long") or max(1, batch - max(1, batch // 4)))
        self.scheduler = Scheduler(self.service, int(cfg.get("step_tokens") or STEP_TOKENS), gens, long,
                                   cfg.get("client_long"))
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

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        """Answer every request of the batch; a failure is confined to its own request (never raised).

        The batch holds new requests and, under continuous batching, the jobs still running (their request ids
        are the scheduler's keys; the frontend sends no body for them again)."""
        assert self.scheduler is not None
        started = time.perf_counter()
        n = len(data)
        ids = [str(context.request_ids[i]) for i in range(n)]
        self.scheduler.forget(set(self.scheduler.jobs) - set(ids))  # the frontend dropped them (client gone)
        out: list[bytes] = [b""] * n
        more: list[bool | None] = [None] * n
        fresh: set[int] = set()
        for i, row in enumerate(data):
            if ids[i] not in self.scheduler.jobs:
                fresh.add(i)
                out[i], more[i] = self._start(context, i, ids[i], row, n)
        running = [ids[i] for i in range(n) if ids[i] in self.scheduler.jobs]
        # rounds for the slice or until a job finishes (its reply leaves at once)
        if running:
            self.scheduler.run(running, self.slice_s)
        for i in range(n):
            job = self.scheduler.jobs.get(ids[i])
            if job is not None:
                out[i], more[i] = self._progress(context, i, ids[i], job, first=i in fresh)
        context.stopping_criteria = [lambda _reply, go_on=go_on: None if go_on is None else not go_on
                                     for go_on in more]
        self._count()
        logger.debug("batch of %d request(s) (%d running) served in %.1f ms", n, len(running),
                     1000 * (time.perf_counter() - started))
        return out

    def _start(self, context: Any, idx: int, rid: str, row: Any, n: int) -> tuple[bytes, bool | None]:
        """Parse a new request in its dialect and admit it as a job: ``(b"", True)``, or its whole error reply and
        ``None``."""
        assert self.scheduler is not None and self.service is not None
        dialect = self.dialects.get("zoo")
        try:
            context.set_response_header(idx, "X-Zoo-Batch-Size", str(n))
            raw = row.get("body", row.get("data")) if isinstance(row, dict) else None
            dialect = choose(self.dialects, self._header(context, idx, "x-zoo-api"))
            request = dialect.parse(raw, self._header(context, idx, "content-type"), self.service.limits)
            self.scheduler.admit(rid, request, dialect, self._header(context, idx, CLIENT_HEADER) or None)
            return b"", True
        except ZooError as e:  # bad input, over the budget, no generation place: its own 4xx/503
            if isinstance(e, ServerBusy):
                context.set_response_header(idx, "Retry-After", str(e.retry_after_s))
            return self._whole(context, idx, rid, *dialect.error(e)), None
        except Exception:  # a bug in parsing: this request alone fails
            logger.exception("parsing request %d failed", idx)
            return self._whole(context, idx, rid, *dialect.error(None, "parsing")), None

    def _progress(self, context: Any, idx: int, rid: str, job: Job, first: bool) -> tuple[bytes, bool | None]:
        """This call's bytes for a job and whether it goes on (TorchServe's ``ts_stream_next``: True = more to
        come, False = last chunk, None = no header, a whole response).

        TorchServe 0.12's frontend (``ContinuousBatching.sendResponse``, ``RestJob.responseInference``): a reply
        without the header goes out whole (status line, headers, body) and the request leaves the batch at once, so
        a reply that starts and ends in one call, 200 or error, is answered in the call that computes it; a
        reply sent over several calls opens with ``True`` (the status line and its first chunk) and ends with
        ``False`` (its last chunk). (Until 2026-11-28 a whole 200 was sent as an opening chunk and closed by an
        empty last chunk in a second, model-free call: that call cost ~1.8 ms of every request.)"""
        assert self.scheduler is not None
        dialect = job.dialect
        fresh = job.take_pieces()
        if first and job.done and job.error is not None:  # nothing sent yet: an ordinary error reply
            self.scheduler.forget([rid])
            return self._whole(context, idx, rid, *dialect.error(job.error, job.request.task)), None
        if first:
            context.set_response_content_type(idx, dialect.content_type(job.request))
        body = dialect.chunk(job, fresh)
        if not job.done:
            return body, True
        self.scheduler.forget([rid])
        self.scored += self._scored(job)
        return body, None if first else False

    def _whole(self, context: Any, idx: int, rid: str, code: int, body: dict[str, Any]) -> bytes:
        """A whole error response (status, JSON body)."""
        context.set_response_status(code, REASONS.get(code, "Error"), idx)  # the reason phrase stays ASCII
        context.set_response_content_type(idx, JSON_TYPE)
        return to_json(body)

    @staticmethod
    def _scored(job: Job) -> int:
        """The tokens a score request answered scored (0 for anything else)."""
        if not isinstance(job.request, ScoreRequest) or job.result is None:
            return 0
        return int(job.result["corpus"]["num_tokens"])

    def _count(self) -> None:
        """The scored-tokens metric, once per call with the call's sum: each update is a line the worker prints and
        the frontend parses and logs (one per request cost the frontend measurable time)."""
        scored, self.scored = self.scored, 0
        if self.tokens_metric is None or not scored:
            return
        try:
            self.tokens_metric.add_or_update(scored, [self.model_name])
        except Exception:
            logger.warning("could not update %s", TOKENS_METRIC, exc_info=True)


_service = TorchServeHandler()


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
