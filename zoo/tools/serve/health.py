"""Is a server up: readiness while it starts (:func:`wait_ready`) and every part named later
(:func:`server_status`, what ``zoo serve status`` prints).

Why a server is "up" only when every part is: the proxy and the Java frontend alive by their records, each model
with a READY worker, each recorded port listened on. A healthy /ping alone hid a dead worker or a port held by a
stranger.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from zoo.tools.serve import supervise
from zoo.tools.serve.config import KEY_FILE, PARTS, ServeError, ServerConfig, read_state
from zoo.tools.serve.keys import key_expiry, management_key, read_keys
from zoo.tools.serve.probe import http_get


def _load_failure(run_dir: Path) -> str | None:
    """The worker's "Failed to load model" message: TorchServe would retry such a worker forever."""
    log = run_dir / "logs" / "model_log.log"
    if not log.is_file():
        return None
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        msg = line.split(" - ", 1)[-1].strip()
        if msg.startswith("Failed to load model"):
            return msg[:400]
    return None


def model_workers(cfg: ServerConfig, run_dir: Path, name: str) -> list[dict[str, Any]]:
    """The workers the management API describes for ``name`` (id, pid, status)."""
    code, body = http_get(f"{cfg.url('management')}/models/{name}", management_key(run_dir, cfg))
    if code != 200:
        return []
    try:
        return json.loads(body)[0].get("workers", [])
    except (json.JSONDecodeError, IndexError, KeyError, AttributeError):
        return []


def _check_alive(run_dir: Path, proc, front) -> None:
    """Fail fast, with the reason, when a process of the starting server exited or a model cannot load."""
    if proc.poll() is not None:
        raise ServeError(f"TorchServe exited with status {proc.returncode} during start; "
                         f"see {run_dir / 'logs' / 'server.out'}")
    if front is not None and front.poll() is not None:
        log = run_dir / "logs" / "front.log"
        last = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
        raise ServeError(f"the front door (HAProxy) exited with status {front.returncode} during start"
                         f"{': ' + last[0] if last else ''} (see {log})")
    failure = _load_failure(run_dir)
    if failure:
        raise ServeError(f"{failure} (see {run_dir / 'logs' / 'model_log.log'})")


def wait_ready(cfg: ServerConfig, run_dir: Path, proc, timeout: float, front=None) -> None:
    """Wait (bounded) until /ping is healthy (through the front door) and every model has a READY worker."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(run_dir, proc, front)
        keys = read_keys(run_dir)
        if cfg.disable_token_auth or keys:
            code, body = http_get(f"{cfg.url('inference')}/ping", keys.get("inference"))
            if code == 200 and b"Healthy" in body and all(
                    any(w.get("status") == "READY" for w in model_workers(cfg, run_dir, n)) for n in cfg.models):
                return
        time.sleep(0.5)
    raise ServeError(f"TorchServe was not healthy after {timeout:.0f} s; see {run_dir / 'logs'}")


def _down_parts(state: dict[str, Any], cfg: ServerConfig, run_dir: Path) -> tuple[list[str], dict[str, Any]]:
    """The parts of a recorded server that are not working, named, and each model's workers."""
    down = [part for part in PARTS if part in state.get("processes", {}) and supervise.alive(state, part) is None]
    models: dict[str, Any] = {}
    if "TorchServe frontend" not in down:
        for name in cfg.models:
            models[name] = [{"pid": w.get("pid"), "status": w.get("status")}
                            for w in model_workers(cfg, run_dir, name)]
            if not any(w["status"] == "READY" for w in models[name]):
                down.append(f"model {name}: no READY worker")
    listening = supervise.held_ports(state)
    for name, port in state.get("ports", {}).items():
        if name not in listening and not (name == "inference" and "front door" in down):
            down.append(f"port {port} ({name}): nothing listens")
    return down, models


def server_status(run_dir: Path) -> dict[str, Any]:
    """The saved state of the server in ``run_dir`` with ``running``, its health, each model's workers and the
    parts that are ``down`` (or, when nothing runs, the ports a stranger still holds)."""
    state = read_state(run_dir)
    base = {"running": False, "run_dir": str(run_dir), "logs": str(run_dir / "logs")}
    if state is None or not any(supervise.alive(state, part) for part in PARTS):
        held = supervise.held_ports(state) if state else {}
        return {**base, "down": [f"port {p} ({n}) still held by {supervise.holder(p)}" for n, p in held.items()]}
    cfg = ServerConfig(**state["config"])
    code, body = http_get(f"{cfg.url('inference')}/ping", read_keys(run_dir).get("inference"))
    health = json.loads(body).get("status") if code == 200 else f"HTTP {code}" if code else "no answer"
    if code in (400, 401, 403) and read_keys(run_dir):  # the front door answers a bad or expired key with 401
        expiry = key_expiry(run_dir).get("inference", "?")
        health = (f"HTTP {code}: the inference key in {run_dir / KEY_FILE} was refused (expiry {expiry}); run "
                  f"`zoo serve refresh-keys --run-dir {run_dir}` for new keys")
    down, models = _down_parts(state, cfg, run_dir)
    return {**state, "running": True, "health": health, "models": models, "down": down}
