"""The zoo's own wire format (``POST /predictions/<model>``): the service core's request schema (:mod:`zoo.api.service`)
over HTTP, replies as JSON, a streamed generation as NDJSON lines, errors in the native shape (:mod:`zoo.api.http`).

Request bodies: ``application/json`` (a score or generate request, :func:`zoo.api.service.parse_request`) or
``text/plain`` (one text to score). A streamed generation sends ``{"text": piece}`` lines and a last
``{"text": "", "done": true, "num_tokens", "warnings"}`` line (with ``"error"`` if it failed after its status went
out)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from zoo.api.dialects import Work
from zoo.api.http import JSON_TYPE, NDJSON_TYPE, native_error, to_json
from zoo.api.service import GenerateRequest, Limits, Request, Service, generate_reply, parse_body
from zoo.scoring import padded_positions


class NativeDialect:
    """The native route over one model (:class:`~zoo.api.dialects.Dialect`)."""

    def __init__(self, service: Service, served: str):
        self.service, self.served = service, served

    def parse(self, raw: Any, content_type: str, limits: Limits) -> Request:
        return parse_body(raw, content_type, limits)

    def generates(self, request: Request) -> bool:
        return isinstance(request, GenerateRequest)

    def work(self, request: Request, step_tokens: int) -> Work:
        encodings = self.service.within_budget(request)  # (413 now, before any model work)
        if isinstance(request, GenerateRequest):
            return Work(self._generation(request, step_tokens), long=True)
        long = padded_positions([len(e.ids) for e in encodings]) > step_tokens  # what score_steps computes
        together = None if long or request.dynamic else (request, encodings)
        return Work(self.service.score_steps(request, step_tokens, encodings), long, together)

    def run_together(self, items: list[Any]) -> list[Any]:
        """Score requests that fit one step, in one batched call (:meth:`zoo.api.service.Service.score_together`)."""
        return self.service.score_together(items)

    def _generation(self, request: GenerateRequest, step_tokens: int) -> Iterator[str | None]:
        """The generated pieces as they come (a ``None`` after each piece of the prompt read); returns the reply."""
        pieces = []
        for piece in self.service.stream_steps(request, step_tokens):
            if piece is not None:
                pieces.append(piece)
            yield piece
        return generate_reply(request, pieces)

    def content_type(self, request: Request) -> str:
        return NDJSON_TYPE if getattr(request, "stream", False) else JSON_TYPE

    def error(self, err: Exception | None, what: str = "request") -> tuple[int, dict[str, Any]]:
        return native_error(err, what)

    def chunk(self, job: Any, fresh: list[Any]) -> bytes:
        """A streamed generation's new NDJSON lines (and the closing line when done); anything else nothing until
        its whole JSON reply (an error after the 200 status line is the error body: the client sees a 200 whose body
        has ``code`` >= 400)."""
        request = job.request
        if not getattr(request, "stream", False):
            if not job.done:
                return b""
            return to_json(job.result if job.error is None else self.error(job.error, request.task)[1])
        body = b"".join(to_json({"text": piece}) + b"\n" for piece in fresh)
        if job.done:
            last: dict[str, Any] = {"text": "", "done": True, "num_tokens": len(job.pieces),
                                    "warnings": list(request.warnings)}
            if job.error is not None:
                last["error"] = self.error(job.error, request.task)[1]
            body += to_json(last) + b"\n"
        return body
