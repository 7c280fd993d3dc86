"""What a server is made of: its settings, the run dir's layout and state file, and the models it serves.

Every other module of :mod:`zoo.tools.serve` reads these; this one imports none of them, so the settings and the
file names are written once.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoo.api.service import Limits
from zoo.backends import backend_names
from zoo.errors import ConfigError
from zoo.tools import REPO

SERVING_DIR = REPO / "serving"
HANDLER_FILE = SERVING_DIR / "handler.py"
DEFAULT_RUN_DIR = Path.home() / ".cache" / "alstm-zoo" / "serve"
STATE_FILE, KEY_FILE = "server.json", "key_file.json"
MAIN_CLASS = "org.pytorch.serve.ModelServer"
#: TorchScript is left out on purpose: loading it unpickles (zoo.export.torchscript) and torch.jit is deprecated.
SERVE_BACKENDS = tuple(backend_names(servable_only=True))
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: the parts of a server that are processes of their own (the workers are found through the frontend)
PARTS = ("front door", "TorchServe frontend")


class ServeError(ConfigError):
    """A user-facing problem (bad argument, port in use, server failed to start): one line, exit 2.

    A :class:`~zoo.errors.ConfigError` (a ``ZooError``), so ``zoo.cli.main`` reports it as a user error.
    """


@dataclass
class ArchiveOptions:
    """Settings baked into a .mar's model-config yaml (TorchServe's keys plus the handler's limits)."""

    workers: int = 1
    batch_size: int = 8
    #: ms the frontend waits for more requests when the worker has none in progress (under continuous batching
    #: later ones join at the next call anyway): 20 made a lone client's p50 40 ms, 2 made it 19 ms
    max_batch_delay: int = 2
    response_timeout: int = 120
    backend: str = "eager"
    threads: int = 1
    #: time per handler call that the generations in progress share (ms); scoring waits at most about this long
    gen_slice_ms: int = 20
    # the handler's limits default to the service core's (zoo.api.service.Limits), the one place they are set
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
    #: requests one client (its address) may have at the server at once, past the front door's checks (waiting in
    #: TorchServe's queue or running); over it a 429 with Retry-After, at once: the queue is first come, first
    #: served, so without a share one client flooding valid requests made everyone else wait behind all of them
    client_requests: int = 32
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


def save_state(run_dir: Path, state: dict[str, Any]) -> None:
    (run_dir / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")


def ts_dir(run_dir: Path, cfg: ServerConfig | dict[str, Any]) -> Path:
    """TorchServe's working folder, where it writes its key file: behind the front door its keys are the front
    door's business (a private folder), without it they are the clients' (the run dir)."""
    on = cfg.front_door if isinstance(cfg, ServerConfig) else cfg.get("front_door", True)
    return run_dir / "backend" if on else run_dir


# -- models -----------------------------------------------------------------------------------------------------
def resolve_checkpoint(source: str) -> Path:
    """A checkpoint directory for a catalogue name, ``default``, or a path (Hub-aware when zoo.hub exists)."""
    from zoo.zoo_model import resolve_local

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
