"""HTTP statuses and both error shapes, written once for the worker (both dialects) and the front door's own replies.

Why one module: the status phrases and each error shape used to be written in the TorchServe handler, the service
core and the front door's renderer, and the copies disagreed (an OpenAI client refused for a full house got a 503
whose body said ``invalid_request_error``; the native shape had no type for 404). Torch-free and importing only
:mod:`zoo.errors`, so the front door's renderer (``zoo/tools/serve/front_door.py``) imports it without the model
stack.

* The native (zoo) shape: ``{"code": <status>, "type": "BadRequest", "field": <field or null>, "message"}``.
* OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, ``type`` ``invalid_request_error`` below 500
  and ``server_error`` from 500, ``code`` a string (:data:`OPENAI_CODES` for the zoo's own errors).
"""

from __future__ import annotations

import json
import math
from typing import Any

from zoo.errors import InvalidRequest, ZooError

JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"
SSE_TYPE = "text/event-stream"

#: The reason phrase of every status the server or its front door sends (ASCII: it goes on the status line).
REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 410: "Gone", 411: "Length Required", 413: "Payload Too Large",
           414: "URI Too Long", 417: "Expectation Failed", 425: "Too Early", 429: "Too Many Requests",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
#: OpenAI's ``code`` string for each status the worker answers a completion with (the front door's own 503 says
#: ``overloaded`` too).
OPENAI_CODES = {400: "invalid_value", 404: "model_not_found", 413: "request_too_large", 500: "internal_error",
                503: "overloaded"}
#: What a bug (not the client's error) says: the server's log has its traceback.
INTERNAL = "{what} failed; see the server's model log"


def error_status(err: Exception | None) -> int:
    """The HTTP status of a request's error: a :class:`~zoo.errors.ZooError`'s own (413 over the token budget, 404
    a model not served, 503 no place now, else 400), 500 for anything else (a bug)."""
    return int(getattr(err, "status", 400)) if isinstance(err, ZooError) else 500


def zoo_error(code: int, message: str, field: str | None = None) -> dict[str, Any]:
    """The native error shape (``type`` is the reason phrase without spaces: ``BadRequest``, ``NotFound``)."""
    return {"code": code, "type": REASONS[code].replace(" ", "").replace("-", ""), "field": field, "message": message}


def openai_error(code: int, message: str, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; ``kind`` is its ``code`` string (``model_not_found``, ``overloaded``, ...)."""
    err_type = "invalid_request_error" if code < 500 else "server_error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": kind}}


def both_shapes(code: int, message: str) -> dict[str, Any]:
    """For a reply sent before the path is known: the native fields and OpenAI's ``error`` in one object."""
    return {**zoo_error(code, message), **openai_error(code, message, kind=REASONS[code].lower().replace(" ", "_"))}


def _parts(err: Exception | None, what: str) -> tuple[int, str, str | None]:
    """``(status, message, field)`` of a request's error."""
    code = error_status(err)
    if code == 500:
        return code, INTERNAL.format(what=what), None
    if isinstance(err, InvalidRequest):
        return code, err.message, err.field
    return code, str(err), getattr(err, "field", None)


def native_error(err: Exception | None, what: str = "request") -> tuple[int, dict[str, Any]]:
    """The status and native body of a request's error (``None`` or a non-zoo exception: a bug, 500)."""
    code, message, field = _parts(err, what)
    return code, zoo_error(code, message, field)


def openai_error_of(err: Exception | None, what: str = "completion") -> tuple[int, dict[str, Any]]:
    """The status and OpenAI body of a request's error (a bug: 500 ``internal_error``)."""
    code, message, field = _parts(err, what)
    return code, openai_error(code, message, field, OPENAI_CODES.get(code, "invalid_value"))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def to_json(obj: Any) -> bytes:
    """UTF-8 JSON any client can parse: NaN/Infinity -> null; if anything cannot be encoded as UTF-8 (which
    validation should have made impossible), the reply is escaped ASCII JSON rather than an exception. (The walk
    that replaces NaN/Infinity runs only for a reply that has one: it cost a reply with per-token log-probabilities
    2% of its whole request.)"""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except ValueError:  # NaN or Infinity somewhere (UnicodeEncodeError is a ValueError too)
        pass
    clean = _finite(obj)
    try:
        return json.dumps(clean, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(clean, ensure_ascii=True).encode("ascii")
