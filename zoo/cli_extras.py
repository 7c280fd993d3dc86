"""Registration point for sub-commands that live in their own modules (hub, export, serve).

Each entry is a function ``add(subparsers)`` that adds one or more sub-commands; keeping them here
lets ``zoo/cli.py`` stay about the core commands.
"""

from __future__ import annotations

from collections.abc import Callable

COMMANDS: list[Callable] = []
