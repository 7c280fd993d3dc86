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
together with the jobs still running. A call runs rounds for ``gen_slice_ms`` or until a job finishes, whichever
is first (a short request is answered in the call that starts it, and a finished reply leaves at once); a call
that only closes finished replies runs none. Each call answers every request of its batch: finished ones with
their reply (``ts_stream_next: false``), running ones with their next chunk (``ts_stream_next: true``), and errors
as whole responses that the frontend drops (:meth:`TorchServeHandler._progress` has the protocol).

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
        self.dialects = load_dialects(self.service, context.model_name)
        batch = int(context.system_properties.get("batch_size") or 8)
        gens = int(cfg.get("max_generations") or max(1, batch // 2))
        # a quarter of the places (at least one) kept for requests that fit one step (zoo.api.scheduler.Scheduler)
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

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[bytes]:
        """Answer every request of the batch; a failure is confined to its own request (never raised).

        The batch holds new requests and, under continuous batching, the jobs still running (their request ids
        are the scheduler's keys; the frontend sends no body for them again)."""
        assert self.scheduler is not None
        started = time.perf_counter()
        n = len(data)
        ids = [str(context.request_ids[i]) for i in range(n)]
        present = set(ids)
        self.scheduler.forget(set(self.scheduler.jobs) - present)  # the frontend dropped them (client gone)
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
        """Parse a new request in its dialect and admit it as a job: ``(b"", True)``, or its whole error reply and
        ``None``."""
        assert self.scheduler is not None and self.service is not None
        dialect = self.dialects.get("zoo")
        try:
            context.set_response_header(idx, "X-Zoo-Batch-Size", str(n))
            raw = row.get("body", row.get("data")) if isinstance(row, dict) else None
            dialect = choose(self.dialects, self._header(context, idx, "x-zoo-api"))
            request = dialect.parse(raw, self._header(context, idx, "content-type"), self.service.limits)
            self.scheduler.admit(rid, request, dialect)
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

        TorchServe 0.12's frontend (RestJob, ContinuousBatching) makes three cases of a reply that starts and ends
        in one call: an error (>= 400) goes out whole, and the frontend closes that connection, which drops the
        request from the batch; a 200 cannot (without the header the request would stay in the batch on its
        kept-alive connection, and a lone last chunk loses the status line), so it goes out as an opening chunk
        and the request is closed by an empty last chunk in the next call, which the frontend makes at once."""
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
        self._count(job)
        if first:  # a whole 200 reply in one call: closed by an empty last chunk in the next
            self.closing.add(rid)
            return body, True
        return body, False

    def _whole(self, context: Any, idx: int, rid: str, code: int, body: dict[str, Any]) -> bytes:
        """A whole error response (status, JSON body); the frontend drops the request once it is sent."""
        context.set_response_status(code, REASONS.get(code, "Error"), idx)  # the reason phrase stays ASCII
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
