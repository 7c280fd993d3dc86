"""The alstm-zoo Gradio demo: score with per-token surprisal, stream generation, browse the models,
and watch the adaptation policy at work.

The entry point only: ``python app.py`` (``make demo``) reads its options, makes the model registry, builds the
page and serves it on loopback (its environment is set here, before Gradio is imported). The demo is the package
``zoo/tools/demo/``: the launch (:mod:`zoo.tools.demo.launch`: options, page, server), the models
(:mod:`zoo.tools.demo.registry`, over the library's :class:`zoo.model_cache.ModelCache`), the endpoint functions
(:mod:`zoo.tools.demo.handlers`), the tabs (:mod:`zoo.tools.demo.ui`), the rendering (:mod:`zoo.tools.demo.render`),
the route guard (:mod:`zoo.tools.demo.guard`) and dynamic evaluation's statistics (:mod:`zoo.tools.demo.stats`);
scoring, sampling and the adaptation trace all come from the library. It runs offline on the bundled models plus any
checkpoint directories given with ``--model-dir`` (repeatable) or ``ZOO_DEMO_MODELS`` (paths separated by
``os.pathsep``).

    python app.py [--port 7860] [--host 127.0.0.1] [--model-dir DIR ...]

Named API endpoints (gradio_client): ``/score``, ``/generate``, ``/adaptation``, ``/model_info``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


def _check_port_env() -> None:
    """gradio reads $GRADIO_SERVER_PORT as it is imported, and a non-number there was a traceback from inside
    ``import gradio``: checked first, one line, exit 2 (only when run as the demo, not when imported)."""
    value = os.environ.get("GRADIO_SERVER_PORT", "").strip()
    if value and not (value.isdigit() and 0 < int(value) < 65536):
        print(f"app.py: error: GRADIO_SERVER_PORT must be a port number in 1..65535, got {value!r}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    _check_port_env()

from zoo.tools.demo.handlers import NONE_CHOICE  # noqa: E402, F401  (the "Compare with" box's none, for clients)
from zoo.tools.demo.launch import build_demo, launch, main, model_dirs_from, parse_args  # noqa: E402, F401
from zoo.tools.demo.registry import ModelRegistry  # noqa: E402, F401  (what build_demo makes; tests build one)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """A supervisor's SIGTERM ends the demo as Ctrl-C does, through the exit handlers: the statistics' child
    process (:mod:`zoo.tools.demo.stats`) is stopped with it. Python's default SIGTERM skips them, and the child
    went on alone, a minute of CPU per model."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
