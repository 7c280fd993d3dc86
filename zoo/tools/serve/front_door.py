"""The front door of ``zoo serve``: HAProxy on the public inference port (``serving/haproxy.cfg``).

Why HAProxy: its ``timeout http-request`` with ``option http-buffer-request`` bounds the time to receive a whole
request, head and body, which nginx cannot (its timeouts run between two reads, so a body dripped one byte every
few seconds lived forever), and it can read the buffered JSON body to route an OpenAI-style request by its
``model``. Everything the proxy answers itself is JSON: the service core's shape (``{"code", "type", "message"}``,
``code`` equal to the HTTP status) on the native routes, OpenAI's (``{"error": {"message", "type", "param",
"code"}}``) under ``/v1/``, and both at once where the path is not known (a request head that is not HTTP).

This module renders the proxy's files into ``<run dir>/front`` (its config, the reply bodies, the Lua service that
answers malformed heads, the key maps, ``models.json``) and talks to a running proxy over its admin socket (new
keys without a restart).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import string
import time
from pathlib import Path
from typing import Any

from zoo.api.http import REASONS, both_shapes, openai_error, zoo_error
from zoo.errors import ConfigError
from zoo.tools import REPO

HAPROXY_TEMPLATE = REPO / "serving" / "haproxy.cfg"
#: a client key: 256 bits from the OS's CSPRNG (URL-safe base64, 43 characters)
KEY_BYTES = 32
#: the grammar a request head must match before HTTP parsing (RFC 9112: token method, origin-form target, HTTP/1.x,
#: header lines of a token name and visible/obs-text values, at most 100 of them; no Transfer-Encoding, at most one
#: Content-Length of digits). One regex with look-aheads because only a positive match is final before the deadline.
#: Also refused here, because HAProxy's parser answers them with its fixed HTML page: a ``#`` in the target (a
#: fragment is never sent), ``CONNECT`` (it takes an authority, never a path), two ``Host`` headers.
_TCHAR = r"[!\x23$%&\x27*+.^_\x60|~0-9A-Za-z-]"
_IN_HEAD = r"(?:[^\r\n]++\r\n)+?"  # (header lines up to the blank one: possessive, so no backtracking)
HEAD_REGEX = ("^(?!CONNECT )"
              rf"(?!{_IN_HEAD}(?i:transfer-encoding):)"
              rf"(?!{_IN_HEAD}(?i:host):{_IN_HEAD}(?i:host):)"
              rf"(?!{_IN_HEAD}(?i:content-length):(?![ \t]*+[0-9]{{1,15}}+[ \t]*+\r\n))"
              rf"(?!{_IN_HEAD}(?i:content-length):{_IN_HEAD}(?i:content-length):)"
              rf"{_TCHAR}++ /[!-\x22\x24-~]*+ HTTP/1\.[01]\r\n(?:{_TCHAR}++:[\t -~\x80-\xff]*+\r\n){{0,100}}+\r\n")
#: the statuses HAProxy can send from its own error pages (those its ``errorfile`` takes)
ERRORFILE_STATUSES = (400, 401, 403, 404, 405, 408, 410, 413, 425, 429, 500, 501, 502, 503, 504)
#: seconds a client is told to wait (Retry-After) when the server is full or not answering
RETRY_AFTER_S = 1
BUSY = "the model server is busy (its queue is full) or not answering; retry after the Retry-After seconds"
#: a client over its share of the server (ServerConfig.client_requests; a client is its address)
SHARE = ("you have {n} requests at the server already, the most one client (one address) may; send the next when "
         "one is answered (retry after the Retry-After seconds)")
ROUTES = "POST /predictions/<model>, GET /ping, POST /v1/completions, GET /v1/models"
#: why /v1/chat/completions is not served (its own 404, so a chat client is told what to do instead)
CHAT = ("chat completions are not served: these models are plain language models trained on corpus text, with no "
        "chat template and no roles; send the text as a prompt to POST /v1/completions")


class FrontDoorError(ConfigError):
    """The proxy is missing, or its config or admin socket failed: one line."""


def haproxy() -> str:
    found = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
                                             if os.access(p, os.X_OK)), None)
    if not found:
        raise FrontDoorError("the front door needs HAProxy: run `make system-deps` or `apt-get install haproxy` "
                             "(or start with --no-front-door, without its deadlines and request filtering)")
    return found


# -- reply bodies (the shapes and status phrases: zoo.api.http, the worker's own) ------------------------------------
#: bytes per character a valid body can spend at most: UTF-8 text (4), a JSON string (12: an astral character
#: escaped as a surrogate pair, ``\\ud83d\\ude00``)
TEXT_BYTES_PER_CHAR, JSON_BYTES_PER_CHAR = 4, 12
#: room in a JSON body for everything but the texts: field names, numbers, white space, stop sequences
JSON_SLACK_BYTES = 16 * 1024


def body_caps(cfg: Any, limits: Any | None) -> dict[str, int]:
    """The largest body a valid request can have, by kind (``text``: a ``text/plain`` body, one text; ``json``: a
    JSON body on either route), from the archive's character limits: a body over it is over every budget by its
    byte count alone, so the front door refuses it (413) without TorchServe or the worker. Without the limits (a
    server started from archives it did not build) only ``max_request_bytes``."""
    most = cfg.max_request_bytes
    if limits is None:
        return {"text": most, "json": most}
    text = TEXT_BYTES_PER_CHAR * limits.max_chars + 1024
    json_ = JSON_BYTES_PER_CHAR * limits.max_total_chars + 16 * limits.max_texts + JSON_SLACK_BYTES
    return {"text": min(most, text), "json": min(most, json_)}


def _bodies(cfg: Any, caps: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Every body the routes answer with, by file name (``<status>[-<what>].json``)."""
    limit = cfg.max_request_bytes
    busy = BUSY
    return {
        "413-text.json": zoo_error(413, f"a text/plain body is one text; over {caps['text']:,} bytes it is over "
                                        "the character limit", field="body"),
        "413-json.json": zoo_error(413, f"a JSON body over {caps['json']:,} bytes is over the character limits",
                                   field="body"),
        "413-v1-json.json": openai_error(413, f"a JSON body over {caps['json']:,} bytes is over the character "
                                              "limits", kind="request_too_large"),
        "400-type.json": zoo_error(400, "unsupported content type; send application/json or text/plain (one "
                                        "Content-Type header)", field="Content-Type"),
        "400-object.json": zoo_error(400, "a JSON body must be a JSON object ({\"task\": ..., ...})", field="body"),
        "400-task.json": zoo_error(400, "unknown task; use 'score' or 'generate'", field="task"),
        "413.json": both_shapes(413, f"request body over {limit} bytes"),
        "414.json": both_shapes(414, "request target too long"),
        "417.json": both_shapes(417, "the only expectation this server meets is Expect: 100-continue"),
        "431.json": both_shapes(431, "request headers too large"),
        "401.json": zoo_error(401, "missing or wrong key: send Authorization: Bearer <the server's key>"),
        "401-operator.json": zoo_error(401, "missing or wrong management key: send Authorization: Bearer <the "
                                            "management key in the run dir's backend/key_file.json>"),
        "401-v1.json": openai_error(401, "missing or wrong API key: send Authorization: Bearer <the server's key>",
                                    kind="invalid_api_key"),
        "405-ping.json": zoo_error(405, "method not allowed: GET or HEAD /ping"),
        "405.json": zoo_error(405, "method not allowed: POST /predictions/<model>"),
        "400-form.json": zoo_error(400, "form bodies are not accepted: send application/json or text/plain",
                                   field="Content-Type"),
        "404-model.json": zoo_error(404, f"no such model; served: {', '.join(cfg.models)}"),
        "404.json": zoo_error(404, f"not found: {ROUTES}"),
        "405-v1.json": openai_error(405, "method not allowed: POST /v1/completions", kind="method_not_allowed"),
        "405-v1-models.json": openai_error(405, "method not allowed: GET /v1/models", kind="method_not_allowed"),
        "400-v1-form.json": openai_error(400, "send the request as application/json", param=None,
                                         kind="invalid_content_type"),
        "400-v1-model.json": openai_error(400, "you must provide a model parameter (a JSON body with \"model\")",
                                          param="model", kind="model_required"),
        "404-v1-model.json": openai_error(404, f"the model does not exist; served: {', '.join(cfg.models)} "
                                               "(GET /v1/models)", param="model", kind="model_not_found"),
        "404-v1.json": openai_error(404, f"not found: {ROUTES}", kind="not_found"),
        "404-v1-chat.json": openai_error(404, CHAT, kind="chat_not_supported"),
        "503.json": zoo_error(503, busy),
        "503-v1.json": openai_error(503, busy, kind="overloaded"),
        "429.json": zoo_error(429, SHARE.format(n=cfg.client_requests)),
        "429-v1.json": openai_error(429, SHARE.format(n=cfg.client_requests), kind="rate_limit_exceeded"),
    }


def _raw_reply(code: int, body: dict[str, Any], extra: str = "") -> bytes:
    data = (json.dumps(body) + "\n").encode()
    head = (f"HTTP/1.1 {code} {REASONS[code]}\r\nContent-Type: application/json\r\nCache-Control: no-cache\r\n"
            f"Connection: close\r\n{extra}Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


def _error_files(front: Path) -> str:
    """HAProxy's own error pages (errorfile: a whole HTTP reply), both shapes, one per status it can send."""
    messages = {400: "malformed HTTP request", 408: "the request was not sent in time", 413: "request too large",
                500: "internal error in the front door", 502: "the model server is not answering; retry later",
                503: BUSY, 504: "the model server did not answer in time; retry later"}
    lines = []
    for code in ERRORFILE_STATUSES:
        extra = f"Retry-After: {RETRY_AFTER_S}\r\n" if code in (502, 503, 504) else ""
        path = front / f"errorfile-{code}.http"
        path.write_bytes(_raw_reply(code, both_shapes(code, messages.get(code, REASONS[code].lower())), extra))
        lines.append(f'    errorfile {code} "{path}"')
    return "\n".join(lines)


def _lua(front: Path) -> Path:
    """The services that answer a head refused by the TCP layer (HAProxy's HTTP parser would send HTML)."""
    replies = {400: "malformed HTTP/1.1 request head (request line, header lines, NUL or control bytes, "
                    "Content-Length, a '#' in the target, CONNECT, two Host headers)",
               408: "the request head was not sent in time",
               411: "send the body with a Content-Length (chunked request bodies are not accepted)",
               431: "request head too large"}
    out = []
    for code, message in replies.items():
        raw = _raw_reply(code, both_shapes(code, message)).decode()
        lua = raw.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r").replace("\n", "\\n")
        out.append(f"core.register_service(\"zoo_{code}\", \"tcp\", function(applet)\n"
                   f"    applet:send(\"{lua}\")\nend)\n")
    path = front / "errors.lua"
    path.write_text("\n".join(out), encoding="utf-8")
    return path


# -- /v1/models --------------------------------------------------------------------------------------------------
def model_facts(checkpoint: Path) -> dict[str, Any]:
    """What /v1/models says of a served model, from its checkpoint's config (the facts ``zoo info`` shows)."""
    from zoo.checkpoint import read_config

    config = read_config(checkpoint)
    metrics = config.get("metrics") or {}
    split = "test" if "test" in metrics else "valid" if "valid" in metrics else None
    return {"architecture": config.get("architecture"), "dataset": config.get("dataset"),
            "parameters": config.get("num_parameters"),
            "metric": {"name": metrics.get("metric"), "split": split, "value": metrics.get(split)} if split else None}


def models_json(checkpoints: dict[str, Path], created: int) -> dict[str, Any]:
    """``GET /v1/models``'s reply for the served ``{name: checkpoint dir}``."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "alstm-zoo",
                                        "zoo": model_facts(path)} for name, path in checkpoints.items()]}


# -- keys --------------------------------------------------------------------------------------------------------
def new_key() -> str:
    return secrets.token_urlsafe(KEY_BYTES)


def write_key_map(sock_dir: Path, key: str, expires: float) -> None:
    _write_private(sock_dir / "keys.map", f"{key} {int(expires)}\n")


def write_backend_map(sock_dir: Path, ts_inference_key: str) -> None:
    _write_private(sock_dir / "backend.map", f"inference {ts_inference_key}\n")


def write_management_map(sock_dir: Path, *ts_keys: str) -> None:
    """The keys the management and metrics ports take: TorchServe's management key and its API key (the one that
    makes new keys), both the server owner's."""
    _write_private(sock_dir / "management.map", "".join(f"{key} 1\n" for key in ts_keys))


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def admin(sock_dir: Path, command: str, timeout: float = 5.0) -> str:
    """One command on the running proxy's admin socket (HAProxy's runtime API); its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(sock_dir / "admin.sock"))
            s.sendall(command.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        except OSError as e:
            raise FrontDoorError(f"the front door's admin socket did not answer ({e})") from None
    return out.decode(errors="replace")


def replace_keys(sock_dir: Path, key: str, expires: float, ts_inference_key: str | None,
                 ts_management_keys: tuple[str, ...] = ()) -> None:
    """New keys in a running proxy, without a restart: the maps in memory (runtime API) and on disk."""
    for name, entries in (("keys.map", {key: str(int(expires))}),
                          ("backend.map", {"inference": ts_inference_key} if ts_inference_key else {}),
                          ("management.map", dict.fromkeys(ts_management_keys, "1"))):
        if not entries:
            continue
        path = sock_dir / name
        answer = admin(sock_dir, f"clear map {path}")
        for k, v in entries.items():
            answer += admin(sock_dir, f"add map {path} {k} {v}")
        if answer.strip():
            raise FrontDoorError(f"the front door refused new keys: {answer.strip()[:200]}")
    write_key_map(sock_dir, key, expires)
    if ts_inference_key:
        write_backend_map(sock_dir, ts_inference_key)
    if ts_management_keys:
        write_management_map(sock_dir, *ts_management_keys)


#: glibc's mmap threshold for the proxy: a request buffer (``tune.bufsize``, the largest body + 64 KiB) is then
#: always its own mapping, given back to the system when its connection ends. With glibc's dynamic threshold a
#: freed buffer raised it, later buffers came from the heap, and the memory of 2,000 slow large bodies (2.15 GB)
#: stayed with the proxy after they were gone; measured with this: 1,126 MB at 2,000 connections each 600 KB into
#: its body, 35 MB 3 s after they closed.
MMAP_THRESHOLD_BYTES = 128 * 1024


def proxy_env() -> dict[str, str]:
    """The proxy's environment: ours, with :data:`MMAP_THRESHOLD_BYTES` (memory of slow connections returned)."""
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}


def _connections(wanted: int) -> int:
    """Connections per layer: each client connection is two in the proxy (the TCP layer and the HTTP layer) and
    HAProxy wants two descriptors per connection, within the process's hard limit of open files."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return wanted
    return max(64, min(wanted, (hard - 400) // 4 - 50))


# -- the config --------------------------------------------------------------------------------------------------
def render(cfg: Any, front: Path, sock_dir: Path, checkpoints: dict[str, Path], response_timeout: int,
           backend: str, ts_auth: bool, limits: Any | None = None) -> Path:
    """All the proxy's files in ``front`` (made afresh); returns its config. ``backend``: TorchServe's inference
    address as HAProxy names it (``unix@/path`` or ``host:port``). ``sock_dir`` (private, short, no spaces: its
    paths go unquoted into sample expressions) holds the sockets and the key maps. ``limits``: the archives'
    request limits (:class:`~zoo.tools.serve.config.ArchiveOptions`), for :func:`body_caps`."""
    shutil.rmtree(front, ignore_errors=True)
    front.mkdir(parents=True, mode=0o700)
    caps = body_caps(cfg, limits)
    for name, body in _bodies(cfg, caps).items():
        (front / name).write_text(json.dumps(body) + "\n", encoding="utf-8")
    _lua(front)
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    auth_rules = backend_auth = operator_auth = ""
    if not cfg.disable_token_auth:
        if not (sock_dir / "management.map").exists():
            write_management_map(sock_dir, "-")
        operator_auth = (f'    http-request return status 401 content-type application/json file '
                         f'"{front}/401-operator.json" hdr WWW-Authenticate Bearer '
                         f'if !{{ http_auth_bearer,map_str({sock_dir}/management.map) -m found }}')
        keys = sock_dir / "keys.map"
        auth_rules = "\n".join([
            f'    http-request set-var(txn.key_expires) http_auth_bearer,map_str_int({keys},0)',
            "    http-request set-var(txn.now) date",
            "    acl key_live var(txn.key_expires),sub(txn.now) gt 0",
            f'    http-request return status 401 content-type application/json file "{front}/401-v1.json" '
            'hdr WWW-Authenticate Bearer if v1 !key_live',
            f'    http-request return status 401 content-type application/json file "{front}/401.json" '
            'hdr WWW-Authenticate Bearer if !key_live'])
        if not keys.exists():
            write_key_map(sock_dir, "-", 0)
    if ts_auth:
        backend_auth = ('    http-request set-header Authorization '
                        f'"Bearer %[str(inference),map({sock_dir}/backend.map)]"')
        if not (sock_dir / "backend.map").exists():
            write_backend_map(sock_dir, "-")
    # a body waits whole in one buffer: room for the largest allowed body and its head
    bufsize = cfg.max_request_bytes + 64 * 1024
    maxconn = _connections(cfg.max_connections)
    text = string.Template(HAPROXY_TEMPLATE.read_text(encoding="utf-8")).substitute(
        front_dir=front, sock_dir=sock_dir, listen=f"{host}:{cfg.inference_port}", backend=backend,
        client_timeout=cfg.client_timeout, send_timeout=3 * cfg.client_timeout,
        upstream_timeout=response_timeout + 10, bufsize=bufsize, head_max=bufsize - 1024,
        max_request_bytes=cfg.max_request_bytes, max_uri=8192, max_headers=16384,
        max_text_bytes=caps["text"], max_json_bytes=caps["json"],
        maxconn=maxconn, global_maxconn=2 * maxconn + 100,
        backend_maxconn=cfg.job_queue_size, retry_after=RETRY_AFTER_S, client_requests=cfg.client_requests,
        model_names=" ".join(cfg.models), head_regex=HEAD_REGEX, errorfiles=_error_files(front),
        auth_rules=auth_rules, backend_auth=backend_auth, operator_auth=operator_auth,
        management_listen=f"{host}:{cfg.management_port}", metrics_listen=f"{host}:{cfg.metrics_port}")
    path = front / "haproxy.cfg"
    path.write_text(text, encoding="utf-8")
    (front / "models.json").write_text(json.dumps(models_json(checkpoints, int(time.time()))) + "\n",
                                       encoding="utf-8")
    return path
