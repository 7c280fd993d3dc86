"""Registration point for sub-commands that live in their own modules (hub, export, serve).

Each entry is a function ``add(subparsers)`` that adds one or more sub-commands; keeping them here
lets ``zoo/cli.py`` stay about the core commands.
"""

from __future__ import annotations

from collections.abc import Callable

COMMANDS: list[Callable] = []


def _add_serve(subparsers) -> None:
    from zoo.serve import add

    add(subparsers)


COMMANDS.append(_add_serve)


def _add_hub(subparsers) -> None:
    from zoo.bundle import add_cli as add_bundle
    from zoo.hub import add_cli as add_hub

    add_hub(subparsers)
    add_bundle(subparsers)


COMMANDS.append(_add_hub)


def _add_export(subparsers) -> None:
    from zoo.export.cli import add

    add(subparsers)


COMMANDS.append(_add_export)


def _add_build_ext(subparsers) -> None:
    sp = subparsers.add_parser("build-ext", help="compile the C++ inference loops now (else: on first use)")
    sp.add_argument("-v", "--verbose", action="store_true", help="show the compiler's output")

    def run(args) -> int:
        from zoo.models._compiled import build_all

        return build_all(verbose=args.verbose)

    sp.set_defaults(func=run)


COMMANDS.append(_add_build_ext)
