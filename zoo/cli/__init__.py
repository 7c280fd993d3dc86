"""The ``zoo`` command line. Bad input exits with status 2 and a one-line message, never a traceback.

Only :class:`zoo.errors.ZooError` counts as bad input; anything else is a bug and exits 1 with its traceback
(``ZOO_DEBUG=1`` shows tracebacks for user errors too). Each sub-command is a module of this package that adds its
own sub-parser (``register(subparsers)``) and runs it (``run(args) -> int``); the options several commands share
are in :mod:`zoo.cli.options`, the reading of texts and counts in :mod:`zoo.cli.inputs`. Commands that need a
checkout of the repository (``zoo serve``, ``zoo bundle``, ``zoo publish``) are not part of the library: they are
contributed through the ``alstm_zoo.commands`` entry point by ``zoo.tools``, which a plain install does not ship.
The CLI sits at the top of the library: nothing else in ``zoo`` imports it (``tests/test_layers.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from zoo.cli import build_ext, download, evaluate, export, generate, info, listing, score, score_corpus, train
from zoo.cli.parser import EXIT_USAGE, OneLineParser
from zoo.errors import ZooError

__all__ = ["main", "build_parser", "EXIT_USAGE", "COMMANDS", "COMMANDS_GROUP", "CHECKOUT_COMMANDS"]

#: Every sub-command of the library and the module of this package that defines it (``register(subparsers)``
#: adds its sub-parser, ``run(args)`` runs it), in the order ``zoo --help`` lists them: the one listing of where
#: each command lives, as huggingface_hub's ``hf.py`` keeps one.
COMMANDS = {"list": listing, "info": info, "score": score, "score-corpus": score_corpus, "generate": generate,
            "eval": evaluate, "train": train, "download": download, "export": export, "build-ext": build_ext}
#: Entry-point group of sub-commands contributed by other packages (``add(subparsers)`` functions).
COMMANDS_GROUP = "alstm_zoo.commands"
#: The checkout's commands and the module of each (checkout tooling, zoo.tools, not in the wheel: the
#: :data:`COMMANDS_GROUP` entry point adds them); named here to say where they live, and where a plain install
#: lacks them.
CHECKOUT_COMMANDS = {"serve": "zoo.tools.serve.cli", "bundle": "zoo.tools.release.bundle",
                     "publish": "zoo.tools.release.publish"}


def build_parser() -> argparse.ArgumentParser:
    """The library's parser; ``parser.subparsers`` is where plugins add their commands (see :func:`main`)."""
    p = OneLineParser(prog="zoo", description="Adaptive-parameterization language models: "
                      "pretrained weights, scoring, generation, training.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.register(sub)
    p.subparsers = sub  # plugins add their commands here (see main)
    return p


def _plugin_commands() -> list[Any]:
    """``add(subparsers)`` functions registered under :data:`COMMANDS_GROUP`; a plugin that fails to import (the
    checkout tooling in a plain install) is left out, and its commands answer with where to find them."""
    from importlib.metadata import entry_points

    found = []
    for ep in entry_points(group=COMMANDS_GROUP):
        try:
            found.append(ep.load())
        except ImportError:
            continue
    return found


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments of one command: options and positionals in any order (`zoo score M --text hi FILE` reached
    the plain parser's "unrecognized arguments: FILE": argparse fills an optional positional before the options
    that follow); a command with sub-commands of its own (``zoo serve start``) is parsed plainly."""
    command = parser.subparsers.choices.get(argv[0]) if argv else None
    if command is not None and command._subparsers is None:
        args = command.parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one command: a :class:`ZooError` is one line and exit 2, Ctrl-C 130, a closed pipe 0; any other
    exception is a bug and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("ZOO_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    parser = build_parser()
    for add in _plugin_commands():
        add(parser.subparsers)
    if argv and argv[0] in CHECKOUT_COMMANDS and argv[0] not in parser.subparsers.choices:
        print(f"zoo: error: `zoo {argv[0]}` is checkout tooling (zoo.tools), not part of the installed library: "
              "run it from a clone of the repository (`make venv`)", file=sys.stderr)
        return EXIT_USAGE
    args = _parse(parser, argv)
    import torch

    torch.set_flush_denormal(True)
    try:
        return args.func(args) or 0
    except ZooError as e:
        if debug:
            raise
        print(f"zoo: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("zoo: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
