"""The GPU campaign's plumbing on the CPU: a committed pack survives a fresh clone and the run continues from it;
several recipes train at once through the piece script, stop before its budget, pack, and resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import real_data
from tests.test_train import kill_data, write_recipe  # noqa: F401 (kill_data is a fixture: a small corpus)
from zoo.tools.gpu import ferry, runpack
from zoo.training import Recipe, Trainer

REPO = Path(__file__).resolve().parent.parent


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _temp_repo(path: Path) -> Path:
    path.mkdir()
    _git(path, "init", "-q")
    _git(path, "config", "user.email", "test@example.invalid")
    _git(path, "config", "user.name", "test")
    (path / "README.md").write_text("a checkout\n")
    _git(path, "add", "README.md")
    _git(path, "commit", "-q", "-m", "start")
    return path


def _log(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines() if x.strip()]


def _piece(recipe: Recipe, run_dir: Path, data: Path) -> dict:
    """One epoch, paused at its end (as a GPU piece ends when an epoch end comes before the budget)."""
    return Trainer(recipe, run_dir, data_dir=str(data), progress=False, pause_after_minutes=1e-6).run(resume=True)


def test_committed_pack_restores_on_a_fresh_clone_and_the_run_continues(tmp_path, kill_data):  # noqa: F811
    repo = _temp_repo(tmp_path / "repo")
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", epochs=4))   # never finished: no test-split scoring
    run = tmp_path / "machine1" / "tiny-alstm"
    _piece(recipe, run, kill_data)
    first = runpack.commit_pack(repo, "tiny-alstm", run)
    stale = tmp_path / "stale"
    shutil.copytree(runpack.pack_dir(repo, "tiny-alstm"), stale)
    _piece(recipe, run, kill_data)
    shutil.copytree(run, tmp_path / "fp32")   # the uncarried run, for comparison
    second = runpack.commit_pack(repo, "tiny-alstm", run)
    assert (first["epoch"], second["epoch"]) == (2, 3)
    tracked = _git(repo, "ls-files", "model_cards/runs/tiny-alstm").split()
    assert sorted(tracked) == sorted(f"model_cards/runs/tiny-alstm/{f}" for f in
                                     [ferry.MANIFEST] + [p["name"] for p in second["parts"]])  # the latest only
    assert _git(repo, "log", "--format=%s").count("tiny-alstm: ferry pack") == 2
    assert not _git(repo, "status", "--porcelain")
    with pytest.raises(ferry.FerryError, match="ahead of this pack"):
        runpack.commit_pack(repo, "tiny-alstm", stale)

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-local", str(repo), str(clone)], check=True)
    where = runpack.carry_out(clone, ["tiny-alstm", "never-started"], tmp_path / "devrun")  # trip.sh out
    assert where["never-started"].endswith("starts from epoch 1") and "committed pack" in where["tiny-alstm"]
    restored = runpack.restore(clone, "tiny-alstm", clone / "runs" / "tiny-alstm")
    assert restored is not None and restored["step"] == second["step"]
    assert runpack.restore(clone, "tiny-alstm", clone / "runs" / "tiny-alstm") is None  # it has its own now

    _piece(recipe, clone / "runs" / "tiny-alstm", kill_data)   # epoch 3 from the clone
    _piece(recipe, tmp_path / "fp32", kill_data)                # and from the uncarried float32 state
    log = _log(clone / "runs" / "tiny-alstm")
    resumed = [r for r in log if r.get("event") == "resumed"][-1]  # (the first: the second piece on machine 1)
    assert (resumed["epoch"], resumed["pos"], resumed["step"]) == (3, 0, second["step"])  # from the packed step
    assert [r["epoch"] for r in log if "valid_ppl" in r] == [1, 2, 3]  # (the ferry's best_reset: see ferry.py)
    mine = [r for r in log if "train_loss" in r][-1]
    ref = [r for r in _log(tmp_path / "fp32") if "train_loss" in r][-1]
    assert mine["epoch"] == ref["epoch"] == 3
    # loss continuity across the clone: the float16 weights and 8-bit moments move the next epoch by ~1e-5
    # (measured here: train loss 5.605678 vs 5.605686, valid ppl 769.67 vs 769.63)
    assert mine["train_loss"] == pytest.approx(ref["train_loss"], rel=2e-3)
    assert mine["valid_ppl"] == pytest.approx(ref["valid_ppl"], rel=2e-3)


def test_first_moment_travels_as_float16_when_beta1_is_not_zero(tmp_path, kill_data):  # noqa: F811
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", epochs=2, extra_train="adam_betas = [0.9, 0.999]"))
    _piece(recipe, tmp_path / "a", kill_data)
    ferry.pack(tmp_path / "a", tmp_path / "out")
    result = ferry.unpack(tmp_path / "out", tmp_path / "b")
    assert result["event"]["adam_exp_avg"] == "float16"
    orig = load_file(str(tmp_path / "a" / "checkpoint" / "state.safetensors"))
    back = load_file(str(tmp_path / "b" / "checkpoint" / "state.safetensors"))
    moments = [k for k in orig if k.endswith(".exp_avg")]
    assert moments and all(torch.equal(back[k], orig[k].half().float()) for k in moments)
    assert any(orig[k].abs().sum() > 0 for k in moments)


def _env() -> dict[str, str]:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["ZOO_NO_EXTENSIONS"] = "1"  # (a first build of the C++ eval loops takes minutes: not what is tested here)
    return env


def test_piece_trains_two_recipes_at_once_stops_them_before_the_budget_and_both_packs_resume(tmp_path,
                                                                                           kill_data):  # noqa: F811
    """Two tiny recipes, each in its own process, through the same script a GPU piece uses (--device cpu): both
    are stopped by SIGTERM mid-run (their recipes ask for far more epochs than the budget allows), both packs
    come back into --out beside piece.json, and each resumes at the step it was packed at."""
    recipes = [write_recipe(tmp_path / f"{arch}.toml", arch=arch, epochs=500) for arch in ("alstm", "lstm")]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "zoo.tools.gpu.piece", "train", *map(str, recipes), "--device", "cpu",
           "--budget-s", "75", "--stop-margin-s", "15", "--runs-root", str(tmp_path / "runs"),
           "--ferry", str(tmp_path / "none"), "--repo", str(tmp_path), "--data-dir", str(kill_data),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "piece.json").read_text())
    assert summary["seconds"] < 75
    assert sorted(summary["runs"]) == ["tiny-alstm", "tiny-lstm"]
    for name, rec in summary["runs"].items():
        assert rec["exit"] == "SIGTERM at the budget" and rec["returncode"] == 128 + 15, rec
        assert rec["step_after"] > 0 and summary["returned"][name] == str(out / name)
        manifest = json.loads((out / name / ferry.MANIFEST).read_text())
        assert manifest["step"] == rec["step_after"]
        recipe = Recipe.load(next(r for r in recipes if name.endswith(r.stem)))
        t = Trainer(recipe, tmp_path / "here" / name, data_dir=str(kill_data), progress=False)
        ferry.unpack(out / name, t.run_dir)
        assert t.load_training_checkpoint() and t.step == manifest["step"]
        assert (t.epoch, t.pos) == (manifest["epoch"], manifest["pos"])
        x, y, seq_len, t.pos = t._next_batch(None)
        assert 0 < t.train_step(x, y, seq_len) < 20  # it trains on from there
    assert len(list(out.rglob("*"))) - 2 <= 8  # the return's file limit (two folders are not files)

    left = subprocess.run([sys.executable, "-m", "zoo.tools.gpu.piece", "collect", "tiny-lstm", "--runs-root",
                           str(tmp_path / "runs"), "--out", str(tmp_path / "out2")], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert left.returncode == 0 and (tmp_path / "out2" / "tiny-lstm" / ferry.MANIFEST).is_file(), left.stderr


def test_the_deliver_step_keeps_what_does_not_fit_for_a_later_call(tmp_path):
    packs = tmp_path / "packs"
    for name, size in (("a", 40), ("b", 30)):
        (packs / name).mkdir(parents=True)
        (packs / name / ferry.MANIFEST).write_text("{}")
        (packs / name / "ferry.part00").write_bytes(b"\0" * (size * ferry.MiB))
    from zoo.tools.gpu.piece import deliver
    where = deliver(["a", "b", "c"], packs, tmp_path / "out")
    assert where["a"] == str(tmp_path / "out" / "a") and "collect it" in where["b"] and where["c"] == "no pack"


@pytest.mark.parametrize(("name", "params"), [
    ("alstm-ptb-17m-ref", 17_197_800),            # reference-models.md 1.8: the paper's "17M"
    ("lstm-ptb-17m-ref", 17_201_420),             # size-matched to it: 2 x 1415 (+0.02%)
    ("hyperlstm-ln-ptbchar-4.9m-ref", 4_923_154),  # reference-models.md 2.6: the paper's LN HyperLSTM 4.92M
])
def test_the_queue_recipes_build_the_stated_sizes(name, params):
    from zoo.data import load_corpus
    from zoo.lm import LanguageModel
    from zoo.training import recipe_path

    recipe = Recipe.load(recipe_path(name))
    real_data(recipe.dataset)
    vocab = len(load_corpus(recipe.dataset, None).vocab)  # outside the meta device: the corpus is cached
    with torch.device("meta"):   # (sizes only: no memory, no initialisation)
        model = LanguageModel(vocab_size=vocab, **recipe.model)
    assert sum(p.numel() for p in model.parameters()) == params
    if name.startswith("lstm"):
        assert abs(params - 17_197_800) / 17_197_800 < 1e-3


def test_concurrent_runs_benchmark_tiny_mode_writes_its_json(tmp_path, kill_data):  # noqa: F811
    """benchmarks/concurrent_runs.py on the CPU with a tiny recipe: one and two workers, overlapping windows."""
    recipe = write_recipe(tmp_path / "a.toml", epochs=1)
    out = tmp_path / "concurrent_runs.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "concurrent_runs.py"), "--recipes", str(recipe),
                           "--counts", "1", "2", "--device", "cpu", "--seconds", "1.5", "--warmup-steps", "2",
                           "--data-dir", str(kill_data), "--out", str(out), "--no-readme"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["runs"] for r in result["records"]] == [1, 2] and not result["cuda_graphs"]
    for r in result["records"]:
        assert len(r["per_run"]) == r["runs"]
        assert all(x["tokens"] > 0 and x["seconds"] >= 1.5 for x in r["per_run"])
        assert r["total_tokens_per_s"] == pytest.approx(sum(x["tokens_per_s"] for x in r["per_run"]))


def test_a_checkpoint_written_before_any_log_line_carries(tmp_path, kill_data):  # noqa: F811
    """A piece killed in its first epoch leaves only a periodic checkpoint and no log: it still carries."""
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml"))
    t = Trainer(recipe, tmp_path / "a", data_dir=str(kill_data), progress=False)
    for _ in range(3):
        x, y, seq_len, t.pos = t._next_batch(None)
        t.train_step(x, y, seq_len)
        t.step += 1
    t.save_training_checkpoint()
    assert not (tmp_path / "a" / "log.jsonl").exists()
    ferry.pack(tmp_path / "a", tmp_path / "out")
    assert ferry.unpack(tmp_path / "out", tmp_path / "b")["step"] == 3
    b = Trainer(recipe, tmp_path / "b", data_dir=str(kill_data), progress=False)
    assert b.load_training_checkpoint() and (b.step, b.pos) == (3, t.pos)


def test_a_piece_starts_from_the_later_of_the_carried_pack_and_the_machines_run_dir(tmp_path, kill_data):  # noqa: F811
    from zoo.tools.gpu.piece import stage

    path = write_recipe(tmp_path / "r.toml")
    t = Trainer(Recipe.load(path), tmp_path / "a", data_dir=str(kill_data), progress=False)
    for name in ("early", "late"):
        for _ in range(2):
            x, y, seq_len, t.pos = t._next_batch(None)
            t.train_step(x, y, seq_len)
            t.step += 1
        t.save_training_checkpoint()
        ferry.pack(tmp_path / "a", tmp_path / name / "tiny-alstm")
    runs = tmp_path / "runs"
    assert stage(str(path), runs, tmp_path / "none", tmp_path).started_from == "epoch 1"
    first = stage(str(path), runs, tmp_path / "early", tmp_path)   # a cold machine: the carried pack
    assert (first.started_from, first.step_before) == (f"the carried pack {tmp_path / 'early' / 'tiny-alstm'}", 2)
    later = stage(str(path), runs, tmp_path / "late", tmp_path)    # a pack ahead of the machine's run dir
    assert (later.started_from, later.step_before) == (f"the carried pack {tmp_path / 'late' / 'tiny-alstm'}", 4)
    warm = stage(str(path), runs, tmp_path / "early", tmp_path)    # the machine's run dir ahead of the pack
    assert (warm.started_from, warm.step_before) == ("this machine's run dir", 4)
