"""Checkout tooling, a package per job: the TorchServe launcher (:mod:`zoo.tools.serve`), the demo
(:mod:`zoo.tools.demo`), a run's release: bundling, model cards, publishing (:mod:`zoo.tools.release`), the GPU ferry
(:mod:`zoo.tools.gpu`); beside them tiers, README generation, plots, loopback ports, the docs' and the wheel's hooks.

Not part of the library: the wheel does not ship this package and no library module imports it (a test checks
the import graph). Its commands reach the ``zoo`` CLI through the ``alstm_zoo.commands`` entry point
(:mod:`zoo.tools.commands`), so a plain install says where to find them instead. Paths relative to the
repository belong here, and only here.
"""

from __future__ import annotations

from pathlib import Path

#: The repository root (this file is ``zoo/tools/__init__.py``).
REPO = Path(__file__).resolve().parents[2]
#: The library package of this checkout (recipes, catalogue, bundled weights).
PACKAGE_DIR = REPO / "zoo"
