"""The wheel's ``build_py``: setuptools' own, plus the lm_eval start-up hook at the root of the wheel.

pyproject.toml names :class:`BuildPy` in ``[tool.setuptools.cmdclass]``. setuptools loads this file by its path
(``spec_from_file_location``), so neither ``zoo`` (torch) nor ``zoo.tools`` is imported on the way, and this module
must import nothing of the zoo either.

The hook is two files that belong at the root of site-packages: the module ``alstm_zoo_lm_eval_hook.py`` and the
``alstm_zoo_lm_eval_hook.pth`` that imports it at start-up (see the module's docstring). No pyproject setting of
setuptools can place a ``.pth`` there (package data lives inside a package, ``data_files`` under the prefix), and
their sources live in the checkout tooling's folder (the repository's top level is fixed), which the wheel does
not ship as a package. So :meth:`BuildPy.run` copies both to the root of ``build_lib``, and
:meth:`BuildPy.get_source_files` lists them, with this file, for sdists: a wheel built from the sdist needs all
three. An editable install (PEP 660) does not carry files from ``build_lib``: the checkout's Makefile puts the same
two files into ``.venv``.

The platform wheel: a wheel built where torch can be imported (``pip wheel --no-build-isolation``, in the
environment whose torch it will run with) also carries the C++ inference loops, compiled now, in
``zoo/models/_prebuilt/`` (``zoo.models._compiled.write_prebuilt``, loaded by its path: it needs only torch), and is
tagged for this Python and platform, as PyTorch extensions ship; so a user's first use needs no compiler. Where
torch is not importable (an isolated build: ``pip wheel .``), where no compiler is found, or with
``ZOO_PURE_WHEEL=1``, the wheel is the pure-Python one, whose first use compiles the loops (announced) or runs the
Python loops without a compiler; the build says which it made.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools.command.build_py import build_py

#: The hook's sources, relative to the project root; the wheel has them at its root under the same names.
HOOK_DIR = "zoo/tools/lm_eval_hook"
HOOK_FILES = (f"{HOOK_DIR}/alstm_zoo_lm_eval_hook.py", f"{HOOK_DIR}/alstm_zoo_lm_eval_hook.pth")
#: This file, relative to the project root (pyproject's ``cmdclass`` loads it, also when building from an sdist).
THIS = "zoo/tools/wheel_build.py"
#: The module that builds the loops (it imports torch and the standard library only), and where the wheel has them.
COMPILED = "zoo/models/_compiled.py"
PREBUILT = "zoo/models/_prebuilt"


def _say(message: str) -> None:
    print(f"alstm-zoo wheel: {message}", flush=True)


class BuildPy(build_py):
    """``build_py`` plus the hook's module and ``.pth`` at the root of ``build_lib`` (and their sources for sdists)."""

    _prebuilt: list[str] = []

    def _hook_outputs(self) -> list[str]:
        return [str(Path(self.build_lib, Path(src).name)) for src in HOOK_FILES]

    def run(self) -> None:
        super().run()
        for src, dst in zip(HOOK_FILES, self._hook_outputs(), strict=True):
            self.copy_file(src, dst, preserve_mode=False)
        wheel = self.distribution.command_obj.get("bdist_wheel")
        if wheel is not None and not getattr(self, "editable_mode", False):
            self._prebuilt = self._build_loops()
            if self._prebuilt:  # a platform wheel: tagged cpXY-cpXY-<platform>, its files installed into platlib
                wheel.root_is_pure = False
                self.distribution.has_ext_modules = lambda: True  # (what `install` asks to choose platlib)

    def _build_loops(self) -> list[str]:
        """The compiled loops' files in ``build_lib``, or ``[]`` for the pure-Python wheel (saying why)."""
        if os.environ.get("ZOO_PURE_WHEEL", "") not in ("", "0"):
            _say("the pure-Python wheel (ZOO_PURE_WHEEL is set): the C++ loops compile at first use")
            return []
        try:
            spec = importlib.util.spec_from_file_location("_alstm_zoo_compiled_for_wheel", COMPILED)
            compiled = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(compiled)
        except ImportError as e:
            _say(f"the pure-Python wheel: torch is not importable here ({e}); build with "
                 "`pip wheel --no-build-isolation` in the environment whose torch the wheel will use for the "
                 "platform wheel, with the C++ loops built")
            return []
        _say("building the platform wheel: compiling the two C++ inference loops (or taking them from the cache)")
        try:
            files = compiled.write_prebuilt(Path(self.build_lib, PREBUILT))
        except RuntimeError as e:
            _say(f"the pure-Python wheel: a C++ loop did not build ({str(e)[:300]})")
            return []
        _say(f"the platform wheel, its C++ loops built for {compiled.build_key()}")
        return [str(f) for f in files]

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *self._hook_outputs(), *self._prebuilt]

    def get_source_files(self) -> list[str]:
        return [*super().get_source_files(), *HOOK_FILES, THIS]
