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
"""

from __future__ import annotations

from pathlib import Path

from setuptools.command.build_py import build_py

#: The hook's sources, relative to the project root; the wheel has them at its root under the same names.
HOOK_DIR = "zoo/tools/lm_eval_hook"
HOOK_FILES = (f"{HOOK_DIR}/alstm_zoo_lm_eval_hook.py", f"{HOOK_DIR}/alstm_zoo_lm_eval_hook.pth")
#: This file, relative to the project root (pyproject's ``cmdclass`` loads it, also when building from an sdist).
THIS = "zoo/tools/wheel_build.py"


class BuildPy(build_py):
    """``build_py`` plus the hook's module and ``.pth`` at the root of ``build_lib`` (and their sources for sdists)."""

    def _hook_outputs(self) -> list[str]:
        return [str(Path(self.build_lib, Path(src).name)) for src in HOOK_FILES]

    def run(self) -> None:
        super().run()
        for src, dst in zip(HOOK_FILES, self._hook_outputs(), strict=True):
            self.copy_file(src, dst, preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *self._hook_outputs()]

    def get_source_files(self) -> list[str]:
        return [*super().get_source_files(), *HOOK_FILES, THIS]
