"""The processes of a server, each started in its own session: TorchServe's Java frontend (whose process group
holds the workers) and the front door (HAProxy), with the ports and the private socket folder they use.

Why the Java frontend is launched here rather than by ``torchserve --start``: see :mod:`zoo.tools.serve` (one
global pid file in /tmp, logs and keys written into the current directory, workers run with another python).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from zoo.tools.ports import free_port, port_free
from zoo.tools.serve import front_door, supervise
from zoo.tools.serve.archive import render
from zoo.tools.serve.config import (
    KEY_FILE,
    MAIN_CLASS,
    SERVING_DIR,
    ArchiveOptions,
    ServeError,
    ServerConfig,
    resolve_checkpoint,
    ts_dir,
)
from zoo.tools.serve.keys import wait_ts_keys, write_client_keys


# -- Java -----------------------------------------------------------------------------------------------------
def java_version() -> int | None:
    """The major version of the ``java`` TorchServe would run (``$JAVA_HOME`` first), or None without one."""
    java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") else shutil.which("java")
    if not java:
        return None
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def _java() -> str:
    if os.environ.get("JAVA_HOME"):
        return str(Path(os.environ["JAVA_HOME"]) / "bin" / "java")
    return shutil.which("java") or "java"


# -- ports and folders ---------------------------------------------------------------------------------------------
def ports_of(cfg: ServerConfig) -> dict[str, int]:
    """The server's TCP ports by name (what server.json records and ``stop`` waits to see free)."""
    return {"inference": cfg.inference_port, "management": cfg.management_port, "metrics": cfg.metrics_port,
            "grpc inference": cfg.grpc_inference_port, "grpc management": cfg.grpc_management_port}


def choose_ports(cfg: ServerConfig) -> None:
    """Fill in the free ports asked for (0) and refuse ports in use (naming who holds them)."""
    if not cfg.worker_port:
        cfg.worker_port = 20000 + cfg.inference_port % 20000
    for attr in ("grpc_inference_port", "grpc_management_port"):
        if not getattr(cfg, attr):
            setattr(cfg, attr, free_port(cfg.host, avoid={cfg.inference_port, cfg.management_port,
                                                          cfg.metrics_port, cfg.grpc_inference_port}))
    if cfg.front_door:
        if cfg.client_timeout < 1:
            raise ServeError("--client-timeout must be >= 1")
        front_door.haproxy()  # say so before building anything when it is missing
    ports = list(ports_of(cfg).values())
    if len(set(ports)) != len(ports):
        raise ServeError(f"the inference, management, metrics and gRPC ports must differ (got {ports})")
    for port in ports:
        if not port_free(cfg.host, port):
            raise ServeError(f"port {port} on {cfg.host} is in use by {supervise.holder(port)} (choose others with "
                             "--inference-port, --management-port, --metrics-port, --grpc-inference-port, "
                             "--grpc-management-port)")


def socket_dir(run_dir: Path, cfg: ServerConfig) -> Path:
    """A private (0700) folder for the worker sockets, TorchServe's inference socket and the front door's
    sockets and key maps: ``run_dir/tmp``, or a short one in /tmp when that path is too long for a unix socket
    (108 bytes) or holds a space (the proxy's sample expressions take it unquoted)."""
    tmp = run_dir / "tmp"
    if len(str(tmp / f".ts.sock.{cfg.worker_port + 99}")) > 100 or " " in str(tmp):
        tmp = Path(tempfile.mkdtemp(prefix="zoo-serve-"))
    tmp.mkdir(parents=True, exist_ok=True)
    tmp.chmod(0o700)
    return tmp


def _no_workflows(run_dir: Path) -> Path:
    """The workflow store: an empty regular file, not a folder, so TorchServe can copy no workflow archive in
    (its Workflow API ignores ``enable_model_api=false``, and a .war's handler is code)."""
    path = run_dir / "workflow-store-disabled"
    if path.is_dir():
        shutil.rmtree(path)
    path.write_bytes(b"")
    return path


# -- processes -----------------------------------------------------------------------------------------------------
def _torchserve_command(cfg: ServerConfig, run_dir: Path, tmp: Path, response_timeout: int) -> list[str]:
    """TorchServe's config.properties rendered into the run dir, and the Java command line that reads it."""
    store = run_dir / "model-store"
    metrics_cfg = shutil.copy(SERVING_DIR / "metrics.yaml", run_dir / "metrics.yaml")
    addresses = {kind: f"unix:{tmp / (kind + '.sock')}" if cfg.front_door else cfg.url(kind)
                 for kind in ("inference", "management", "metrics")}
    for kind in addresses:
        (tmp / f"{kind}.sock").unlink(missing_ok=True)
    conf = render(SERVING_DIR / "config.properties", run_dir / "config.properties", {
        **asdict(cfg), **{f"ts_{kind}_address": a for kind, a in addresses.items()}, "model_store": store,
        "metrics_config": metrics_cfg,
        "workflow_store": _no_workflows(run_dir), "use_native_io": cfg.front_door,
        "load_models": ",".join(f"{n}={n}.mar" for n in cfg.models), "response_timeout": response_timeout})
    import ts

    ts_home = Path(ts.__file__).resolve().parent.parent
    vmargs = f"-Xmx{cfg.java_heap_mb}m -XX:+UseSerialGC".split()
    cmd = [_java(), f"-Dmodel_server_home={ts_home}", f"-Djava.io.tmpdir={tmp}",
           f"-Dlog4j.configurationFile=file://{SERVING_DIR / 'log4j2.xml'}", *vmargs,
           "-cp", f".:{ts_home / 'ts' / 'frontend' / '*'}", MAIN_CLASS,
           "--python", sys.executable, "-f", str(conf), "-s", str(store), "-ncs",
           "-m", *[f"{n}={n}.mar" for n in cfg.models]]
    if cfg.disable_token_auth:
        cmd.append("--disable-token-auth")
    if cfg.enable_model_api:
        cmd.append("--enable-model-api")
    return cmd


def launch_torchserve(cfg: ServerConfig, run_dir: Path, tmp: Path, response_timeout: int) -> subprocess.Popen:
    """TorchServe's Java frontend, in its own session, working in :func:`~zoo.tools.serve.config.ts_dir`."""
    cwd = ts_dir(run_dir, cfg)
    cwd.mkdir(parents=True, exist_ok=True, mode=0o700)
    for folder in {cwd, run_dir}:
        (folder / KEY_FILE).unlink(missing_ok=True)
    cmd = _torchserve_command(cfg, run_dir, tmp, response_timeout)
    logs = run_dir / "logs"
    env = dict(os.environ, LOG_LOCATION=str(logs), METRICS_LOCATION=str(logs), TEMP=str(tmp))
    with open(logs / "server.out", "ab") as out:
        return subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def start_front_door(cfg: ServerConfig, run_dir: Path, tmp: Path, logs: Path, response_timeout: int, proc,
                     timeout: float, limits: ArchiveOptions | None = None) -> subprocess.Popen:
    """HAProxy on the public inference address, forwarding to TorchServe's inference socket (``limits``: the
    archives' request limits, where this start built them: the front door refuses bodies over them by size)."""
    ts_auth = not cfg.disable_token_auth
    if ts_auth:
        ts_keys = wait_ts_keys(run_dir, cfg, proc, timeout)
        front_door.write_backend_map(tmp, ts_keys["inference"]["key"])
        front_door.write_management_map(tmp, ts_keys["management"]["key"], ts_keys["API"]["key"])
        write_client_keys(run_dir, tmp, cfg, ts_keys)
    checkpoints = {name: resolve_checkpoint(source) for name, source in cfg.models.items()}
    conf = front_door.render(cfg, run_dir / "front", tmp, checkpoints, response_timeout,
                             f"unix@{tmp / 'inference.sock'}", ts_auth, limits)
    for name in ("http.sock", "admin.sock"):
        (tmp / name).unlink(missing_ok=True)
    with open(logs / "front.log", "ab") as out:
        return subprocess.Popen([front_door.haproxy(), "-db", "-f", str(conf)], cwd=conf.parent, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=front_door.proxy_env())
