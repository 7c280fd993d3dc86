"""Test helpers for the Hub: a tiny real training run, bundles in temp packages, git mirrors and olah.

olah (PyPI ``olah``, a Hub-compatible mirror server) serves plain git repositories from its
``mirrors-path`` at ``models/<org>/<name>``; it runs from its own venv (``make olah``) because it
pins psutil. Notes from running it: it needs explicit allow rules (``*/*``) or every repo is a 401,
``model_info`` needs a revision, and it answers 401 (not 404) for a file that is not in the repo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from zoo.tools.ports import free_port

REPO = Path(__file__).resolve().parent.parent
OLAH_CLI = REPO / ".venv-olah" / "bin" / "olah-cli"

TINY_RECIPE = """
name = "tiny-lstm-hub"
dataset = "ptb"
seed = 3
description = "A tiny LSTM for tests."
[model]
architecture = "lstm"
emb_size = 8
tie_weights = true
[model.arch_args]
hidden_size = 8
num_layers = 1
[train]
epochs = 2
batch_size = 4
bptt = 10
optimizer = "adam"
lr = 0.003
clip = 5.0
eval_batch_size = 4
test_batch_size = 1
eval_bptt = 20
save_dtype = "float16"
[reference]
valid = 120.7
test = 114.5
metric = "perplexity"
source = "test fixture reference"
"""

_RUNS: dict[str, Path] = {}


def make_tiny_data(root: Path) -> Path:
    """A small corpus in PTB's format (the committed synthetic one: a tiny run needs some text, not the real PTB)."""
    from tests.conftest import synthetic_corpus

    return synthetic_corpus(root, {"train": 100, "valid": 20, "test": 20})


def tiny_run(root: Path) -> Path:
    """A finished tiny training run (release/, eval.json, log.jsonl, recipe.toml), made once per session."""
    if "run" not in _RUNS:
        import torch

        from zoo.training import Recipe, Trainer

        root.mkdir(parents=True, exist_ok=True)
        data = make_tiny_data(root / "data")
        (root / "recipe.toml").write_text(TINY_RECIPE)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a tiny model: one thread is faster on a busy 2-core machine
        try:
            Trainer(Recipe.load(root / "recipe.toml"), root / "run", data_dir=str(data), device="cpu",
                    progress=False).run()
        finally:
            torch.set_num_threads(threads)
        _RUNS["run"] = root / "run"
    return _RUNS["run"]


def recipe_file(run_dir: Path) -> Path:
    return run_dir.parent / "recipe.toml"


def zoo_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real ``zoo`` command line in a subprocess (bounded in time)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "ZOO_"))}
    base.update(HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    return subprocess.run([sys.executable, "-m", "zoo.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**base, **(env or {})}, timeout=timeout)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """The ``zoo`` command line in-process (``zoo.cli.main``): exit code, stdout, stderr."""
    from zoo.cli import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# -- git mirrors -----------------------------------------------------------------------------------------------
def _git(repo: Path, *args: str) -> str:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CEILING_DIRECTORIES": str(repo.parent),
           "GIT_AUTHOR_NAME": "zoo-test", "GIT_AUTHOR_EMAIL": "zoo@test", "GIT_COMMITTER_NAME": "zoo-test",
           "GIT_COMMITTER_EMAIL": "zoo@test"}
    res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, timeout=60)
    if res.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {res.stderr}")
    return res.stdout.strip()


def make_mirror(mirrors: Path, repo_id: str, files: dict[str, bytes], tag: str = "v1.0") -> str:
    """A plain git repository at ``<mirrors>/models/<org>/<name>`` holding ``files``, tagged; returns the commit."""
    repo = mirrors / "models" / repo_id
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    for name, data in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"release {tag}")
    _git(repo, "tag", tag)
    return _git(repo, "rev-parse", "HEAD")


# -- the olah server -------------------------------------------------------------------------------------------
class Olah:
    """olah-cli on 127.0.0.1, offline, serving the git repos under ``mirrors`` (stopped by PID)."""

    def __init__(self, workdir: Path, mirrors: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "olah.toml"
        cfg.write_text(f"""
[basic]
host = "127.0.0.1"
port = {self.port}
repos-path = "{workdir / 'olah-repos'}"
mirrors-path = ["{mirrors}"]
hf-scheme = "http"
hf-netloc = "127.0.0.1:9"
hf-lfs-netloc = "127.0.0.1:9"
mirror-netloc = "127.0.0.1:{self.port}"
mirror-lfs-netloc = "127.0.0.1:{self.port}"
[accessibility]
offline = true
[[accessibility.proxy]]
repo = "*/*"
allow = true
[[accessibility.cache]]
repo = "*/*"
allow = true
""")
        self.log = open(workdir / "olah.log", "w")
        self.proc = subprocess.Popen([str(OLAH_CLI), "-c", str(cfg)], cwd=workdir, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"olah exited: {(workdir / 'olah.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
                return
            except urllib.error.HTTPError:  # any HTTP answer means it is up (its index page is a 500)
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("olah did not start within 60 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def bundle_into(pkg: Path, run_dir: Path, name: str, **kwargs) -> dict:
    """Bundle a run into a temporary package (``pkg/catalog.json``, ``pkg/pretrained``, ``pkg/cards``)."""
    from zoo.tools.release.bundle import bundle

    return bundle(run_dir, name, catalog_file=pkg / "catalog.json", pretrained_dir=pkg / "pretrained",
                  cards_dir=pkg / "cards", recipe_path=recipe_file(run_dir), **kwargs)


def real_default_bundle(catalog_file: Path | None = None) -> tuple[str, dict, Path] | None:
    """The package's real default model when it is bundled (name, catalogue entry, folder), else ``None``."""
    from zoo.catalog import CATALOG_FILE

    catalog_file = catalog_file or CATALOG_FILE
    if not catalog_file.is_file():
        return None
    cat = json.loads(catalog_file.read_text())
    name = cat.get("default")
    entry = cat.get("models", {}).get(name or "")
    folder = catalog_file.parent / "pretrained" / (name or "")
    if not name or not entry or not entry.get("files") or not folder.is_dir():
        return None
    return name, entry, folder


def add_catalog_alias(pkg: Path, name: str, source: str, repo_id: str) -> None:
    """A catalogue entry with another name and Hub repo but the same pinned files as ``source``."""
    path = pkg / "catalog.json"
    cat = json.loads(path.read_text())
    cat["models"][name] = dict(cat["models"][source], repo_id=repo_id)
    path.write_text(json.dumps(cat, indent=2))
