"""TorchServe handler for alstm-zoo language models: ``score`` and ``generate`` over HTTP.

Why a custom handler: TorchServe's ``BaseHandler`` unpickles full models (``torch.load`` without
``weights_only``); this one loads the checkpoint the archive carries (config.json +
model.safetensors + vocab.json, or an ONNX export through the library's backends) with the
library's own loader, and computes every number with the library's own code
(:meth:`zoo.pretrained.ZooModel.score` / ``.stream`` and :class:`zoo.generation.SamplingParams`),
so the server answers exactly what the Python API answers.

Request bodies (decoded here, never by the worker: ``decode_input_request=false``):

* ``application/json``: ``{"task": "score", "texts": [...], "return_tokens": false}`` or
  ``{"task": "generate", "prompt": "...", "max_new_tokens": 50, "temperature": 1.0, "top_k": 0,
  "top_p": 1.0, "seed": null, "stream": false}``;
* ``text/plain`` (or no content type): the body is one text to score.

Every bad input is answered for its own request with HTTP 400 and
``{"code": 400, "type": "BadRequest", "field": ..., "message": ...}``; the other requests of the
batch are still served and the worker never dies. The score requests of a batch go through one
``ZooModel.score`` call over all their texts (batched scores equal unbatched ones to float
tolerance); generation requests run one after the other, streamed as NDJSON when asked.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

try:
    import torch

    from zoo.generation import MAX_NEW_TOKENS_LIMIT, SamplingParams
    from zoo.pretrained import ZooModel
    from zoo.scoring import summarize
except ImportError as e:  # the worker's Python must be the project's environment (zoo serve sets it)
    raise ImportError(f"the TorchServe worker cannot import the zoo library ({e}); start the server with "
                      f"`zoo serve start`, which runs the workers with the project's Python") from None

#: Limits applied when the archive's model-config yaml does not set them (``handler:`` section).
DEFAULT_LIMITS = {"max_texts": 64, "max_chars": 10_000, "max_total_chars": 100_000, "max_new_tokens": 512,
                  "max_prompt_chars": 10_000}
SCORE_KEYS = {"task", "texts", "text", "return_tokens"}
GENERATE_KEYS = {"task", "prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stream"}
JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"
PHRASES = {400: "Bad Request", 500: "Internal Server Error"}
TOKENS_METRIC = "zoo_tokens_scored_total"


class BadRequest(Exception):
    """A client error in one request: answered with HTTP 400 naming ``field``."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name
        self.message = message


@dataclass
class Job:
    """One parsed request of a batch."""

    task: str
    texts: list[str] = field(default_factory=list)
    return_tokens: bool = False
    prompt: str = ""
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False


# -- parsing and validation ---------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


def _decode_utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest("body", f"not valid UTF-8 (byte {e.start})") from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _check_text(value: Any, name: str, max_chars: int, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise BadRequest(name, f"must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadRequest(name, "is empty")
    if len(value) > max_chars:
        raise BadRequest(name, f"is {len(value)} characters long; the limit is {max_chars}")
    return value


def parse_score(req: dict[str, Any], limits: dict[str, int]) -> Job:
    if "texts" in req and "text" in req:
        raise BadRequest("texts", "give either texts or text, not both")
    if "text" in req:
        texts = [_check_text(req["text"], "text", limits["max_chars"])]
    else:
        if "texts" not in req:
            raise BadRequest("texts", "missing: a list of strings to score")
        texts = req["texts"]
        if not isinstance(texts, list):
            raise BadRequest("texts", f"must be a list of strings, got {type(texts).__name__}")
        if not texts:
            raise BadRequest("texts", "is an empty list")
        if len(texts) > limits["max_texts"]:
            raise BadRequest("texts", f"has {len(texts)} texts; the limit is {limits['max_texts']} per request")
        texts = [_check_text(t, f"texts[{i}]", limits["max_chars"]) for i, t in enumerate(texts)]
    total = sum(len(t) for t in texts)
    if total > limits["max_total_chars"]:
        raise BadRequest("texts", f"{total} characters in all; the limit is {limits['max_total_chars']} per request")
    return_tokens = req.get("return_tokens", False)
    if not isinstance(return_tokens, bool):
        raise BadRequest("return_tokens", "must be true or false")
    return Job("score", texts=texts, return_tokens=return_tokens)


def parse_generate(req: dict[str, Any], limits: dict[str, int]) -> Job:
    prompt = _check_text(req.get("prompt", ""), "prompt", limits["max_prompt_chars"], allow_empty=True)
    sampling: dict[str, Any] = {}
    for name in ("max_new_tokens", "top_k"):
        if name in req:
            if not _is_int(req[name]):
                raise BadRequest(name, "must be an integer")
            sampling[name] = req[name]
    for name in ("temperature", "top_p"):
        if name in req:
            if not _is_number(req[name]):
                raise BadRequest(name, "must be a finite number")
            sampling[name] = float(req[name])
    if req.get("seed") is not None:
        if not _is_int(req["seed"]) or not 0 <= req["seed"] < 2**63:
            raise BadRequest("seed", "must be an integer in [0, 2**63) or null")
        sampling["seed"] = req["seed"]
    cap = min(limits["max_new_tokens"], MAX_NEW_TOKENS_LIMIT)
    if sampling.get("max_new_tokens", 0) > cap:
        raise BadRequest("max_new_tokens", f"must be an integer in [0, {cap}] on this server")
    try:
        SamplingParams(**sampling)  # the library's validation, so server and Python API accept the same values
    except ValueError as e:
        msg = str(e)
        raise BadRequest(msg.split()[0], msg) from None
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "must be true or false")
    return Job("generate", prompt=prompt, sampling=sampling, stream=stream)


def parse_request(raw: Any, content_type: str, limits: dict[str, int]) -> Job:
    """Turn one request body into a validated :class:`Job`, or raise :class:`BadRequest`."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    if not isinstance(raw, bytes | bytearray):
        raise BadRequest("body", "send a JSON object (Content-Type: application/json) or text/plain")
    media = content_type.split(";")[0].strip().lower()
    if media and media != JSON_TYPE and not media.startswith("text/"):
        raise BadRequest("Content-Type", f"unsupported {media!r}; send application/json or text/plain")
    text = _decode_utf8(bytes(raw))
    if media != JSON_TYPE:
        return Job("score", texts=[_check_text(text, "body", limits["max_chars"])])
    try:
        req = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise BadRequest("body", f"not valid JSON ({e})") from None
    except RecursionError:
        raise BadRequest("body", "JSON nested too deeply") from None
    if not isinstance(req, dict):
        raise BadRequest("body", f"expected a JSON object, got {type(req).__name__}")
    task = req.get("task", "score")
    if task not in ("score", "generate"):
        raise BadRequest("task", f"unknown task {task!r}; use 'score' or 'generate'")
    allowed = SCORE_KEYS if task == "score" else GENERATE_KEYS
    unknown = sorted(set(req) - allowed)
    if unknown:
        raise BadRequest(unknown[0], f"unknown field for task {task!r} (allowed: {', '.join(sorted(allowed))})")
    return parse_score(req, limits) if task == "score" else parse_generate(req, limits)


def _finite(obj: Any) -> Any:
    """JSON has no NaN/Infinity: replace them by null so every client can parse the reply."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> bytes:
    return json.dumps(_finite(obj), ensure_ascii=False).encode("utf-8")


def corpus_of(results: list[dict[str, Any]], texts: list[str]) -> dict[str, Any]:
    """The token-weighted aggregate :func:`zoo.scoring.score_texts` reports, for one request's texts."""
    corpus = summarize(sum(r["nll"] for r in results), sum(r["num_tokens"] for r in results),
                       sum(len(t) for t in texts))
    corpus["num_texts"] = len(results)
    corpus["oov"] = sum(r["oov"] for r in results)
    corpus["num_unk"] = sum(r["num_unk"] for r in results)
    return corpus


# -- the service ----------------------------------------------------------------------------------------------
class ZooService:
    """Loads the archived checkpoint once per worker and serves batches of requests."""

    def __init__(self) -> None:
        self.model: ZooModel | None = None
        self.limits = dict(DEFAULT_LIMITS)
        self.tokens_metric: Any = None
        self.model_name = "model"

    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties["model_dir"]
        self.model_name = context.model_name
        cfg = dict((getattr(context, "model_yaml_config", None) or {}).get("handler") or {})
        for key in DEFAULT_LIMITS:
            if key in cfg:
                self.limits[key] = int(cfg[key])
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
        self.model = model
        try:
            from ts.metrics.metric_type_enum import MetricTypes

            self.tokens_metric = context.metrics.add_metric_to_cache(
                TOKENS_METRIC, unit="count", dimension_names=["ModelName"], metric_type=MetricTypes.COUNTER)
        except Exception:  # metrics are an extra; serving must not depend on them
            logger.warning("custom metric %s unavailable", TOKENS_METRIC, exc_info=True)
        logger.info("zoo handler ready: %r, limits %s", model, self.limits)

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
        started = time.perf_counter()
        out: list[bytes] = [b""] * len(data)
        jobs: dict[int, Job] = {}
        for i, row in enumerate(data):
            context.set_response_header(i, "X-Zoo-Batch-Size", str(len(data)))
            try:
                raw = row.get("body", row.get("data")) if isinstance(row, dict) else None
                jobs[i] = parse_request(raw, self._content_type(context, i), self.limits)
            except BadRequest as e:
                out[i] = self._error(context, i, 400, "BadRequest", e.message, e.field)
        score_ids = [i for i, j in jobs.items() if j.task == "score"]
        if score_ids:
            self._score(score_ids, jobs, out, context)
        for i in (i for i, j in jobs.items() if j.task == "generate"):
            try:
                out[i] = self._generate(i, jobs[i], context)
            except Exception:  # a bug, not bad input: fail this request only and keep the worker alive
                logger.exception("generation failed")
                out[i] = self._error(context, i, 500, "InternalServerError", "generation failed; see model_log.log")
        logger.debug("batch of %d request(s) served in %.1f ms", len(data), 1000 * (time.perf_counter() - started))
        return out

    @staticmethod
    def _error(context: Any, idx: int, code: int, kind: str, message: str, field_name: str | None = None) -> bytes:
        context.set_response_status(code, PHRASES.get(code, kind), idx)  # the reason phrase stays plain ASCII
        context.set_response_content_type(idx, JSON_TYPE)
        body: dict[str, Any] = {"code": code, "type": kind, "message": message}
        if field_name is not None:
            prefixed = message if message.startswith(field_name) else f"{field_name}: {message}"
            body = {"code": code, "type": kind, "field": field_name, "message": prefixed}
        return dumps(body)

    def _score(self, ids: list[int], jobs: dict[int, Job], out: list[bytes], context: Any) -> None:
        """All texts of all score requests in one library call, then split back per request."""
        assert self.model is not None
        texts = [t for i in ids for t in jobs[i].texts]
        try:
            report = self.model.score(texts, return_tokens=any(jobs[i].return_tokens for i in ids))
        except Exception:
            logger.exception("scoring failed")
            for i in ids:
                out[i] = self._error(context, i, 500, "InternalServerError", "scoring failed; see model_log.log")
            return
        pos = 0
        for i in ids:
            job = jobs[i]
            results = report.texts[pos:pos + len(job.texts)]
            pos += len(job.texts)
            if not job.return_tokens:
                results = [{k: v for k, v in r.items() if k != "tokens"} for r in results]
            context.set_response_content_type(i, JSON_TYPE)
            out[i] = dumps({"texts": results, "corpus": corpus_of(results, job.texts)})
        if self.tokens_metric is not None:
            try:
                self.tokens_metric.add_or_update(sum(r["num_tokens"] for r in report.texts), [self.model_name])
            except Exception:
                logger.warning("could not update %s", TOKENS_METRIC, exc_info=True)

    def _generate(self, idx: int, job: Job, context: Any) -> bytes:
        assert self.model is not None
        pieces = self.model.stream(job.prompt, **job.sampling)
        if not job.stream:
            context.set_response_content_type(idx, JSON_TYPE)
            parts = list(pieces)
            return dumps({"prompt": job.prompt, "text": "".join(parts), "num_tokens": len(parts)})
        from ts.handler_utils.utils import send_intermediate_predict_response

        context.set_response_content_type(idx, NDJSON_TYPE)
        count = 0
        for piece in pieces:
            count += 1
            send_intermediate_predict_response({idx: dumps({"text": piece}) + b"\n"},
                                               {idx: context.request_ids[idx]}, "Intermediate response", 200,
                                               context)
        return dumps({"text": "", "done": True, "num_tokens": count}) + b"\n"


_service = ZooService()


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[bytes] | None:
    """TorchServe's module-level entry point: called once with ``data=None`` to load, then per batch."""
    if _service.model is None:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
