"""The demo's launch: the page over a model registry (:func:`build_demo`), the server with its route guard and the
statistics collector (:func:`launch`), and ``python app.py``'s options and run (:func:`parse_args`, :func:`main`).
``app.py`` at the repository root is the entry point: it sets the process's environment before Gradio is imported
and calls :func:`main`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from zoo.device import resolve_device
from zoo.tools.demo import ui as demo_ui
from zoo.tools.demo.guard import GuardRoutes
from zoo.tools.demo.registry import ModelRegistry
from zoo.tools.demo.render import curves_dir
from zoo.tools.demo.ui import CSS, ZooDemo
from zoo.tools.ports import port_free


def build_demo(model_dirs: Sequence[str | os.PathLike] = (), device: str = "cpu") -> ZooDemo:
    """The demo over the bundled models plus ``model_dirs``, run on ``device``: the registry is made here and
    passed to the page (:func:`zoo.tools.demo.ui.build_demo`); a bad directory is a ``ValueError``."""
    return demo_ui.build_demo(ModelRegistry(model_dirs, device))


def launch(demo: ZooDemo, host: str = "127.0.0.1", port: int = 7860, block: bool = True):
    """Start the server (loopback by default) and the collection of dynamic evaluation's statistics; returns
    ``(app, local_url, share_url)`` when not blocking.

    Only curve images may be served as files: each model's curve file and the folder of rendered curves,
    never a model folder (weights) or anything else.
    """
    registry = demo.registry
    demo.stats.start()
    allowed = [str(curves_dir())]
    allowed += [c for c in (registry.curve(n) for n in registry.names()) if c and not c.startswith(allowed[0])]
    from starlette.middleware import Middleware

    known = {fn.api_name for fn in demo.fns.values() if fn.api_name and getattr(fn, "api_visibility", "public")
             == "public"}
    return demo.launch(server_name=host, server_port=port, prevent_thread_lock=not block, quiet=True,
                       css=CSS, show_error=True, footer_links=["api", "gradio"], max_threads=8,
                       allowed_paths=allowed,
                       app_kwargs={"middleware": [Middleware(GuardRoutes, demo=demo, known=known)]})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env_port = os.environ.get("GRADIO_SERVER_PORT", "").strip()
    p = argparse.ArgumentParser(description="alstm-zoo Gradio demo (offline, on the bundled models)")
    if env_port and not env_port.isdigit():
        p.error(f"GRADIO_SERVER_PORT must be a port number, got {env_port!r}")
    p.add_argument("--port", type=int, default=int(env_port) if env_port else 7860,
                   help="port (default: $GRADIO_SERVER_PORT or 7860)")
    p.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                   help="address to bind (default 127.0.0.1)")
    p.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                   help="extra checkpoint directory, or a folder of them (repeatable; also $ZOO_DEMO_MODELS)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto (cuda when there is one)")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    return args


def model_dirs_from(args: argparse.Namespace) -> list[str]:
    env = [d for d in os.environ.get("ZOO_DEMO_MODELS", "").split(os.pathsep) if d.strip()]
    return env + list(args.model_dir)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # two events may run at once on a two-core machine: one core each
    print("app.py: loading the models ...", flush=True)
    try:
        device = str(resolve_device(args.device, "--device"))  # a device this machine lacks: one line, exit 2
        demo = build_demo(model_dirs_from(args), device)
    except ValueError as e:
        print(f"app.py: error: {e}", file=sys.stderr)
        return 2
    if not port_free(args.host, args.port):  # Gradio's own message would advise a variable we already read
        print(f"app.py: error: port {args.port} on {args.host} is in use; pick another with --port N or "
              "GRADIO_SERVER_PORT=N (make demo PORT=N)", file=sys.stderr)
        return 2
    # Gradio stays quiet (its share=True hint does not apply to a loopback demo): this line says where it is
    print(f"app.py: serving the demo on http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    launch(demo, args.host, args.port, block=True)
    return 0


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """A supervisor's SIGTERM ends the demo as Ctrl-C does, through the exit handlers: the statistics' child
    process (:mod:`zoo.tools.demo.stats`) is stopped with it. Python's default SIGTERM skips them, and the child
    went on alone, a minute of CPU per model."""
    raise SystemExit(128 + signum)
