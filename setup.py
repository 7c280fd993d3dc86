"""Everything about the package is in pyproject.toml; this file only adds the lm_eval hook's ``.pth`` to the wheel.

A ``.pth`` file must sit at the root of site-packages, which no pyproject setting of setuptools can place (package
data lives inside a package, ``data_files`` under the prefix). So ``build_py`` copies ``alstm_zoo_lm_eval_hook.pth``
to the root of ``build_lib``, and the wheel installs it beside ``alstm_zoo_lm_eval_hook.py``. An editable install
(PEP 660) does not carry files from ``build_lib``: the checkout's Makefile copies the same file into ``.venv``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK_PTH = "alstm_zoo_lm_eval_hook.pth"


class build_py_with_hook_pth(build_py):
    """``build_py`` plus the hook's ``.pth`` at the root of ``build_lib`` (also listed as a source, for sdists)."""

    def run(self) -> None:
        super().run()
        self.copy_file(HOOK_PTH, str(Path(self.build_lib, HOOK_PTH)), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, HOOK_PTH))]

    def get_source_files(self) -> list[str]:
        return [*super().get_source_files(), HOOK_PTH]


setup(cmdclass={"build_py": build_py_with_hook_pth})
