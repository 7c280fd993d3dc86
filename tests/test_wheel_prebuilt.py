"""The wheel route needs no compiler at first use (issue 54, point 4).

A wheel built where torch imports (``pip wheel --no-build-isolation``) is a platform wheel carrying the C++
inference loops built at wheel-build time (``zoo/tools/wheel_build.py``); installed into a fresh venv and run with
no compiler on the PATH and an empty extension cache, it scores with those loops, compiling nothing. The
pure-Python wheel (``ZOO_PURE_WHEEL=1``) still works there: the loops cannot be compiled, it says so once and runs
the Python loops, to the same numbers. A platform wheel's loops built for another torch are not used: the first
use says why and builds (here: cannot, and says that too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import zoo
from tests.test_wheel import _source_copy, install_in_fresh_venv

REPO = Path(__file__).resolve().parent.parent
TEXT = "the company said its profit rose in the third quarter"
#: An aLSTM (the aLSTM loop) and a HyperLSTM (the HyperLSTM loop in eval mode), loaded as checkpoint folders.
MODELS = ("alstm-ptb-5m-long-medium", "hyperlstm-ptbchar-1.5m-long")
PROBE = f"""
import json, sys
import zoo
from zoo.models import _compiled
out = {{"file": zoo.__file__, "scores": {{}}}}
for folder in sys.argv[1:]:
    out["scores"][folder] = zoo.load(folder).score({TEXT!r})[0]["nll"]
out["status"] = _compiled.status()
print(json.dumps(out))
"""


def _build(tmp: Path, **env: str) -> Path:
    src = _source_copy(tmp / "src")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                          "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, **env))
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("alstm_zoo-*.whl")
    return whl


def _install(wheel: Path, root: Path) -> Path:
    """A fresh venv under ``root`` with ``wheel`` installed (test_wheel's way: this interpreter's torch reused)."""
    venv = root / "venv"
    install_in_fresh_venv(wheel, venv)
    return venv


def _run_without_compiler(venv: Path, tmp: Path) -> tuple[dict, str]:
    """Score in ``venv`` with only the venv's bin on the PATH (no c++, no ninja) and an empty extension cache."""
    assert not any(shutil.which(c, path=str(venv / "bin")) for c in ("c++", "g++", "gcc", "clang++"))
    cache = tmp / "extensions"
    cache.mkdir(exist_ok=True)
    env = {"PATH": str(venv / "bin"), "HOME": str(tmp), "ZOO_EXTENSIONS_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    folders = [str(REPO / "zoo" / "pretrained" / name) for name in MODELS]
    res = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE, *folders], capture_output=True, text=True,
                         cwd=tmp, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@pytest.fixture(scope="module")
def reference() -> dict[str, float]:
    for name in MODELS:
        if not (REPO / "zoo" / "pretrained" / name).is_dir():
            pytest.skip(f"needs the bundled {name}")
    return {str(REPO / "zoo" / "pretrained" / n): zoo.load(n, source="bundled").score(TEXT)[0]["nll"] for n in MODELS}


@pytest.mark.slow
def test_the_platform_wheel_scores_with_its_built_loops_and_no_compiler(reference, tmp_path):
    from zoo.models import _compiled

    if not all(_compiled.load(n) for n in _compiled.SOURCES):
        pytest.skip(f"no C++ loops can be built here: {_compiled.status()}")
    wheel = _build(tmp_path / "build")
    tag = wheel.name.removesuffix(".whl").split("-")[-3:]
    assert tag[:2] == [f"cp{sys.version_info[0]}{sys.version_info[1]}"] * 2 and tag[2] != "any", wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    built = [n for n in names if n.startswith("zoo/models/_prebuilt/")]
    assert sorted(n.rsplit("/", 1)[1].split("_")[1] for n in built if n.endswith(".so")) == ["alstm", "hyper"]
    meta = json.loads(zipfile.ZipFile(wheel).read("zoo/models/_prebuilt/build.json"))
    assert meta["key"] == _compiled.build_key()
    venv = _install(wheel, tmp_path)
    got, err = _run_without_compiler(venv, tmp_path)
    assert got["file"].startswith(str(venv))
    assert all(s["available"] and s.get("prebuilt") and not s["compiled_now"] for s in got["status"].values()), got
    assert "compiling" not in err and "unavailable" not in err, err
    assert not any((tmp_path / "extensions").iterdir())  # nothing was built at first use
    for folder, nll in got["scores"].items():  # the same loops' numbers, to float rounding
        assert nll == pytest.approx(reference[folder], rel=1e-6)

    # the same wheel beside another torch: its loops are not used, and the first use says why
    (Path(got["status"]["alstm_infer"]["path"]) / "build.json").write_text(
        json.dumps(dict(meta, key=dict(meta["key"], torch="0.0"))))
    got, err = _run_without_compiler(venv, tmp_path)
    assert "the wheel's built loops are for torch 0.0 (here " in err and "compiling" in err, err
    assert not any(s["available"] for s in got["status"].values())  # no compiler here: the Python loops
    for folder, nll in got["scores"].items():
        assert nll == pytest.approx(reference[folder], rel=1e-5)


@pytest.mark.slow
def test_the_pure_wheel_runs_the_python_loops_without_a_compiler(reference, tmp_path):
    wheel = _build(tmp_path / "build", ZOO_PURE_WHEEL="1")
    assert wheel.name.endswith("-py3-none-any.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "_prebuilt" in n]
    venv = _install(wheel, tmp_path)
    got, err = _run_without_compiler(venv, tmp_path)
    assert not any(s["available"] for s in got["status"].values()), got
    # announced: the first use tried to build (naming the platform wheel), then said it runs the Python loops
    assert err.count("compiling the aLSTM's C++ inference loop") == 1 and "platform wheel" in err, err
    assert "using the Python path (same numbers, slower)" in err, err
    for folder, nll in got["scores"].items():
        assert nll == pytest.approx(reference[folder], rel=1e-5)
