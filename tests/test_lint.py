"""The repository is ruff-clean under its own configuration, and the house rule "nothing is unpickled" is a lint
rule (TID251, banned APIs in ``pyproject.toml``) with one stated exception: TorchScript, in
``zoo/export/torchscript.py``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")

pytestmark = pytest.mark.skipif(RUFF is None, reason="ruff is not installed (the dev extra)")


def _ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([RUFF, "check", "--no-cache", *args], cwd=REPO, input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_the_repository_is_ruff_clean():
    res = _ruff(".")
    assert res.returncode == 0, res.stdout[-4000:]


@pytest.mark.parametrize("source", [
    "import pickle\n",
    "import torch\ntorch.load('x.pt')\n",
    "import torch\ntorch.load('x.pt', weights_only=True)\n",   # banned outright: nothing here needs it
    "import torch\nm = torch.jit.load('x.pt')\n",
    "from torch.serialization import load\n",
    "import numpy as np\nnp.load('x.npy')\n",
    "import joblib\n",
])
def test_every_way_to_unpickle_is_refused_in_library_code(source):
    res = _ruff("--select", "TID251", "--stdin-filename", "zoo/some_module.py", "-", stdin=source)
    assert res.returncode == 1 and "TID251" in res.stdout, (source, res.stdout)


def test_the_one_exception_is_torchscript_and_it_is_stated():
    """Exactly one suppression of the rule, where TorchScript is loaded, and that module says why."""
    hits = []
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("site", "build", "runs") or rel.name == "test_lint.py":
            continue
        hits += [(rel.as_posix(), line) for line in path.read_text(errors="replace").splitlines()
                 if "noqa: TID251" in line]
    assert [h[0] for h in hits] == ["zoo/export/torchscript.py"], hits
    assert 'exception to "nothing is unpickled"' in (REPO / "zoo/export/torchscript.py").read_text()
