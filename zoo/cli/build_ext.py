"""``zoo build-ext``: compile the C++ inference loops now rather than on first use."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    sp = subparsers.add_parser("build-ext", help="compile the C++ inference loops now (else: on first use)")
    sp.add_argument("-v", "--verbose", action="store_true", help="show the compiler's output")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zoo.models._compiled import build_all

    return build_all(verbose=args.verbose)
