"""The checkout's sub-commands of ``zoo`` (``serve``, ``bundle``, ``publish``), registered through the
``alstm_zoo.commands`` entry point so that the library's CLI never imports checkout tooling."""

from __future__ import annotations


def add(subparsers) -> None:
    from zoo.tools.release.bundle import add_cli as add_bundle
    from zoo.tools.release.publish import add_cli as add_publish
    from zoo.tools.serve.cli import add as add_serve

    add_serve(subparsers)
    add_bundle(subparsers)
    add_publish(subparsers)
