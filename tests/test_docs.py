"""The docs hold: the site builds with no warning (every link and anchor resolves, every page is in the navigation),
every ``python`` and ``bash`` block of the README and the guides runs as written, the Python ones pasted line by line
into an interactive console as a reader would paste them, and the README stays a five-minute read."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The pages whose code blocks a newcomer runs: the README and the guides (the included serving and exports READMEs
#: are covered by the server and export tests, which run their examples against real servers and exports).
PAGES = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs" / "guides").glob("*.md"))]
#: A fenced block, with the optional ``<!-- docs-test: skip (why) -->`` line right above it.
FENCE = re.compile(r"^(?:<!-- docs-test: skip \((?P<why>[^\n]+)\) -->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```$",
                   re.S | re.M)
RUNNABLE = ("python", "bash")

#: Runs the Python blocks of one page, in order, in one interactive console (a REPL session): each line is pushed as
#: typed, and an empty line after each block, as pressing Enter after a paste does.
CONSOLE = r"""
import code, json, sys, traceback

class Console(code.InteractiveConsole):
    failed = []

    def showtraceback(self, *args, **kwargs):
        self.failed.append(traceback.format_exc())

    def showsyntaxerror(self, *args, **kwargs):
        self.failed.append(traceback.format_exc(limit=0))

console = Console({"__name__": "__main__"})
for line_no, body in json.load(sys.stdin):
    for line in body.splitlines() + [""]:
        console.push(line)
    if console.failed:
        sys.exit(f"the block at line {line_no} fails when pasted:\n{console.failed[0]}")
"""


def blocks(page: str) -> list[dict]:
    text = (REPO / page).read_text(encoding="utf-8")
    return [{"lang": m["lang"], "body": m["body"], "skip": m["why"], "line": text.count("\n", 0, m.start()) + 1}
            for m in FENCE.finditer(text)]


def _env() -> dict[str, str]:
    """The suite's environment with its interpreter's scripts (``zoo``) first on the PATH, as in the activated venv."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_code_blocks_run_as_written(page, tmp_path):
    found = [b for b in blocks(page) if b["lang"] in RUNNABLE]
    run = [b for b in found if not b["skip"]]
    if not run:
        pytest.skip(f"{page}: no python or bash block to run (any there is marked skip, with its reason)")
    py = [(b["line"], b["body"]) for b in run if b["lang"] == "python"]
    if py:
        proc = subprocess.run([sys.executable, "-c", CONSOLE], input=json.dumps(py), capture_output=True, text=True,
                              cwd=tmp_path, env=_env(), timeout=900)
        assert proc.returncode == 0, f"{page}: {proc.stderr[-3000:]}"
    for b in (b for b in run if b["lang"] == "bash"):
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", b["body"]], capture_output=True, text=True,
                              cwd=tmp_path, env=_env(), timeout=900)
        assert proc.returncode == 0, f"{page}, the block at line {b['line']}: {proc.stderr[-3000:]}"


def test_every_block_is_run_or_says_why_not():
    """A skipped block names why (a server, the network, a long run) and where it is tested instead; the quick
    start's Python and its offline CLI lines always run."""
    for page in PAGES:
        for b in blocks(page):
            if b["lang"] in RUNNABLE and b["skip"]:
                assert "test" in b["skip"] or "shell" in b["skip"], (page, b["line"], b["skip"])
    readme = [b for b in blocks("README.md") if b["lang"] in RUNNABLE]
    assert any(b["lang"] == "python" and not b["skip"] and "zoo.load" in b["body"] for b in readme)
    assert any(b["lang"] == "bash" and "zoo download" in b["body"] for b in readme)


def test_console_refuses_what_a_repl_would():
    """The runner is as strict as a pasted REPL: no blank line after an indented block is a SyntaxError."""
    bad = [(1, "for i in range(2):\n    x = i\nprint(x)\n")]
    proc = subprocess.run([sys.executable, "-c", CONSOLE], input=json.dumps(bad), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "SyntaxError" in proc.stderr
    good = [(1, "for i in range(2):\n    x = i\n\nprint(x)\n")]
    proc = subprocess.run([sys.executable, "-c", CONSOLE], input=json.dumps(good), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr


@pytest.mark.slow
def test_site_builds_strictly_with_no_warning(tmp_path):
    """`make docs`: every internal link and anchor resolves and every page is in the navigation, or the build fails;
    the included READMEs and cards are on their pages."""
    pytest.importorskip("mkdocs")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                          capture_output=True, text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), timeout=600)
    assert proc.returncode == 0 and "WARNING" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert "Serving with TorchServe" in (site / "guides" / "server" / "index.html").read_text()
    card = (site / "results" / "cards" / "alstm-ptb-5m-long-medium" / "index.html").read_text()
    assert "alstm-ptb-5m-long-medium-curve.png" in card and (site / "model_cards").is_dir()
    assert 'id="quick-start"' in (site / "index.html").read_text()  # the home page is the README


def test_readme_is_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout")
def test_built_wheels_are_ignored():
    """`pip wheel --no-deps .` writes the wheel into the checkout: git ignores it."""
    for path in ("alstm_zoo-0.0.0-py3-none-any.whl", "dist/alstm_zoo-0.0.0-py3-none-any.whl", "site/index.html"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, timeout=30).returncode == 0, path
