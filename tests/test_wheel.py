"""The wheel is the library: small, no weights, no checkout tooling, and it installs beside a torch the user
already has. A plain install then loads a catalogue model from the Hub (here olah on 127.0.0.1), verified
against the catalogue's sha256 pins, and scores it to the same numbers as the checkout's bundled copy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.olah_fixture import OLAH_CLI, Olah, make_mirror

REPO = Path(__file__).resolve().parent.parent
MAX_WHEEL_BYTES = 5_000_000
TEXT = "the company said its profit rose in the third quarter"


def _source_copy(dest: Path) -> Path:
    """The tracked tree (weights included, as in the repository) hard-linked into ``dest``: building from a
    copy keeps setuptools' build folders out of the checkout, and shows the weights are left out by design."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in files)):
        src, dst = REPO / rel, dest / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("alstm_zoo-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_holds_the_library_only(wheel):
    assert wheel.stat().st_size < MAX_WHEEL_BYTES
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("zoo/pretrained/", "zoo/tools/"))]
    assert not [n for n in names if n.endswith((".safetensors", ".png"))]
    assert {"zoo/__init__.py", "zoo/catalog.json", "zoo/cli/__init__.py", "zoo/cli/__main__.py",
            "zoo/recipes/alstm-ptb-5m-light.toml", "zoo/models/csrc/alstm_infer.cpp", "alstm_zoo_lm_eval_hook.py",
            "alstm_zoo_lm_eval_hook.pth"} <= set(names)
    # the `lm_eval --model zoo` hook at the root of site-packages: its module and .pth as in the checkout tooling's
    # folder (build_py of zoo/tools/wheel_build.py copies them there)
    for name in ("alstm_zoo_lm_eval_hook.py", "alstm_zoo_lm_eval_hook.pth"):
        assert zipfile.ZipFile(wheel).read(name) == (REPO / "zoo/tools/lm_eval_hook" / name).read_bytes()
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    torch_reqs = [line for line in meta.splitlines() if re.match(r"Requires-Dist: torch\b(?![-\w])", line)]
    # beside the user's own torch (the pin is the checkout's); exporting asks for the torch.onnx.export it calls
    assert torch_reqs == ["Requires-Dist: torch>=2.4", 'Requires-Dist: torch>=2.6; extra == "export"']


@pytest.mark.slow
def test_a_wheel_built_from_the_sdist_is_the_same(wheel, tmp_path):
    """The sdist carries what its own build needs although none of it is a package of the distribution: the
    build_py of zoo/tools/wheel_build.py (pyproject's cmdclass) and the hook's sources it copies."""
    src = _source_copy(tmp_path / "src")
    res = subprocess.run([sys.executable, "-c", "import sys\nfrom setuptools import build_meta\n"
                          "build_meta.build_sdist(sys.argv[1])", str(tmp_path / "sdist")],
                         cwd=src, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (sdist,) = (tmp_path / "sdist").glob("alstm_zoo-*.tar.gz")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(sdist)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = (tmp_path / "dist").glob("alstm_zoo-*.whl")
    assert sorted(zipfile.ZipFile(whl).namelist()) == sorted(zipfile.ZipFile(wheel).namelist())


def install_in_fresh_venv(wheel: Path, venv: Path) -> str:
    """A fresh venv at ``venv`` with ``wheel`` installed, reusing this interpreter's torch (and the other
    dependencies) through a plain path entry, which does not run this checkout's editable install and its .pth
    files. Returns its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "reuse_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                          "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return site


@pytest.fixture(scope="module")
def plain_install(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed, reusing this interpreter's torch (and the other dependencies, lm_eval
    included) through a path entry, without this checkout's editable install and its .pth files (a plain path
    entry does not run them). Yields the venv and its site-packages."""
    venv = tmp_path_factory.mktemp("plain") / "venv"
    yield venv, install_in_fresh_venv(wheel, venv)
    shutil.rmtree(venv, ignore_errors=True)


def _plain_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZOO_", "HF_", "ALSTM_ZOO_"))}
    env.update(PYTHONPATH="", **extra)
    return env


@pytest.mark.slow
def test_plain_install_registers_the_harness_model(plain_install, tmp_path):
    """The installed wheel's .pth hook makes the stock harness find `--model zoo` (get_model, as `lm_eval` does):
    the hook comes from the wheel and imported nothing heavy at start-up; the class is the installed zoo's."""
    venv, site = plain_install
    script = ("import json, sys\nstarted = 'alstm_zoo_lm_eval_hook' in sys.modules\n"
              "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lm_eval', 'zoo'})\n"
              "from lm_eval.api.registry import get_model\ncls = get_model('zoo')\n"
              "print(json.dumps({'started': started, 'heavy': heavy, "
              "'hook': sys.modules['alstm_zoo_lm_eval_hook'].__file__, 'cls': f'{cls.__module__}:{cls.__name__}', "
              "'file': sys.modules[cls.__module__].__file__, 'dummy': get_model('dummy').__name__}))")
    res = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True,
                         cwd=tmp_path, env=_plain_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["started"] and got["heavy"] == [] and got["hook"].startswith(site), got
    assert got["cls"] == "zoo.lm_eval_plugin:ZooLM" and got["file"].startswith(site) and got["dummy"] == "DummyLM"


@pytest.mark.slow
def test_plain_install_beside_existing_torch_loads_from_the_hub(plain_install, tmp_path):
    if not OLAH_CLI.exists():
        pytest.skip(".venv-olah is absent (create it with `make olah`)")
    cat = json.loads((REPO / "zoo" / "catalog.json").read_text())
    name = cat["default"]
    entry = cat["models"][name]
    bundled = REPO / "zoo" / "pretrained" / name
    files = {f: (bundled / f).read_bytes() for f in entry["files"]}
    make_mirror(tmp_path / "mirrors", entry["repo_id"], files, tag=entry["revision"])
    server = Olah(tmp_path, tmp_path / "mirrors")
    venv, site = plain_install
    py = venv / "bin" / "python"
    try:
        env = _plain_env(HF_ENDPOINT=server.endpoint, HF_HUB_CACHE=str(tmp_path / "cache"),
                         HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        script = (f"import json, zoo; m = zoo.load({name!r}); "
                  "print(json.dumps({'file': zoo.__file__, 'source': m.source, 'pinned': m.pinned, "
                  f"'ppl': m.score({TEXT!r})[0]['ppl']}}))")
        res = subprocess.run([str(py), "-c", script], capture_output=True, text=True, cwd=outside, env=env,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert got["file"].startswith(site) and got["source"] == "hub download" and got["pinned"]
        import zoo

        # the same weights; the installed copy may run the Python loop while its C++ twin is not built yet
        assert got["ppl"] == pytest.approx(zoo.load(name).score(TEXT)[0]["ppl"], rel=1e-6)
        # the command line of a plain install: the library's commands work, the checkout's say where they live
        zoo_bin = str(venv / "bin" / "zoo")
        res = subprocess.run([zoo_bin, "score", name, "--text", TEXT], capture_output=True, text=True, cwd=outside,
                             env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        res = subprocess.run([zoo_bin, "serve", "start"], capture_output=True, text=True, cwd=outside, env=env,
                             timeout=120)
        assert res.returncode == 2 and "checkout tooling" in res.stderr and "Traceback" not in res.stderr
    finally:
        server.stop()
