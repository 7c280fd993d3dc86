"""A server's keys: the clients' key file in the run dir, TorchServe's own behind the front door, their expiry,
and new keys for a running server.

Why two key files behind the front door: the clients hold the front door's key (256 bits, expiring like
TorchServe's) and nothing else; TorchServe's own keys (inference, management: it can scale workers) stay in its
private working folder (:func:`~zoo.tools.serve.config.ts_dir`), known only to the proxy that forwards to it and to
the server's owner, who reads the management key there (:func:`management_key`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from zoo.tools.serve import front_door, supervise
from zoo.tools.serve.config import KEY_FILE, ServeError, ServerConfig, read_state, ts_dir
from zoo.tools.serve.probe import http_get


def read_keys(run_dir: Path) -> dict[str, str]:
    """Inference/management/API keys from TorchServe's key file (empty when auth is off or not written yet)."""
    try:
        data = json.loads((run_dir / KEY_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return {kind: data[kind]["key"] for kind in ("inference", "management", "API")
            if isinstance(data.get(kind), dict) and "key" in data[kind]}


def key_expiry(run_dir: Path) -> dict[str, str]:
    """When each expiring key runs out (ISO 8601, as TorchServe wrote it)."""
    try:
        data = json.loads((run_dir / KEY_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return {kind: str(data[kind]["expiration time"]) for kind in ("inference", "management")
            if isinstance(data.get(kind), dict) and "expiration time" in data[kind]}


def wait_ts_keys(run_dir: Path, cfg: ServerConfig, proc, timeout: float) -> dict[str, Any]:
    """TorchServe's own key file (behind the front door), once it has written it."""
    path = ts_dir(run_dir, cfg) / KEY_FILE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServeError(f"TorchServe exited with status {proc.returncode} during start; "
                             f"see {run_dir / 'logs' / 'server.out'}")
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            time.sleep(0.2)
    raise ServeError(f"TorchServe wrote no key file in {timeout:.0f} s; see {run_dir / 'logs'}")


def management_key(run_dir: Path, cfg: ServerConfig | dict[str, Any]) -> str | None:
    """TorchServe's management key, which the management and metrics ports take: the server owner's, from
    TorchServe's own key file (private behind the front door; the run dir's without it)."""
    return read_keys(ts_dir(run_dir, cfg)).get("management")


def write_client_keys(run_dir: Path, tmp: Path, cfg: ServerConfig, ts_keys: dict[str, Any]) -> None:
    """The clients' key file: the front door's own inference key (256 bits, expiring like TorchServe's keys),
    and nothing else (TorchServe's management key can scale workers: it stays in the private folder)."""
    key, expires = front_door.new_key(), time.time() + 60 * cfg.token_expiration_min
    front_door.write_key_map(tmp, key, expires)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))
    data = {"inference": {"key": key, "expiration time": when}}
    fd = os.open(run_dir / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def refresh_keys(run_dir: Path) -> dict[str, str]:
    """New keys from the running server: TorchServe's inference and management keys (its token API, authorised
    by its non-expiring API key; it rewrites its key file) and, behind the front door, a new client key, put into
    the running proxy without a restart. The old keys stop working. Returns the new expiry times."""
    state = read_state(run_dir)
    if supervise.alive(state, "TorchServe frontend") is None or state is None:
        raise ServeError(f"no server running from {run_dir}")
    cfg = ServerConfig(**state["config"])
    ts_file = ts_dir(run_dir, cfg) / KEY_FILE
    try:
        api = json.loads(ts_file.read_text(encoding="utf-8"))["API"]["key"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        raise ServeError(f"no API key in {ts_file} (token authorisation off?)") from None
    for kind in ("inference", "management"):
        code, body = http_get(f"{cfg.url('management')}/token?type={kind}", api)
        if code != 200:
            raise ServeError(f"refreshing the {kind} key failed: HTTP {code} {body[:200]!r}")
    if cfg.front_door:
        ts_keys = json.loads(ts_file.read_text(encoding="utf-8"))
        tmp = Path(state["tmp_dir"])
        write_client_keys(run_dir, tmp, cfg, ts_keys)
        key = read_keys(run_dir)["inference"]
        expires = time.time() + 60 * cfg.token_expiration_min
        front_door.replace_keys(tmp, key, expires, ts_keys["inference"]["key"],
                                (ts_keys["management"]["key"], ts_keys["API"]["key"]))
    return {**key_expiry(ts_dir(run_dir, cfg)), **key_expiry(run_dir)}
