"""Limits that keep the code in rooms that fit: no function in ``zoo/``, ``app.py`` or ``serving/`` over
``MAX_FUNCTION_LINES`` lines and no class over ``MAX_CLASS_LINES`` (a function that fits a screen; a class with one
job). Lengths are measured from the ``def``/``class`` line to the last line of the body, docstring included.

Generated and vendored code would be excepted here, by file, with why; none of these folders holds any today.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 80, 350
#: file (relative to the repository) -> why it is not held to the limits (generated or vendored code only)
EXCEPTED: dict[str, str] = {}


def checked_files() -> list[Path]:
    files = [*(REPO / "zoo").rglob("*.py"), REPO / "app.py", *(REPO / "serving").rglob("*.py")]
    return sorted(p for p in files if p.relative_to(REPO).as_posix() not in EXCEPTED)


def offenders(source: str, where: str) -> list[str]:
    """``where:line kind name (N lines)`` for each function or class of ``source`` over its limit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind, limit = "function", MAX_FUNCTION_LINES
        elif isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS_LINES
        else:
            continue
        length = node.end_lineno - node.lineno + 1
        if length > limit:
            found.append(f"{where}:{node.lineno} {kind} {node.name} ({length} lines, limit {limit})")
    return found


def test_the_checker_finds_a_long_function_and_a_long_class_nested_or_not():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src = f"def long():\n{body}\n\ndef short():\n    return 1\n"
    assert offenders(src, "m.py") == [f"m.py:1 function long ({MAX_FUNCTION_LINES + 1} lines, limit 80)"]
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_CLASS_LINES // 3 + 1))
    assert [o.split(" (")[0] for o in offenders(f"class Big:\n{methods}", "m.py")] == ["m.py:1 class Big"]
    nested = "def outer():\n    def inner():\n" + "\n".join(f"        y{i} = {i}" for i in range(90)) + "\n"
    assert {o.split(" (")[0] for o in offenders(nested, "m.py")} == {"m.py:1 function outer", "m.py:2 function inner"}


def test_no_function_or_class_over_its_limit():
    found = [o for p in checked_files()
             for o in offenders(p.read_text(encoding="utf-8"), p.relative_to(REPO).as_posix())]
    assert not found, "split these (or, for generated/vendored code only, list the file in EXCEPTED):\n" + \
        "\n".join(found)
