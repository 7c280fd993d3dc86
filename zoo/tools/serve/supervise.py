"""The processes and ports of one ``zoo serve`` server: recorded at start, checked by ``status``, ended by ``stop``.

Why a record of every process (PID, process group, start time) instead of the one frontend PID: killing one part
left the others running (an nginx worker orphaned by its master kept the port; a killed Java frontend left its
workers), ``status`` said "Healthy" or "not running" while a port was held, and ``start`` then refused. Each part
is started in its own session, so its process group holds it and everything it started (TorchServe's workers live
in the Java frontend's group and stay there when it dies). A process is only ever signalled when its PID, start
time or process group *and* its command line (which names this server's run dir or socket folder) match the
record: a PID or group id reused by another program is never touched, and nothing is found by name.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from zoo.tools.ports import port_free


def record(pid: int) -> dict[str, Any]:
    """What identifies a process we started: its PID, its process group and its start time."""
    import psutil

    proc = psutil.Process(pid)
    return {"pid": pid, "pgid": os.getpgid(pid), "create_time": proc.create_time()}


def _markers(state: dict[str, Any]) -> list[str]:
    return [m for m in (state.get("run_dir"), state.get("tmp_dir")) if m]


def _ours(proc, markers: list[str]) -> bool:
    import psutil

    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(m in line for m in markers)


def alive(state: dict[str, Any] | None, part: str):
    """The live process recorded as ``part`` (same PID and start time, a command line naming this server)."""
    import psutil

    rec = (state or {}).get("processes", {}).get(part)
    if not rec:
        return None
    try:
        proc = psutil.Process(int(rec["pid"]))
        if abs(proc.create_time() - float(rec["create_time"])) > 0.01:
            return None
    except (psutil.Error, KeyError, ValueError):
        return None
    return proc if _ours(proc, _markers(state)) else None


def members(state: dict[str, Any]) -> list:
    """Every live process of this server: the recorded ones and every member of their process groups whose
    command line names this server (the workers, an orphaned child)."""
    import psutil

    groups = {int(r["pgid"]) for r in state.get("processes", {}).values() if r.get("pgid")}
    markers = _markers(state)
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and os.getpgid(proc.pid) in groups and _ours(proc, markers):
                found.append(proc)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return found


def end_all(state: dict[str, Any], timeout: float = 30.0) -> int:
    """SIGTERM every process of the server (the front door first: no new requests while the rest stops), then
    SIGKILL what is left after ``timeout``; returns how many there were."""
    import psutil

    procs = members(state)
    front = alive(state, "front door")
    order = ([front] if front else []) + [p for p in procs if not front or p.pid != front.pid]
    for proc in order:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
        if front is not None and proc.pid == front.pid:
            psutil.wait_procs([proc], timeout=min(timeout, 10))
    _, left = psutil.wait_procs(order, timeout=timeout)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)
    return len(order)


def held_ports(state: dict[str, Any]) -> dict[str, int]:
    """The server's ports that something still listens on, by name."""
    host = state.get("config", {}).get("host", "127.0.0.1")
    return {name: port for name, port in state.get("ports", {}).items() if port and not port_free(host, port)}


def holder(port: int) -> str:
    """Who listens on ``port`` (for an error message): 'pid N (name)' or 'unknown'."""
    import psutil

    try:
        for conn in psutil.net_connections("inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except (psutil.Error, PermissionError):
        pass
    return "unknown"


def wait_ports_free(state: dict[str, Any], timeout: float = 15.0) -> dict[str, int]:
    """Wait (bounded) until every port of the server is free; returns those still held."""
    deadline = time.monotonic() + timeout
    while (held := held_ports(state)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


def remove_sockets(state: dict[str, Any]) -> None:
    for path in state.get("sockets", []):
        Path(path).unlink(missing_ok=True)
