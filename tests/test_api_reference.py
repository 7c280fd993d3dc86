"""The API reference renders: parameter tables, working cross-references, no raw Sphinx role (issue 54, point 3).

The docstrings name objects with Sphinx roles; ``zoo/tools/griffe_roles.py`` turns each into a cross-reference
when the site is built, and ``zoo/tools/mkdocs_hooks.py`` fails a strict build on any role left as text.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("mkdocs")
griffe = pytest.importorskip("griffe")

from zoo.tools.griffe_roles import ROLE, SphinxRoles  # noqa: E402


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir",
                           str(site)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    proc = build(REPO / "mkdocs.yml", site)
    assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stderr[-3000:]
    return site


def test_roles_become_cross_references_in_the_docstrings_scope():
    zoo = griffe.load("zoo", search_paths=[str(REPO)], extensions=griffe.load_extensions(SphinxRoles))
    left = [o.path for o in _walk(zoo) if o.docstring is not None and ROLE.search(o.docstring.value)]
    assert left == []
    text = zoo["zoo_model.load"].docstring.value  # `:meth:`ZooModel.to`` in zoo.zoo_model: a local class
    assert '<autoref identifier="zoo.zoo_model.ZooModel.to" optional><code>ZooModel.to</code></autoref>' in text
    assert '<autoref identifier="zoo.hub.resolve" optional>' in text  # a full path stays as written


def test_a_role_that_names_nothing_is_a_warning(caplog):
    from zoo.tools.griffe_roles import convert

    zoo = griffe.load("zoo", search_paths=[str(REPO)])
    with caplog.at_level(logging.WARNING):
        out = convert(zoo["zoo_model.load"], "see :func:`zoo.no_such_function` and :func:`torch.compile`")
    assert "names nothing" in caplog.text and "zoo.no_such_function" in caplog.text
    assert out == "see `zoo.no_such_function` and `torch.compile`"  # no link to a page that is not there


def test_api_reference_has_parameter_tables_and_links(site):
    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert not re.search(r":(meth|class|func|mod|attr|data):", page)
    tables = re.findall(r"<table>.*?</table>", page, re.S)
    load = next(t for t in tables if "name_or_path" in t)  # zoo.load's parameters, each with its description
    assert all(p in load for p in ("backend", "precision", "device", "revision", "source", "cache_dir"))
    assert any("max_new_tokens" in t for t in tables) and any("return_tokens" in t for t in tables)
    assert 'href="#zoo.ZooModel.to"' in page and 'href="#zoo.list_models"' in page


def test_a_strict_build_fails_on_a_raw_role(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Page\n\nCall :meth:`ZooModel.score` first.\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\ndocs_dir: {docs}\nhooks:\n  - {REPO / 'zoo/tools/mkdocs_hooks.py'}\n")
    proc = build(config, tmp_path / "site")
    assert proc.returncode != 0 and "raw Sphinx role" in proc.stderr, proc.stderr[-2000:]


def _walk(obj):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)
