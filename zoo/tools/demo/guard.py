"""The demo's ASGI guard: Gradio routes a client can misuse answer 4xx (never 500), and uploads are refused.

Why: Gradio 6 answers a ``POST /gradio_api/queue/join`` with an unknown ``fn_index``, a ``/gradio_api/api/<fn>``
call with too few inputs and a ``/gradio_api/component_server`` call with an unknown component id with a 500,
as for a server fault; ``GET /gradio_api/call/<fn>/<event>`` and ``/gradio_api/queue/data`` for an unknown event
or session start a 200 stream that then breaks; and ``/gradio_api/upload`` stores any file (50 MB was stored and
served back) though the demo has no file input. Each is checked here before Gradio sees it, with the demo's own
tables (its functions, their inputs, its components, its queue's sessions), and answered with a JSON ``detail``.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qs

#: Bodies the guard reads to check them (Gradio's own JSON requests are far smaller; the demo caps text at 20,000
#: characters).
MAX_BODY = 1 << 20
#: How deep a JSON body may nest (Gradio's requests nest a few levels: an object, its ``data`` list, a value). A
#: deeper one is refused here: Python's parser (the guard's, then Gradio's) raised RecursionError, a 500.
MAX_DEPTH = 32
NAMED = re.compile(r"^/gradio_api/(call|run|api)/([^/]+)/?(?:([^/]+)/?)?$")
BODY_CHECKED = re.compile(r"^/gradio_api/(?:queue/join|component_server|call/[^/]+|run/[^/]+|api/[^/]+)/?$")


class GuardRoutes:
    """ASGI middleware over the Gradio app of ``demo`` (whose public API names are ``known``)."""

    def __init__(self, app: Any, demo: Any, known: set[str]):
        self.app, self.demo, self.known = app, demo, known

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        refusal = self._by_path(path, method, scope.get("query_string", b"").decode("latin-1"))
        if refusal is None and method == "POST" and BODY_CHECKED.match(path):
            body = await _read_body(receive)
            if body is None:
                refusal = (413, f"request body over {MAX_BODY:,} bytes")
            else:
                refusal = self._by_body(path, body)
                receive = _replay(body, receive)
        if refusal is not None:
            await _send_json(send, *refusal)
            return
        await self.app(scope, receive, send)

    def _fns(self) -> dict[str, Any]:
        return {fn.api_name: fn for fn in self.demo.fns.values() if fn.api_name in self.known}

    def _by_path(self, path: str, method: str, query: str) -> tuple[int, str] | None:
        if path.rstrip("/") == "/gradio_api/upload":
            return 403, "uploads are not accepted: this demo has no file input"
        named = NAMED.match(path)
        if named and named[2] not in self.known:
            return 404, (f"unknown API endpoint {named[2]!r}; the endpoints are "
                         + ", ".join(f"/{n}" for n in sorted(self.known)))
        sessions = self.demo._queue.pending_messages_per_session
        if named and named[1] == "call" and named[3] and method == "GET":
            event = named[3]
            known_event = event in self.demo._queue.event_ids_to_events or any(
                event in ids for ids in self.demo._queue.pending_event_ids_session.values())
            if not known_event:
                return 404, f"unknown event {event[:64]!r} (events last only until their result is read)"
        if path.rstrip("/") == "/gradio_api/queue/data" and method == "GET":
            session = (parse_qs(query).get("session_hash") or [""])[0]
            if session not in sessions:
                return 404, "unknown session: join the queue first (POST /gradio_api/queue/join)"
        return None

    def _by_body(self, path: str, raw: bytes) -> tuple[int, str] | None:
        too_deep = 400, f"JSON nested more than {MAX_DEPTH} levels deep"
        try:
            body = json.loads(raw)
        except RecursionError:
            return too_deep
        except ValueError:
            return None  # Gradio's own 422 names it
        if _nesting(body) > MAX_DEPTH:
            return too_deep
        if not isinstance(body, dict):
            return None
        path = path.rstrip("/")
        if path == "/gradio_api/component_server":
            cid = body.get("component_id")
            if isinstance(cid, int) and cid not in self.demo.blocks:
                return 404, f"unknown component_id {cid}"
            return None
        if path == "/gradio_api/queue/join":
            fn_index = body.get("fn_index")
            if not isinstance(fn_index, int) or isinstance(fn_index, bool):
                return None  # Gradio's own 400/422
            fn = self.demo.fns.get(fn_index)
            if fn is None:
                return 404, f"unknown fn_index {fn_index}"
        else:
            fn = self._fns().get(path.rsplit("/", 1)[-1])
        data = body.get("data")
        if fn is not None and isinstance(data, list) and len(data) != len(fn.inputs):
            return 422, f"{fn.api_name or 'this event'} takes {len(fn.inputs)} input value(s), got {len(data)}"
        return None


def _nesting(value: Any) -> int:
    """How deep a decoded JSON value's arrays and objects nest (without recursion, whatever its shape)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


async def _read_body(receive: Any) -> bytes | None:
    """The whole request body, or None past :data:`MAX_BODY`."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the app the body already read, then the client's later messages."""
    sent = False

    async def again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _send_json(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
