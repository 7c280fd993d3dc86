"""The sub-commands ``zoo serve build|start|stop|status|refresh-keys``: arguments in, one of the other modules
of :mod:`zoo.tools.serve` called, a report out. :func:`add` registers them (see :mod:`zoo.tools.commands`).

Exit codes: 0 done; 2 a user error (``ServeError`` is a ``ConfigError``: one line, reported by ``zoo.cli.main``);
``status`` exits 1 when the server is not running or one of its parts is down (each named).
"""

from __future__ import annotations

import argparse
import json
import math
import socket
from pathlib import Path
from typing import Any

from zoo.device import check_gpus
from zoo.tools.serve.archive import build_archive
from zoo.tools.serve.config import (
    DEFAULT_RUN_DIR,
    KEY_FILE,
    SERVE_BACKENDS,
    ArchiveOptions,
    ServeError,
    ServerConfig,
    parse_model_spec,
    run_dir_of,
)
from zoo.tools.serve.health import server_status
from zoo.tools.serve.keys import refresh_keys
from zoo.tools.serve.lifecycle import start_server, stop_server


def _describe(info: dict[str, Any]) -> str:
    cfg = info["config"]
    lines = [f"TorchServe running (pid {info['pid']}) from {info['run_dir']}",
             f"  inference   {info['inference']}/predictions/<model>   (health: {info.get('health', 'Healthy')})",
             f"  management  {info['management']}   metrics {info['metrics']}/metrics"
             + (f"   (the management key: {info['run_dir']}/backend/{KEY_FILE}, yours alone)"
                if info["key_file"] and info.get("front_pid") else ""),
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
                       client_requests=args.client_requests,
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
    sp.add_argument("--client-requests", type=_positive(int), default=ServerConfig.client_requests,
                    help="front door: requests one client (one address) may have at the server at once; over it "
                         f"a 429 with Retry-After (default {ServerConfig.client_requests})")
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
