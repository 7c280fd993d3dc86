"""TorchServe handler for alstm-zoo language models: ``score`` and ``generate`` over HTTP.

Why a custom handler: TorchServe's ``BaseHandler`` unpickles full models (``torch.load`` without
``weights_only``); this one loads the checkpoint the archive carries (config.json +
model.safetensors + vocab.json, or an ONNX export through the library's backends) with the
library's own loader, and parses, validates and runs every request through the framework-free service
core (:mod:`zoo.service`: the one request schema the demo and the CLI use too), so the server answers
exactly what the Python API answers.

Request bodies (decoded here, never by the worker: ``decode_input_request=false``):

* ``application/json``: ``{"task": "score", "texts": [...], "return_tokens": false}`` or
  ``{"task": "generate", "prompt": "...", "max_new_tokens": 50, "temperature": 1.0, "top_k": 0,
  "top_p": 1.0, "seed": null, "stop_at_eos": true, "stream": false}``;
* ``text/plain`` (or no content type): the body is one text to score.

Every bad input is answered for its own request with HTTP 400 and
``{"code": 400, "type": "BadRequest", "field": ..., "message": ...}``; the other requests of the
batch are still served and the worker never dies (anything unforeseen fails its own request with a
500, never the batch). The score requests of a batch go through one
``ZooModel.score`` call over all their texts (batched scores equal unbatched ones to float
tolerance); generation requests run one after the other, streamed as NDJSON when asked.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

try:
    import torch

    from zoo.errors import InvalidRequest
    from zoo.pretrained import ZooModel
    from zoo.service import GenerateRequest, Limits, Request, ScoreRequest, Service, error_body, parse_body, to_json
except ImportError as e:  # the worker's Python must be the project's environment (zoo serve sets it)
    raise ImportError(f"the TorchServe worker cannot import the zoo library ({e}); start the server with "
                      f"`zoo serve start`, which runs the workers with the project's Python") from None

JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"
PHRASES = {400: "Bad Request", 500: "Internal Server Error"}
TOKENS_METRIC = "zoo_tokens_scored_total"


# -- the service ----------------------------------------------------------------------------------------------
class ZooService:
    """Loads the archived checkpoint once per worker and serves batches through :class:`zoo.service.Service`."""

    def __init__(self) -> None:
        self.service: Service | None = None
        self.tokens_metric: Any = None
        self.model_name = "model"

    @property
    def model(self) -> ZooModel | None:
        return self.service.model if self.service is not None else None

    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties["model_dir"]
        self.model_name = context.model_name
        cfg = dict((getattr(context, "model_yaml_config", None) or {}).get("handler") or {})
        limits = Limits.from_mapping(cfg)
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
        """Answer every request of the batch; a failure is confined to its own request (never raised)."""
        started = time.perf_counter()
        out: list[bytes] = [b""] * len(data)
        jobs: dict[int, Request] = {}
        for i, row in enumerate(data):
            try:
                context.set_response_header(i, "X-Zoo-Batch-Size", str(len(data)))
                raw = row.get("body", row.get("data")) if isinstance(row, dict) else None
                jobs[i] = parse_body(raw, self._content_type(context, i), self.service.limits)
            except InvalidRequest as e:
                out[i] = self._reply(context, i, 400, error_body(e))
            except Exception:  # a bug in parsing: this request alone fails
                logger.exception("parsing request %d failed", i)
                out[i] = self._internal_error(context, i, "parsing")
        score_ids = [i for i, j in jobs.items() if isinstance(j, ScoreRequest)]
        if score_ids:
            self._score(score_ids, jobs, out, context)
        for i in (i for i, j in jobs.items() if isinstance(j, GenerateRequest)):
            try:
                out[i] = self._generate(i, jobs[i], context)
            except InvalidRequest as e:
                out[i] = self._reply(context, i, 400, error_body(e))
            except Exception:  # a bug, not bad input: fail this request only and keep the worker alive
                logger.exception("generation failed")
                out[i] = self._internal_error(context, i, "generation")
        logger.debug("batch of %d request(s) served in %.1f ms", len(data), 1000 * (time.perf_counter() - started))
        return out

    @staticmethod
    def _reply(context: Any, idx: int, code: int, body: dict[str, Any]) -> bytes:
        if code != 200:
            context.set_response_status(code, PHRASES.get(code, "Error"), idx)  # the reason phrase stays ASCII
        context.set_response_content_type(idx, JSON_TYPE)
        return to_json(body)

    def _internal_error(self, context: Any, idx: int, what: str) -> bytes:
        return self._reply(context, idx, 500, {"code": 500, "type": "InternalServerError",
                                               "message": f"{what} failed; see model_log.log"})

    def _score(self, ids: list[int], jobs: dict[int, Request], out: list[bytes], context: Any) -> None:
        """All score requests of the batch through the service core (one library call, isolated on failure)."""
        assert self.service is not None
        replies = self.service.score([jobs[i] for i in ids])
        scored = 0
        for i, reply in zip(ids, replies, strict=True):
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

    def _generate(self, idx: int, job: GenerateRequest, context: Any) -> bytes:
        assert self.service is not None
        if not job.stream:
            return self._reply(context, idx, 200, self.service.generate(job))
        from ts.handler_utils.utils import send_intermediate_predict_response

        context.set_response_content_type(idx, NDJSON_TYPE)
        count = 0
        for piece in self.service.stream(job):
            count += 1
            send_intermediate_predict_response({idx: to_json({"text": piece}) + b"\n"},
                                               {idx: context.request_ids[idx]}, "Intermediate response", 200,
                                               context)
        return to_json({"text": "", "done": True, "num_tokens": count, "warnings": list(job.warnings)}) + b"\n"


_service = ZooService()


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[bytes] | None:
    """TorchServe's module-level entry point: called once with ``data=None`` to load, then per batch."""
    if _service.service is None:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
