"""``zoo serve build|start|stop|status``: the zoo's models behind TorchServe 0.12.

Why it launches TorchServe's Java frontend itself instead of calling ``torchserve --start``: the
launcher keeps one global pid file in /tmp (so only one server per machine, and ``--stop`` stops
whichever that is), writes ``logs/`` and ``key_file.json`` into whatever the current directory is,
and runs the workers with whichever ``python`` it was started from. Here every piece of runtime
state (model store, logs, key file, pid, config) lives in one run dir (default
``~/.cache/alstm-zoo/serve``, or ``--run-dir`` / ``$ZOO_SERVE_DIR``), several servers can run side
by side on other ports, a server is stopped by its own PID, and the workers run with this
interpreter (``--python``), the environment where ``zoo`` is importable, so the handler computes
with the library's own code.

Defaults are the secure ones: 127.0.0.1 only, token authorisation on, no model registration over the management
API, bounded request sizes, and HAProxy in front of the inference port (the "front door",
``serving/haproxy.cfg``, ``zoo/tools/front_door.py``): TorchServe 0.12 has no read timeout, decodes form bodies
itself (a bad %-escape was its own 500) and runs any HTTP method on /predictions, so the front door receives
every whole request within a deadline first, checks the server's key (256 bits; TorchServe's own keys are 48),
passes only the zoo's routes with JSON or text bodies to TorchServe's own inference address (a unix socket in a
private folder), and answers everything else in JSON. Turning authorisation or the front door off is an explicit
flag.

Every process of a server (the proxy, the Java frontend and, through its process group, the workers) and every
port is recorded in the run dir's server.json: ``status`` names the part that is down, ``stop`` ends them all
by PID and process group (never by name) and waits until every port is free.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import string
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zoo.backends import backend_names
from zoo.device import check_gpus
from zoo.errors import ConfigError
from zoo.service import Limits
from zoo.tools import REPO, front_door, supervise
from zoo.tools.ports import free_port, port_free

SERVING_DIR = REPO / "serving"
HANDLER_FILE = SERVING_DIR / "handler.py"
DEFAULT_RUN_DIR = Path.home() / ".cache" / "alstm-zoo" / "serve"
STATE_FILE, KEY_FILE = "server.json", "key_file.json"
MAIN_CLASS = "org.pytorch.serve.ModelServer"
#: TorchScript is left out on purpose: loading it unpickles (zoo.export.torchscript) and torch.jit is deprecated.
SERVE_BACKENDS = tuple(backend_names(servable_only=True))
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ServeError(ConfigError):
    """A user-facing problem (bad argument, port in use, server failed to start): one line, exit 2.

    A ValueError so that ``zoo.cli.main`` reports it as a user error however the CLI was started
    (``python -m zoo.cli`` runs cli.py as ``__main__``, where its ``UsageError`` is another class).
    """


@dataclass
class ArchiveOptions:
    """Settings baked into a .mar's model-config yaml (TorchServe's keys plus the handler's limits)."""

    workers: int = 1
    batch_size: int = 8
    max_batch_delay: int = 20
    response_timeout: int = 120
    backend: str = "eager"
    threads: int = 1
    #: time per handler call that the generations in progress share (ms); scoring waits at most about this long
    gen_slice_ms: int = 20
    # the handler's limits default to the service core's (zoo.service.Limits), the one place they are set
    max_texts: int = Limits.max_texts
    max_chars: int = Limits.max_chars
    max_total_chars: int = Limits.max_total_chars
    max_total_tokens: int = Limits.max_total_tokens
    max_new_tokens: int = Limits.max_new_tokens

    def validate(self) -> None:
        for key in ("workers", "batch_size", "response_timeout", "max_texts", "max_chars", "max_total_chars",
                    "max_total_tokens", "max_new_tokens"):  # (the worker's Limits refuse a 0 cap at load)
            if getattr(self, key) < 1:
                raise ServeError(f"--{key.replace('_', '-')} must be >= 1")
        for key in ("max_batch_delay", "threads", "gen_slice_ms"):
            if getattr(self, key) < 0:
                raise ServeError(f"--{key.replace('_', '-')} must be >= 0")
        if self.backend not in SERVE_BACKENDS:
            raise ServeError(f"--backend must be one of {', '.join(SERVE_BACKENDS)}")


@dataclass
class ServerConfig:
    """Where a server listens and what it allows; saved in the run dir's server.json."""

    host: str = "127.0.0.1"
    inference_port: int = 8080
    management_port: int = 8081
    metrics_port: int = 8082
    worker_port: int = 0
    #: TorchServe always opens gRPC inference and management servers (its defaults, 7070/7071, made a second
    #: server fail to start); 0 = a free port chosen at start, bound to ``host`` like the HTTP addresses.
    grpc_inference_port: int = 0
    grpc_management_port: int = 0
    disable_token_auth: bool = False
    enable_model_api: bool = False
    #: HAProxy in front of the inference port (serving/haproxy.cfg); TorchServe's own inference address is then
    #: a unix socket in the server's private socket folder
    front_door: bool = True
    #: seconds a client has to send a whole request head, and then as long again for the whole body (the
    #: front door's deadline); a third of what it may take between two reads of the reply
    client_timeout: int = 10
    #: connections the front door holds at once (each may buffer a whole body: at most about this many times
    #: max_request_bytes of memory)
    max_connections: int = 4096
    max_request_bytes: int = 1 << 20
    max_response_bytes: int = 16 << 20
    job_queue_size: int = 256
    token_expiration_min: int = 60
    java_heap_mb: int = 1024
    #: GPUs TorchServe hands out to workers (its ``number_of_gpu``; each worker's handler runs on its ``gpu_id``)
    gpus: int = 0
    models: dict[str, str] = field(default_factory=dict)

    def url(self, kind: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{getattr(self, kind + '_port')}"


# -- run dir and state -----------------------------------------------------------------------------------
def run_dir_of(value: str | os.PathLike | None) -> Path:
    return Path(value or os.environ.get("ZOO_SERVE_DIR") or DEFAULT_RUN_DIR).expanduser().resolve()


def read_state(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def server_process(state: dict[str, Any] | None):
    """The live TorchServe frontend recorded in ``state``, or None (a recycled PID is not ours)."""
    return supervise.alive(state, "TorchServe frontend")


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


def refresh_keys(run_dir: Path) -> dict[str, str]:
    """New keys from the running server: TorchServe's inference and management keys (its token API, authorised
    by its non-expiring API key; it rewrites its key file) and, behind the front door, a new client key, put into
    the running proxy without a restart. The old keys stop working. Returns the new expiry times."""
    state = read_state(run_dir)
    if server_process(state) is None or state is None:
        raise ServeError(f"no server running from {run_dir}")
    cfg = ServerConfig(**state["config"])
    ts_file = _ts_dir(run_dir, cfg) / KEY_FILE
    try:
        api = json.loads(ts_file.read_text(encoding="utf-8"))["API"]["key"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        raise ServeError(f"no API key in {ts_file} (token authorisation off?)") from None
    for kind in ("inference", "management"):
        code, body = _http(f"{cfg.url('management')}/token?type={kind}", api)
        if code != 200:
            raise ServeError(f"refreshing the {kind} key failed: HTTP {code} {body[:200]!r}")
    if cfg.front_door:
        ts_keys = json.loads(ts_file.read_text(encoding="utf-8"))
        tmp = Path(state["tmp_dir"])
        _write_client_keys(run_dir, tmp, cfg, ts_keys)
        key = read_keys(run_dir)["inference"]
        expires = time.time() + 60 * cfg.token_expiration_min
        front_door.replace_keys(tmp, key, expires, ts_keys["inference"]["key"])
    return key_expiry(run_dir)


# -- archives ---------------------------------------------------------------------------------------------------
def resolve_checkpoint(source: str) -> Path:
    """A checkpoint directory for a catalogue name, ``default``, or a path (Hub-aware when zoo.hub exists)."""
    from zoo.pretrained import resolve_local

    try:
        from zoo.hub import resolve
    except ImportError:
        resolve = None
    directory, _ = resolve(source) if resolve else resolve_local(source)
    return Path(directory)


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``NAME=SOURCE`` or ``SOURCE`` -> (served name, source); a directory is named after its config."""
    if "=" in spec and not Path(spec).exists():
        name, source = spec.split("=", 1)
    else:
        source = spec
        path = Path(spec)
        if path.is_dir():
            try:
                name = json.loads((path / "config.json").read_text(encoding="utf-8")).get("name") or path.name
            except (OSError, json.JSONDecodeError):
                name = path.name
        else:
            name = spec
    if not NAME_RE.match(name):
        raise ServeError(f"invalid model name {name!r}: use letters, digits, '_', '-', '.' (give NAME=SOURCE)")
    return name, source


def _render(template: Path, out: Path, values: dict[str, Any]) -> Path:
    text = string.Template(template.read_text(encoding="utf-8")).substitute(
        {k: str(v).lower() if isinstance(v, bool) else v for k, v in values.items()})
    out.write_text(text, encoding="utf-8")
    return out


def _archiver() -> list[str]:
    exe = Path(sys.executable).parent / "torch-model-archiver"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("torch-model-archiver")
    if not found:
        raise ServeError("torch-model-archiver not found: pip install 'alstm-zoo[serve]'")
    return [found]


def build_archive(source: str, model_store: Path, name: str | None = None,
                  options: ArchiveOptions | None = None) -> Path:
    """Package a checkpoint (plus the handler and its model-config yaml) as ``<model_store>/<name>.mar``."""
    options = options or ArchiveOptions()
    options.validate()
    if not HANDLER_FILE.is_file():
        raise ServeError(f"{HANDLER_FILE} not found: zoo serve needs the source checkout's serving/ folder")
    name = name or parse_model_spec(source)[0]
    if not NAME_RE.match(name):
        raise ServeError(f"invalid model name {name!r}")
    ckpt = resolve_checkpoint(source)
    from zoo.checkpoint import CONFIG_FILE, VOCAB_FILE, WEIGHTS_FILE, read_config

    read_config(ckpt)  # fail here, with the checkpoint's own message, rather than in a worker
    weights = ckpt / WEIGHTS_FILE
    if not weights.is_file():
        raise ServeError(f"{weights}: missing")
    extra = [ckpt / CONFIG_FILE, ckpt / VOCAB_FILE] + [p for p in (ckpt / "README.md",) if p.is_file()]
    if options.backend != "eager":  # ship the verified ONNX export (found, or made now) inside the archive
        from zoo.backends import ensure_export
        from zoo.pretrained import ZooModel

        export_dir = ensure_export(ZooModel.from_pretrained(ckpt, name=name), options.backend)
    else:
        export_dir = None
    model_store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zoo-mar-") as tmp:
        yaml_file = _render(SERVING_DIR / "model-config.yaml", Path(tmp) / "model-config.yaml", asdict(options))
        if export_dir is not None:  # the archiver flattens a folder's contents: stage <folder>/onnx/ to keep onnx/
            shutil.copytree(export_dir, Path(tmp) / "export" / export_dir.name)
            extra.append(Path(tmp) / "export")
        cmd = _archiver() + [
            "--model-name", name, "--version", "1.0", "--handler", str(HANDLER_FILE),
            "--serialized-file", str(weights), "--extra-files", ",".join(str(p) for p in extra),
            "--config-file", str(yaml_file), "--export-path", str(model_store), "--force"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise ServeError(f"torch-model-archiver failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return model_store / f"{name}.mar"


# -- server lifecycle -----------------------------------------------------------------------------------------
def java_version() -> int | None:
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




def _no_workflows(run_dir: Path) -> Path:
    """The workflow store: an empty regular file, not a folder, so TorchServe can copy no workflow archive in
    (its Workflow API ignores ``enable_model_api=false``, and a .war's handler is code)."""
    path = run_dir / "workflow-store-disabled"
    if path.is_dir():
        shutil.rmtree(path)
    path.write_bytes(b"")
    return path


def _http(url: str, key: str | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET without proxies (loopback): (status, body); status 0 when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


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
    code, body = _http(f"{cfg.url('management')}/models/{name}", read_keys(run_dir).get("management"))
    if code != 200:
        return []
    try:
        return json.loads(body)[0].get("workers", [])
    except (json.JSONDecodeError, IndexError, KeyError, AttributeError):
        return []


def wait_ready(cfg: ServerConfig, run_dir: Path, proc, timeout: float, front=None) -> None:
    """Wait (bounded) until /ping is healthy (through the front door) and every model has a READY worker."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
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
        keys = read_keys(run_dir)
        if cfg.disable_token_auth or keys:
            code, body = _http(f"{cfg.url('inference')}/ping", keys.get("inference"))
            if code == 200 and b"Healthy" in body and all(
                    any(w.get("status") == "READY" for w in model_workers(cfg, run_dir, n)) for n in cfg.models):
                return
        time.sleep(0.5)
    raise ServeError(f"TorchServe was not healthy after {timeout:.0f} s; see {run_dir / 'logs'}")


def start_server(models: list[tuple[str, str]], run_dir: Path, cfg: ServerConfig,
                 options: ArchiveOptions | None = None, build: bool = True, timeout: float = 180.0) -> dict[str, Any]:
    """Build the archives, launch the frontend (then the front door) in ``run_dir``, wait until healthy; returns
    the saved state."""
    state = read_state(run_dir)
    if state and any(supervise.alive(state, part) for part in PARTS):
        raise ServeError(f"a server is already running from {run_dir} (zoo serve stop --run-dir {run_dir})")
    if state:  # a server whose parts died: end what is left of it (a worker orphaned by its frontend) first
        stop_server(run_dir)
    version = java_version()
    if version is None or version < 17:
        raise ServeError("TorchServe needs Java 17 or newer (found: "
                         f"{'none' if version is None else version}); run `make system-deps` or "
                         "`apt-get install openjdk-17-jdk-headless`")
    names = [n for n, _ in models]
    if len(set(names)) != len(names):
        raise ServeError(f"duplicate model names in {names}")
    _choose_ports(cfg)
    store, logs, tmp = run_dir / "model-store", run_dir / "logs", _socket_dir(run_dir, cfg)
    if logs.is_dir():  # keep the previous run's logs for one more run, but never read them as this run's
        shutil.rmtree(run_dir / "logs.prev", ignore_errors=True)
        logs.rename(run_dir / "logs.prev")
    shutil.rmtree(tmp / "models", ignore_errors=True)  # archives unpacked by an earlier run
    for d in (store, logs):
        d.mkdir(parents=True, exist_ok=True)
    for name, source in models:
        mar = store / f"{name}.mar"
        if build:
            build_archive(source, store, name, options)
        elif not mar.is_file():
            raise ServeError(f"{mar} not found (run zoo serve build, or start without --no-build)")
    cfg.models = dict(models)
    response_timeout = (options or ArchiveOptions()).response_timeout
    proc = _launch_torchserve(cfg, run_dir, tmp, response_timeout)
    state = {"pid": proc.pid, "run_dir": str(run_dir), "started": time.time(), "config": asdict(cfg),
             "processes": {"TorchServe frontend": supervise.record(proc.pid)}, "ports": _ports_of(cfg),
             "sockets": [str(tmp / "inference.sock"), str(tmp / "http.sock"), str(tmp / "admin.sock")],
             "logs": str(logs), "key_file": None if cfg.disable_token_auth else str(run_dir / KEY_FILE),
             "inference": cfg.url("inference"), "management": cfg.url("management"), "metrics": cfg.url("metrics"),
             "python": sys.executable, "tmp_dir": str(tmp)}
    _save_state(run_dir, state)
    try:
        front = None
        if cfg.front_door:
            front = _start_front_door(cfg, run_dir, tmp, logs, response_timeout, proc, timeout)
            state["front_pid"] = front.pid
            state["processes"]["front door"] = supervise.record(front.pid)
            _save_state(run_dir, state)
        wait_ready(cfg, run_dir, proc, timeout, front)
    except BaseException:
        stop_server(run_dir)
        raise
    return state


#: the parts of a server that are processes of their own (the workers are found through the frontend)
PARTS = ("front door", "TorchServe frontend")


def _save_state(run_dir: Path, state: dict[str, Any]) -> None:
    (run_dir / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")


def _ports_of(cfg: ServerConfig) -> dict[str, int]:
    return {"inference": cfg.inference_port, "management": cfg.management_port, "metrics": cfg.metrics_port,
            "grpc inference": cfg.grpc_inference_port, "grpc management": cfg.grpc_management_port}


def _choose_ports(cfg: ServerConfig) -> None:
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
    ports = list(_ports_of(cfg).values())
    if len(set(ports)) != len(ports):
        raise ServeError(f"the inference, management, metrics and gRPC ports must differ (got {ports})")
    for port in ports:
        if not port_free(cfg.host, port):
            raise ServeError(f"port {port} on {cfg.host} is in use by {supervise.holder(port)} (choose others with "
                             "--inference-port, --management-port, --metrics-port, --grpc-inference-port, "
                             "--grpc-management-port)")


def _socket_dir(run_dir: Path, cfg: ServerConfig) -> Path:
    """A private (0700) folder for the worker sockets, TorchServe's inference socket and the front door's
    sockets and key maps: ``run_dir/tmp``, or a short one in /tmp when that path is too long for a unix socket
    (108 bytes) or holds a space (the proxy's sample expressions take it unquoted)."""
    tmp = run_dir / "tmp"
    if len(str(tmp / f".ts.sock.{cfg.worker_port + 99}")) > 100 or " " in str(tmp):
        tmp = Path(tempfile.mkdtemp(prefix="zoo-serve-"))
    tmp.mkdir(parents=True, exist_ok=True)
    tmp.chmod(0o700)
    return tmp


def _ts_dir(run_dir: Path, cfg: ServerConfig | dict[str, Any]) -> Path:
    """TorchServe's working folder, where it writes its key file: behind the front door its keys are the front
    door's business (a private folder), without it they are the clients' (the run dir)."""
    on = cfg.front_door if isinstance(cfg, ServerConfig) else cfg.get("front_door", True)
    return run_dir / "backend" if on else run_dir


def _launch_torchserve(cfg: ServerConfig, run_dir: Path, tmp: Path, response_timeout: int):
    cwd = _ts_dir(run_dir, cfg)
    cwd.mkdir(parents=True, exist_ok=True, mode=0o700)
    for folder in {cwd, run_dir}:
        (folder / KEY_FILE).unlink(missing_ok=True)
    store, logs = run_dir / "model-store", run_dir / "logs"
    metrics_cfg = shutil.copy(SERVING_DIR / "metrics.yaml", run_dir / "metrics.yaml")
    ts_inference = f"unix:{tmp / 'inference.sock'}" if cfg.front_door else cfg.url("inference")
    (tmp / "inference.sock").unlink(missing_ok=True)
    conf = _render(SERVING_DIR / "config.properties", run_dir / "config.properties", {
        **asdict(cfg), "ts_inference_address": ts_inference, "model_store": store, "metrics_config": metrics_cfg,
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
    env = dict(os.environ, LOG_LOCATION=str(logs), METRICS_LOCATION=str(logs), TEMP=str(tmp))
    with open(logs / "server.out", "ab") as out:
        return subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def _ts_keys(run_dir: Path, cfg: ServerConfig, proc, timeout: float) -> dict[str, Any]:
    """TorchServe's own key file (behind the front door), once it has written it."""
    path = _ts_dir(run_dir, cfg) / KEY_FILE
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


def _write_client_keys(run_dir: Path, tmp: Path, cfg: ServerConfig, ts_keys: dict[str, Any]) -> None:
    """The clients' key file: the front door's own inference key (256 bits, expiring like TorchServe's keys)
    and TorchServe's management key (the management port is TorchServe's)."""
    key, expires = front_door.new_key(), time.time() + 60 * cfg.token_expiration_min
    front_door.write_key_map(tmp, key, expires)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))
    data = {"inference": {"key": key, "expiration time": when}}
    if "management" in ts_keys:
        data["management"] = ts_keys["management"]
    fd = os.open(run_dir / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def _start_front_door(cfg: ServerConfig, run_dir: Path, tmp: Path, logs: Path, response_timeout: int, proc,
                      timeout: float):
    """HAProxy on the public inference address, forwarding to TorchServe's inference socket."""
    ts_auth = not cfg.disable_token_auth
    if ts_auth:
        ts_keys = _ts_keys(run_dir, cfg, proc, timeout)
        front_door.write_backend_map(tmp, ts_keys["inference"]["key"])
        _write_client_keys(run_dir, tmp, cfg, ts_keys)
    checkpoints = {name: resolve_checkpoint(source) for name, source in cfg.models.items()}
    conf = front_door.render(cfg, run_dir / "front", tmp, checkpoints, response_timeout,
                             f"unix@{tmp / 'inference.sock'}", ts_auth)
    for name in ("http.sock", "admin.sock"):
        (tmp / name).unlink(missing_ok=True)
    with open(logs / "front.log", "ab") as out:
        return subprocess.Popen([front_door.haproxy(), "-db", "-f", str(conf)], cwd=conf.parent, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _java() -> str:
    if os.environ.get("JAVA_HOME"):
        return str(Path(os.environ["JAVA_HOME"]) / "bin" / "java")
    return shutil.which("java") or "java"


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
    (_ts_dir(run_dir, state.get("config", {})) / KEY_FILE).unlink(missing_ok=True)
    return ended > 0


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
    state = read_state(run_dir)
    base = {"running": False, "run_dir": str(run_dir), "logs": str(run_dir / "logs")}
    if state is None or not any(supervise.alive(state, part) for part in PARTS):
        held = supervise.held_ports(state) if state else {}
        return {**base, "down": [f"port {p} ({n}) still held by {supervise.holder(p)}" for n, p in held.items()]}
    cfg = ServerConfig(**state["config"])
    code, body = _http(f"{cfg.url('inference')}/ping", read_keys(run_dir).get("inference"))
    health = json.loads(body).get("status") if code == 200 else f"HTTP {code}" if code else "no answer"
    if code in (400, 401, 403) and read_keys(run_dir):  # the front door answers a bad or expired key with 401
        expiry = key_expiry(run_dir).get("inference", "?")
        health = (f"HTTP {code}: the inference key in {run_dir / KEY_FILE} was refused (expiry {expiry}); run "
                  f"`zoo serve refresh-keys --run-dir {run_dir}` for new keys")
    down, models = _down_parts(state, cfg, run_dir)
    return {**state, "running": True, "health": health, "models": models, "down": down}


# -- command line -----------------------------------------------------------------------------------------------
def _describe(info: dict[str, Any]) -> str:
    cfg = info["config"]
    lines = [f"TorchServe running (pid {info['pid']}) from {info['run_dir']}",
             f"  inference   {info['inference']}/predictions/<model>   (health: {info.get('health', 'Healthy')})",
             f"  management  {info['management']}   metrics {info['metrics']}/metrics",
             "  front door  " + (f"HAProxy (pid {info['front_pid']}) -> TorchServe on "
                                  f"{info['tmp_dir']}/inference.sock; "
                                  f"request deadline {cfg['client_timeout']} s (head) + {cfg['client_timeout']} s "
                                  "(body)" if info.get("front_pid")
                                  else "OFF (--no-front-door): TorchServe answers the inference port itself"),
             f"  models      {', '.join(cfg['models'])}",
             f"  logs        {info['logs']}"]
    if info["key_file"]:
        lines += [f"  auth key    {info['key_file']} (token authorisation ON; keys expire after "
                  f"{cfg['token_expiration_min']} min)",
                  "  send it as  Authorization: Bearer <the file's inference key>, e.g.",
                  f"    KEY=$({info['python']} -c 'import json,sys; print(json.load(open(sys.argv[1]))"
                  f"[\"inference\"][\"key\"])' {info['key_file']})",
                  f"    curl -H \"Authorization: Bearer $KEY\" -H 'Content-Type: application/json' "
                  f"-d '{{\"task\": \"score\", \"texts\": [\"the cat sat on the mat\"]}}' "
                  f"{info['inference']}/predictions/{next(iter(cfg['models']), 'default')}"]
    else:
        lines.append("  auth        OFF (--disable-token-auth): anyone who can reach the port can use it")
    if cfg["host"] not in ("127.0.0.1", "localhost", "::1"):
        lines.append(f"  WARNING     listening on {cfg['host']}, not loopback")
    return "\n".join(lines)


def _options(args: argparse.Namespace) -> ArchiveOptions:
    return ArchiveOptions(**{k: getattr(args, k) for k in ArchiveOptions.__dataclass_fields__})


def cmd_build(args: argparse.Namespace) -> int:
    store = Path(args.model_store) if args.model_store else run_dir_of(args.run_dir) / "model-store"
    for spec in args.model:
        name, source = parse_model_spec(spec)
        print(build_archive(source, store, name, _options(args)))
    return 0


def _port(text: str) -> int:
    """An argparse type: a TCP port, 1..65535 (a bigger number raised OverflowError from inside ``bind``)."""
    value = _number(int, text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"a port is in 1..65535, got {value}")
    return value


def _port_or_free(text: str) -> int:
    """A port, or 0 for one the OS reports free at start."""
    return 0 if _number(int, text) == 0 else _port(text)


def _number(kind: type, text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None


def _positive(kind: type) -> Any:
    """An argparse type: a positive (finite) ``kind``."""
    def parse(text: str) -> int | float:
        value = _number(kind, text)
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def cmd_start(args: argparse.Namespace) -> int:
    try:  # before anything is built or moved: an unknown host name was a socket.gaierror traceback
        socket.getaddrinfo(args.host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ServeError(f"--host {args.host!r} is not an address of this machine ({e})") from None
    _options(args).validate()  # (start_server moves logs/ aside before the archives, which validate, are built)
    if check_gpus(args.gpus) and args.backend != "eager":
        raise ServeError(f"--gpus {args.gpus} needs --backend eager (the {args.backend} backend runs on the CPU)")
    run_dir = run_dir_of(args.run_dir)
    models = [parse_model_spec(s) for s in args.model] if args.model else [("default", "default")]
    cfg = ServerConfig(host=args.host, inference_port=args.inference_port, management_port=args.management_port,
                       metrics_port=args.metrics_port, worker_port=args.worker_port or 0,
                       grpc_inference_port=args.grpc_inference_port, grpc_management_port=args.grpc_management_port,
                       disable_token_auth=args.disable_token_auth, enable_model_api=args.enable_model_api,
                       max_request_bytes=args.max_request_bytes, token_expiration_min=args.token_expiration_min,
                       front_door=args.front_door, client_timeout=args.client_timeout,
                       gpus=args.gpus)
    print(f"starting TorchServe with {', '.join(f'{n} ({s})' for n, s in models)}; waiting for /ping "
          f"(up to {args.timeout:.0f} s) ...", flush=True)
    start_server(models, run_dir, cfg, _options(args), build=not args.no_build, timeout=args.timeout)
    print(_describe(server_status(run_dir)))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    run_dir = run_dir_of(args.run_dir)
    print("TorchServe stopped" if stop_server(run_dir) else f"no server running from {run_dir}")
    return 0


def cmd_refresh_keys(args: argparse.Namespace) -> int:
    run_dir = run_dir_of(args.run_dir)
    expiry = refresh_keys(run_dir)
    print(f"new keys in {run_dir / KEY_FILE}: " + ", ".join(f"{k} until {v}" for k, v in expiry.items()))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Exit 0 only when every part of the server is up: 1 when it is not running or a part is down (named)."""
    info = server_status(run_dir_of(args.run_dir))
    if args.json:
        print(json.dumps(info, indent=2))
    elif info["running"]:
        print(_describe(info))
        for name, workers in info["models"].items():
            print(f"  {name}: " + ", ".join(f"worker pid {w['pid']} {w['status']}" for w in workers))
    else:
        print(f"not running (run dir {info['run_dir']})")
    if not args.json:
        for part in info.get("down", []):
            print(f"  DOWN  {part}")
    return 0 if info["running"] and not info.get("down") else 1


def _archive_args(p: argparse.ArgumentParser) -> None:
    d = ArchiveOptions()
    g = p.add_argument_group("archive (model-config yaml)")
    g.add_argument("--workers", type=int, default=d.workers, help="worker processes per model")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="requests batched per call (1 = off)")
    g.add_argument("--max-batch-delay", type=int, default=d.max_batch_delay, help="ms to wait to fill a batch")
    g.add_argument("--response-timeout", type=int, default=d.response_timeout, help="seconds per batch")
    g.add_argument("--backend", default=d.backend, choices=SERVE_BACKENDS,
                   help="eager PyTorch, or the model's ONNX export run by ONNX Runtime (packed into the .mar)")
    g.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker (0 = torch default)")
    g.add_argument("--max-texts", type=int, default=d.max_texts, help="texts per score request")
    g.add_argument("--max-chars", type=int, default=d.max_chars, help="characters per text or prompt")
    g.add_argument("--max-total-chars", type=int, default=d.max_total_chars, help="characters per request")
    g.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens,
                   help="tokens per score request, counted once tokenised (a character model spells a character "
                        "outside its alphabet as five symbols)")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="server cap on max_new_tokens")
    g.add_argument("--gen-slice-ms", type=int, default=d.gen_slice_ms,
                   help="generation time per worker call, shared by the generations in progress; new requests "
                        "(scoring) wait at most about this long behind generation")


def add(subparsers) -> None:
    """Register ``zoo serve`` (see zoo/tools/commands.py)."""
    serve = subparsers.add_parser("serve", help="serve models over HTTP with TorchServe (build/start/stop/status)")
    sub = serve.add_subparsers(dest="serve_command", required=True)
    run_dir_help = f"state, logs, key file and model store (default: $ZOO_SERVE_DIR or {DEFAULT_RUN_DIR})"

    sp = sub.add_parser("build", help="package models as .mar archives")
    sp.add_argument("model", nargs="+", help="catalogue name, `default`, checkpoint dir, or NAME=SOURCE")
    sp.add_argument("--model-store", help="output folder (default: <run dir>/model-store)")
    sp.add_argument("--run-dir", help=run_dir_help)
    _archive_args(sp)
    sp.set_defaults(func=cmd_build)

    sp = sub.add_parser("start", help="start TorchServe (default: the default model, served as `default`)")
    sp.add_argument("model", nargs="*", help="catalogue name, checkpoint dir, or NAME=SOURCE (default: default)")
    sp.add_argument("--run-dir", help=run_dir_help)
    sp.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    sp.add_argument("--inference-port", type=_port, default=8080, help="(default 8080)")
    sp.add_argument("--no-front-door", dest="front_door", action="store_false",
                    help="serve the inference port with TorchServe itself, without HAProxy in front (no read "
                         "timeouts, form bodies decoded by TorchServe, any method on /predictions)")
    sp.add_argument("--client-timeout", type=_positive(int), default=ServerConfig.client_timeout,
                    help="front door: seconds a client has to send a whole request head, and as long again for "
                         "the body (default "
                         f"{ServerConfig.client_timeout})")
    sp.add_argument("--management-port", type=_port, default=8081, help="(default 8081)")
    sp.add_argument("--metrics-port", type=_port, default=8082, help="(default 8082)")
    sp.add_argument("--worker-port", type=_port, help="base of the worker socket numbers (default: from the "
                    "inference port)")
    sp.add_argument("--grpc-inference-port", type=_port_or_free, default=0,
                    help="TorchServe's gRPC inference port, bound to --host (default: a free port)")
    sp.add_argument("--grpc-management-port", type=_port_or_free, default=0,
                    help="TorchServe's gRPC management port, bound to --host (default: a free port)")
    sp.add_argument("--disable-token-auth", action="store_true",
                    help="turn token authorisation OFF (local demos only)")
    sp.add_argument("--enable-model-api", action="store_true",
                    help="allow registering/unregistering models over the management API (off by default)")
    sp.add_argument("--max-request-bytes", type=_positive(int), default=ServerConfig.max_request_bytes,
                    help=f"largest request body TorchServe accepts (default {ServerConfig.max_request_bytes:,})")
    sp.add_argument("--token-expiration-min", type=_positive(int), default=ServerConfig.token_expiration_min,
                    help=f"minutes an inference/management key lives (default {ServerConfig.token_expiration_min})")
    sp.add_argument("--timeout", type=_positive(float), default=180.0,
                    help="seconds to wait for /ping (default 180)")
    sp.add_argument("--no-build", action="store_true", help="serve the .mar files already in the model store")
    sp.add_argument("--gpus", type=int, default=0, help="GPUs TorchServe assigns to the workers, one each in turn "
                    "(default 0: the CPU; eager backend)")
    _archive_args(sp)
    sp.set_defaults(func=cmd_start)

    sp = sub.add_parser("stop", help="stop the server of a run dir (by its PID)")
    sp.add_argument("--run-dir", help=run_dir_help)
    sp.set_defaults(func=cmd_stop)

    sp = sub.add_parser("refresh-keys", help="new inference and management keys for a running server (they "
                        "expire after --token-expiration-min)")
    sp.add_argument("--run-dir", help=run_dir_help)
    sp.set_defaults(func=cmd_refresh_keys)

    sp = sub.add_parser("status", help="is it running, where are its logs and key file (exit 1 if not running)")
    sp.add_argument("--run-dir", help=run_dir_help)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_status)
