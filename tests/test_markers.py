"""The suite's tiers (tests/conftest.py): every test module placed in exactly one, every tier registered."""

from __future__ import annotations

import ast
import tomllib

from tests.conftest import MODULE_TIERS, REPO, TEST_TIERS, TIERS


def test_every_test_module_has_a_tier_and_every_tier_entry_a_module():
    modules = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    missing = sorted(modules - MODULE_TIERS.keys())
    assert not missing, f"add to MODULE_TIERS in tests/conftest.py: {missing}"
    assert not MODULE_TIERS.keys() - modules, f"no such test module: {sorted(MODULE_TIERS.keys() - modules)}"
    assert set(MODULE_TIERS.values()) | set(TEST_TIERS.values()) <= set(TIERS)


def test_the_tiers_are_registered_markers():
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0] for m in markers} >= set(TIERS)


def test_every_moved_test_exists_and_leaves_its_modules_tier():
    """An entry of TEST_TIERS whose test was renamed would leave the test in its module's tier unnoticed."""
    for key, tier in TEST_TIERS.items():
        module, name = key.split("::")
        tree = ast.parse((REPO / "tests" / f"{module}.py").read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{key}: no such test"
        assert tier != MODULE_TIERS[module], f"{key}: already in its module's tier {tier}"


def test_a_unit_test_is_marked_unit_only(request):
    marks = {m.name for m in request.node.iter_markers()} & set(TIERS)
    assert marks == {"unit"}
