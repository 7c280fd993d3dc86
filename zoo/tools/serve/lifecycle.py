"""Starting and stopping a server, step by step: refuse what cannot work before anything is built or moved,
build the archives, launch the frontend and the front door, record every process and port in server.json, wait
until healthy; on any failure, and on ``stop``, end every recorded process by PID and wait until its ports are
free.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from zoo.tools.serve import supervise
from zoo.tools.serve.archive import build_archive
from zoo.tools.serve.config import (
    KEY_FILE,
    PARTS,
    STATE_FILE,
    ArchiveOptions,
    ServeError,
    ServerConfig,
    read_state,
    save_state,
    ts_dir,
)
from zoo.tools.serve.health import wait_ready
from zoo.tools.serve.launch import (
    choose_ports,
    java_version,
    launch_torchserve,
    ports_of,
    socket_dir,
    start_front_door,
)


def _clear_run_dir(run_dir: Path) -> None:
    """Refuse a run dir whose server is running; end what is left of one whose parts died (a worker orphaned by
    its frontend)."""
    state = read_state(run_dir)
    if state and any(supervise.alive(state, part) for part in PARTS):
        raise ServeError(f"a server is already running from {run_dir} (zoo serve stop --run-dir {run_dir})")
    if state:
        stop_server(run_dir)


def _check_java_and_names(models: list[tuple[str, str]]) -> None:
    version = java_version()
    if version is None or version < 17:
        raise ServeError("TorchServe needs Java 17 or newer (found: "
                         f"{'none' if version is None else version}); run `make system-deps` or "
                         "`apt-get install openjdk-17-jdk-headless`")
    names = [n for n, _ in models]
    if len(set(names)) != len(names):
        raise ServeError(f"duplicate model names in {names}")


def _prepare_folders(run_dir: Path, cfg: ServerConfig) -> Path:
    """The model store, a fresh logs/ (the previous run's kept as logs.prev) and the socket folder, returned."""
    store, logs, tmp = run_dir / "model-store", run_dir / "logs", socket_dir(run_dir, cfg)
    if logs.is_dir():  # keep the previous run's logs for one more run, but never read them as this run's
        shutil.rmtree(run_dir / "logs.prev", ignore_errors=True)
        logs.rename(run_dir / "logs.prev")
    shutil.rmtree(tmp / "models", ignore_errors=True)  # archives unpacked by an earlier run
    for d in (store, logs):
        d.mkdir(parents=True, exist_ok=True)
    return tmp


def _archives(models: list[tuple[str, str]], store: Path, options: ArchiveOptions | None, build: bool) -> None:
    for name, source in models:
        mar = store / f"{name}.mar"
        if build:
            build_archive(source, store, name, options)
        elif not mar.is_file():
            raise ServeError(f"{mar} not found (run zoo serve build, or start without --no-build)")


def _initial_state(run_dir: Path, cfg: ServerConfig, pid: int, tmp: Path) -> dict[str, Any]:
    """server.json as soon as the frontend runs: enough for ``stop`` to end it whatever happens next."""
    return {"pid": pid, "run_dir": str(run_dir), "started": time.time(), "config": asdict(cfg),
            "processes": {"TorchServe frontend": supervise.record(pid)}, "ports": ports_of(cfg),
            "sockets": [str(tmp / "inference.sock"), str(tmp / "http.sock"), str(tmp / "admin.sock")],
            "logs": str(run_dir / "logs"), "key_file": None if cfg.disable_token_auth else str(run_dir / KEY_FILE),
            "inference": cfg.url("inference"), "management": cfg.url("management"), "metrics": cfg.url("metrics"),
            "python": sys.executable, "tmp_dir": str(tmp)}


def start_server(models: list[tuple[str, str]], run_dir: Path, cfg: ServerConfig,
                 options: ArchiveOptions | None = None, build: bool = True, timeout: float = 180.0) -> dict[str, Any]:
    """Build the archives, launch the frontend (then the front door) in ``run_dir``, wait until healthy; returns
    the saved state."""
    _clear_run_dir(run_dir)
    _check_java_and_names(models)
    choose_ports(cfg)
    tmp = _prepare_folders(run_dir, cfg)
    _archives(models, run_dir / "model-store", options, build)
    cfg.models = dict(models)
    response_timeout = (options or ArchiveOptions()).response_timeout
    proc = launch_torchserve(cfg, run_dir, tmp, response_timeout)
    state = _initial_state(run_dir, cfg, proc.pid, tmp)
    save_state(run_dir, state)
    try:
        front = None
        if cfg.front_door:
            front = start_front_door(cfg, run_dir, tmp, run_dir / "logs", response_timeout, proc, timeout,
                                     (options or ArchiveOptions()) if build else None)
            state["front_pid"] = front.pid
            state["processes"]["front door"] = supervise.record(front.pid)
            save_state(run_dir, state)
        wait_ready(cfg, run_dir, proc, timeout, front)
    except BaseException:
        stop_server(run_dir)
        raise
    return state


def stop_server(run_dir: Path, timeout: float = 30.0) -> bool:
    """End every process of the server recorded in ``run_dir`` (by PID and process group, the front door first)
    and wait until its ports are free; False if none was running."""
    state = read_state(run_dir)
    if not state:
        return False
    ended = supervise.end_all(state, timeout)
    held = supervise.wait_ports_free(state)
    supervise.remove_sockets(state)
    if state.get("tmp_dir") and Path(state["tmp_dir"]).name.startswith("zoo-serve-"):
        shutil.rmtree(state["tmp_dir"], ignore_errors=True)  # the short socket dir made for a long run dir
    if held:
        raise ServeError("stopped the server's processes, but " + ", ".join(
            f"port {p} ({n}) is still held by {supervise.holder(p)}" for n, p in held.items()))
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    (run_dir / KEY_FILE).unlink(missing_ok=True)
    (ts_dir(run_dir, state.get("config", {})) / KEY_FILE).unlink(missing_ok=True)
    return ended > 0
