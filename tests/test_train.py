"""Training: a real (tiny) run end to end, kill -9 + resume equals uninterrupted, DDP equals one process."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CROSS_CPU_TRAINING_ABS, CROSS_CPU_TRAINING_REL, synthetic_corpus
from zoo.tools.ports import free_port
from zoo.training import Recipe, Trainer

REPO = Path(__file__).resolve().parent.parent


def _ptb_head(root: Path, lines_per_split: dict[str, int]) -> Path:
    """Training needs some text in the corpus format, not the real PTB: the committed synthetic corpus."""
    return synthetic_corpus(root, lines_per_split)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    """A small corpus in PTB's format (tests/fixtures/corpus)."""
    return _ptb_head(tmp_path_factory.mktemp("data"), {"train": 300, "valid": 40, "test": 40})


@pytest.fixture(scope="module")
def kill_data(tmp_path_factory) -> Path:
    """A third of ``tiny_data`` (about 45 steps per epoch): the kill/resume tests train each run three times over
    two epochs, and resuming needs steps on both sides of the interruption and an epoch boundary, not many."""
    return _ptb_head(tmp_path_factory.mktemp("kill-data"), {"train": 100, "valid": 20, "test": 20})


def write_recipe(path: Path, arch: str = "alstm", optimizer: str = "adam", epochs: int = 2, dropout: float = 0.1,
                 batch_size: int = 4, extra_train: str = "") -> Path:
    arch_args = {"alstm": 'hidden_size = 16\nnum_layers = 2\nadapt_size = 4\ndropout_hidden = {d}\ndropout_adapt = {d}',
                 "lstm": "hidden_size = 16\nnum_layers = 2\nweight_drop = {d}"}[arch].format(d=dropout)
    path.write_text(f"""
name = "tiny-{arch}"
dataset = "ptb"
seed = 7
[model]
architecture = "{arch}"
emb_size = 8
dropouti = {dropout}
dropouto = {dropout}
dropoute = {dropout}
[model.arch_args]
{arch_args}
[train]
epochs = {epochs}
batch_size = {batch_size}
bptt = 12
variable_bptt = true
optimizer = "{optimizer}"
lr = 0.003
clip = 5.0
weight_decay = 1e-6
eval_batch_size = 4
test_batch_size = 1
eval_bptt = 20
save_dtype = "float16"
{extra_train}
""")
    if 'mode = "sentences"' in extra_train:  # the stream-only options are refused there
        path.write_text(re.sub(r"(?m)^(bptt|variable_bptt|eval_bptt) = .*\n", "", path.read_text()))
    return path


def zoo(*args: str, env: dict | None = None, module: str = "zoo.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=600)


def hooked(*args: str) -> subprocess.CompletedProcess:
    """``zoo ARGS`` with the test hooks' flags (``tests/train_hooks.py``: crash or signal after N steps, checkpoint
    every N steps), which the ``zoo`` command itself does not have."""
    return zoo(*args, module="tests.train_hooks")


def test_training_run_writes_logs_best_release_and_eval(tmp_path, tiny_data):
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", epochs=2))
    result = Trainer(recipe, tmp_path / "run", data_dir=str(tiny_data), progress=False).run()
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    epochs = [r for r in log if "valid_ppl" in r]
    assert [r["epoch"] for r in epochs] == [1, 2]
    for key in ("train_loss", "valid_ppl", "lr", "seconds", "tokens_per_s"):
        assert all(key in r for r in epochs)
    assert all(r["device"] == result["device"] for r in epochs)  # each epoch says its machine (pieces may move)
    assert epochs[1]["valid_ppl"] < epochs[0]["valid_ppl"] * 1.5
    ev = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert ev["test"]["ppl"] == result["test"]["ppl"] and ev["epochs_trained"] == 2
    assert ev["release"]["dtype"] == "float16" and abs(ev["release"]["test_ppl_change"]) < 0.01
    assert (tmp_path / "run" / "release" / "model.safetensors").stat().st_size < \
        (tmp_path / "run" / "best" / "model.safetensors").stat().st_size
    assert min(r["valid_loss"] for r in epochs) == pytest.approx(ev["valid"]["avg_nll"], rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["alstm", "lstm"])
def test_training_run_end_to_end_on_cuda(tmp_path, tiny_data, arch, precision):
    """The same code trains on CUDA, validation, release cast and test evaluation included (the first
    GPU run here crashed at its first validation: the targets had stayed on the CPU); bf16 is CUDA autocast."""
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", arch=arch, epochs=1,
                                      extra_train=f'precision = "{precision}"'))
    result = Trainer(recipe, tmp_path / "run", data_dir=str(tiny_data), device="cuda", progress=False).run()
    assert result["device"] == torch.cuda.get_device_name()
    assert result["epochs_trained"] == 1 and result["test"]["ppl"] < 10_000
    assert abs(result["release"]["test_ppl_change"]) < 0.01


def assert_same_weights(a: Path, b: Path, atol: float = 0.0) -> dict[str, torch.Tensor]:
    """The two runs' last checkpoints hold bit-identical model weights (``atol``: only where one of them continues
    a checkpoint another machine computed); returns ``b``'s checkpoint tensors."""
    wa = load_file(str(a / "checkpoint" / "state.safetensors"))
    wb = load_file(str(b / "checkpoint" / "state.safetensors"))
    for k in wa:
        if k.startswith("model."):
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=k)
    return wb


def kill_resume_and_compare(tmp_path: Path, base: list[str], every: int = 3, after: int = 8, signal_name: str = "KILL",
                            extra: tuple[str, ...] = ()) -> tuple[dict, subprocess.CompletedProcess]:
    """Train ``base`` uninterrupted into ``a``; into ``b`` with a checkpoint every ``every`` steps (0: none) and the
    signal ``signal_name`` sent after ``after`` steps, then ``--resume``: the final weights must be identical.
    Returns ``b``'s checkpoint tensors and the interrupted process."""
    ok = zoo(*base, "--run-dir", str(tmp_path / "a"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    crashed = hooked(*base, "--run-dir", str(tmp_path / "b"), "--checkpoint-every-steps", str(every),
                  "--crash-after-steps", str(after), "--crash-signal", signal_name, *extra)
    expected = {"KILL": -9, "TERM": 128 + 15, "INT": 128 + 2}[signal_name]
    assert crashed.returncode == expected, crashed.stderr[-2000:]
    assert (tmp_path / "b" / "checkpoint" / "meta.json").is_file()
    resumed = zoo(*base, "--run-dir", str(tmp_path / "b"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return assert_same_weights(tmp_path / "a", tmp_path / "b"), crashed


@pytest.mark.parametrize("signal_name", ["TERM", "INT"])
def test_sigterm_or_ctrl_c_checkpoints_and_resume_loses_nothing(tmp_path, kill_data, signal_name):
    """No periodic checkpoint: the one the signal handler writes mid-epoch is all the resume has. The interrupted
    run was itself started with --resume and nothing to resume, which it says."""
    recipe = write_recipe(tmp_path / "r.toml", epochs=2)
    base = ["train", str(recipe), "--data-dir", str(kill_data), "--device", "cpu"]
    _, stopped = kill_resume_and_compare(tmp_path, base, every=0, after=7, signal_name=signal_name,
                                         extra=("--resume",))
    assert "nothing to resume" in stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1].startswith(f"zoo train: stopped by SIG{signal_name}")
    assert "--resume" in stopped.stderr.strip().splitlines()[-1]
    meta_log = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert {"event": "interrupted", "step": 7}.items() <= next(r for r in meta_log if r.get("event") ==
                                                              "interrupted").items()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kill_and_resume_matches_uninterrupted(tmp_path, kill_data, precision):
    recipe = write_recipe(tmp_path / "r.toml", epochs=2)
    base = ["train", str(recipe), "--data-dir", str(kill_data), "--device", "cpu", "--precision", precision]
    kill_resume_and_compare(tmp_path, base)
    la = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines() if '"valid_ppl"' in x]
    lb = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines() if '"valid_ppl"' in x]
    assert [r["epoch"] for r in lb] == [1, 2]
    assert [r["valid_ppl"] for r in la] == [r["valid_ppl"] for r in lb]
    for run in ("a", "b"):
        ev = json.loads((tmp_path / run / "eval.json").read_text())
        assert ev["recipe"]["train"]["precision"] == precision


def _steps(t: Trainer, n: int) -> list[float]:
    """``n`` training steps through the epoch as ``Trainer._run`` takes them (variable BPTT, carried state)."""
    losses = []
    for _ in range(n):
        x, y, seq_len, t.pos = t._next_batch(None)
        losses.append(t.train_step(x, y, seq_len))
    return losses


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["alstm", "lstm"])
def test_captured_cuda_step_matches_the_eager_step(tmp_path, tiny_data, arch, precision):
    """CUDA graphs replay the eager update: with dropout off (the graphs' masks are drawn from other RNG offsets),
    30 variable-length steps give the same losses and weights, and each length is captured once."""
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", arch=arch, dropout=0.0,
                                      extra_train=f'precision = "{precision}"'))
    runs = {}
    for graphs in (False, True):
        t = Trainer(recipe, tmp_path / f"g{graphs}", data_dir=str(tiny_data), device="cuda", progress=False,
                    cuda_graphs=graphs)
        runs[graphs] = (_steps(t, 30), torch.cat([p.detach().flatten() for p in t.model.parameters()]), t)
    (eager, w_eager, _), (captured, w_captured, t) = runs[False], runs[True]
    tol = 1e-4 if precision == "fp32" else 2e-2
    assert captured == pytest.approx(eager, rel=tol)
    assert float((w_captured - w_eager).abs().max()) < tol
    lengths = len(t._graphs.graphs)
    assert t._graphs.captures == lengths < 30 - t._graphs.warmup   # lengths recur: graphs are replayed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_captured_cuda_step_draws_fresh_dropout_and_resumes(tmp_path, tiny_data):
    """With dropout on, replays of one graph draw new masks (same input, different losses), and a run with CUDA
    graphs resumes its own checkpoint and an eager run's (Adam's step counters move between CPU and GPU)."""
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", dropout=0.3))
    recipe.train.variable_bptt = False
    t = Trainer(recipe, tmp_path / "a", data_dir=str(tiny_data), device="cuda", progress=False, cuda_graphs=True)
    _steps(t, 4)
    x, y = t.train_data[:12].t(), t.train_data[1:13].t()
    before = [p.detach().clone() for p in t.model.parameters()]
    t.state = None
    first = t.train_step(x, y, 12)
    for p, b in zip(t.model.parameters(), before, strict=True):
        p.data.copy_(b)
    t.state = None
    assert t.train_step(x, y, 12) != first
    for src, graphs in ((False, True), (True, False)):
        a = Trainer(recipe, tmp_path / f"r{src}", data_dir=str(tiny_data), device="cuda", progress=False,
                    cuda_graphs=src)
        _steps(a, 5)
        a.save_training_checkpoint()
        b = Trainer(recipe, tmp_path / f"r{src}", data_dir=str(tiny_data), device="cuda", progress=False,
                    cuda_graphs=graphs)
        assert b.load_training_checkpoint()
        assert all(math.isfinite(v) for v in _steps(b, 5))
        steps = [st["step"] for st in b.optimizer.state.values()]
        assert all(float(s) == 10 and s.device.type == ("cuda" if graphs else "cpu") for s in steps)


def test_cuda_graphs_without_a_gpu_is_a_clear_error(tmp_path, tiny_data):
    bad = zoo("train", str(write_recipe(tmp_path / "r.toml")), "--device", "cpu", "--cuda-graphs",
              "--run-dir", str(tmp_path / "run"), "--data-dir", str(tiny_data))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "zoo: error: cuda_graphs needs a CUDA device (this run is on cpu)"]
    assert not (tmp_path / "run" / "log.jsonl").exists()


def test_bf16_training_step_is_mixed_precision(tmp_path, tiny_data):
    """A bf16 step: float32 weights, gradients and optimiser state; a loss and a gradient close to (not equal to)
    fp32's. (Gradients are compared, not later losses: Adam with beta1 = 0 normalises a step to about lr * sign,
    which hides a 0.2% gradient difference from the next losses of a tiny model.)"""
    losses, grads = {}, {}
    for precision in ("fp32", "bf16"):
        recipe = Recipe.load(write_recipe(tmp_path / f"{precision}.toml", extra_train=f'precision = "{precision}"'))
        t = Trainer(recipe, tmp_path / precision, data_dir=str(tiny_data), progress=False)
        x, y = t.train_data[:12].t(), t.train_data[1:13].t()
        losses[precision] = t.train_step(x, y, 12)
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in t.model.parameters())
        assert all(v.dtype == torch.float32 for st in t.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.numel() > 1)
        grads[precision] = torch.cat([p.grad.flatten() for p in t.model.parameters()])
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.01)
    diff = float((grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm())
    assert 0 < diff < 0.03, f"bf16 gradient {diff:.3%} from fp32"


def test_unknown_precision_is_a_clear_error(tmp_path, tiny_data):
    with pytest.raises(ValueError, match="unknown precision 'fp16'.*fp32, bf16"):
        Recipe.load(write_recipe(tmp_path / "r.toml", extra_train='precision = "fp16"'))
    bad = zoo("train", str(write_recipe(tmp_path / "ok.toml")), "--precision", "fp16")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def torchrun_train(*args: str, module: str = "zoo.cli") -> subprocess.CompletedProcess:
    """``zoo train ARGS`` in 2 gloo processes under torchrun, one thread each; the rendezvous port is a free one
    (fixed numbers made the tests flaky when an earlier run's port was still in TIME_WAIT). ``module``
    ``tests.train_hooks`` takes the test hooks' flags too."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", module, "train", *args, "--device", "cpu"],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_torchrun_two_processes_match_one_process(tmp_path, tiny_data):
    """DDP over 2 gloo processes on the same global batch gives the single-process weights (no dropout)."""
    recipe = write_recipe(tmp_path / "r.toml", arch="lstm", optimizer="sgd", epochs=1, dropout=0.0,
                          extra_train="variable_bptt = false\nlr_decay = 1.0").read_text()
    recipe = recipe.replace("variable_bptt = true\n", "").replace("lr = 0.003", "lr = 1.0")
    (tmp_path / "r2.toml").write_text(recipe)
    single = zoo("train", str(tmp_path / "r2.toml"), "--data-dir", str(tiny_data), "--device", "cpu",
                 "--run-dir", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr[-2000:]
    res = torchrun_train(str(tmp_path / "r2.toml"), "--data-dir", str(tiny_data), "--run-dir", str(tmp_path / "two"))
    assert res.returncode == 0, res.stderr[-3000:]
    w1 = load_file(str(tmp_path / "one" / "checkpoint" / "state.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoint" / "state.safetensors"))
    for k in w1:
        if k.startswith("model."):
            torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-5, msg=k)


def test_torchrun_stop_and_resume_restores_every_ranks_carried_state(tmp_path, kill_data):
    """Under torchrun each rank trains its own columns of the batch and carries its own hidden state. A SIGTERM
    to one rank mid-epoch (the test hook signals the last rank only) stops both ranks at the same step (they agree
    after every step), rank 0 writes the stop checkpoint before any rank exits (no periodic checkpoint here: step
    8 is the stop's), the checkpoint keeps each rank's carried state, and the resumed run ends with exactly the
    uninterrupted run's weights (before, every rank resumed from rank 0's state, and the weights differed).
    Resuming in another number of processes is refused."""
    recipe = write_recipe(tmp_path / "r.toml", arch="lstm", optimizer="sgd", epochs=1, dropout=0.0,
                          extra_train="variable_bptt = false\nlr_decay = 1.0").read_text()
    (tmp_path / "r2.toml").write_text(recipe.replace("variable_bptt = true\n", "").replace("lr = 0.003", "lr = 1.0"))

    def torchrun(run: str, *extra: str) -> subprocess.CompletedProcess:
        return torchrun_train(str(tmp_path / "r2.toml"), "--data-dir", str(kill_data), "--run-dir", str(tmp_path / run),
                              *extra, module="tests.train_hooks")

    whole = torchrun("a")
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped = torchrun("b", "--crash-after-steps", "8", "--crash-signal", "TERM")
    assert stopped.returncode != 0 and "stopped by SIGTERM" in stopped.stderr, stopped.stderr[-3000:]
    meta = json.loads((tmp_path / "b" / "checkpoint" / "meta.json").read_text())
    saved = load_file(str(tmp_path / "b" / "checkpoint" / "state.safetensors"))
    assert meta["step"] == 8 and meta["world_size"] == 2
    log = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [(r["signal"], r["step"]) for r in log if r.get("event") == "interrupted"] == [("SIGTERM", 8)]
    assert any(k.startswith("carry.rank1.") for k in saved)
    assert not torch.equal(saved["carry.0"], saved["carry.rank1.0"])  # the ranks' states are their own
    alone = zoo("train", str(tmp_path / "r2.toml"), "--data-dir", str(kill_data), "--device", "cpu",
                "--run-dir", str(tmp_path / "b"), "--resume")
    assert alone.returncode == 2 and "written by 2 process(es)" in alone.stderr and \
        "torchrun --nproc-per-node 2" in alone.stderr and len(alone.stderr.strip().splitlines()) == 1, alone.stderr
    resumed = torchrun("b", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(tmp_path / "a", tmp_path / "b")


def test_torchrun_with_dropout_keeps_replicas_in_sync_and_ranks_draw_their_own_masks(tmp_path, tiny_data):
    """DDP with dropout on (the way real runs train): each rank draws its own masks (seeded from (seed, rank)),
    the replicas still end equal (checked by the trainer, recorded in eval.json), and the process group is torn
    down (the processes exit 0). With dropout the result is not the single-process one, so it is not compared."""
    from zoo.training import rank_seed

    assert len({rank_seed(1, r) for r in (1, 2, 3)}) == 3 and rank_seed(1, 1) != rank_seed(1, 1, step=10)
    recipe = write_recipe(tmp_path / "r.toml", arch="alstm", epochs=1, dropout=0.3)
    res = torchrun_train(str(recipe), "--data-dir", str(tiny_data), "--run-dir", str(tmp_path / "two"))
    assert res.returncode == 0, res.stderr[-3000:]
    ev = json.loads((tmp_path / "two" / "eval.json").read_text())
    assert ev["world_size"] == 2 and ev["ranks_in_sync"] is True and math.isfinite(ev["test"]["ppl"])


def test_nonmonotone_trigger():
    from zoo.training import nonmonotone_trigger

    hist = [5.0, 4.8, 4.7, 4.75, 4.76, 4.77, 4.78]
    assert not nonmonotone_trigger(hist[:5], 4.9, 5)  # not enough history yet
    assert nonmonotone_trigger(hist, 4.85, 5)  # worse than 4.8, the best of the epochs before the last 5
    assert not nonmonotone_trigger(hist, 4.75, 5)  # better than 4.8: keep SGD
    assert nonmonotone_trigger([5.0, 4.7, 4.8, 4.8, 4.8, 4.8, 4.8], 4.75, 5)
    assert not nonmonotone_trigger([5.0, 4.7, 4.8, 4.8, 4.8, 4.8, 4.8], 4.65, 5)


@pytest.mark.parametrize("train_kw,expected", [
    ({"optimizer": "sgd", "lr": 1.0, "lr_decay": 0.5, "lr_decay_start": 5}, [1, 1, 1, 1, 0.5, 0.25, 0.125]),
    ({"optimizer": "adam", "lr": 3e-3, "cut_steps": [2, 4], "cut_rate": 10.0}, [3e-3, 3e-3, 3e-4, 3e-4, 3e-5, 3e-5]),
])
def test_lr_schedules(train_kw, expected):
    """Zaremba's per-epoch halving after epoch 4; the aLSTM reference's lr cuts after given epochs."""
    from zoo.training import TrainConfig, Trainer

    t = Trainer.__new__(Trainer)
    t.cfg = TrainConfig(**train_kw)
    got = []
    for epoch in range(1, len(expected) + 1):
        t.epoch, t.lr = epoch, t.cfg.lr
        t._lr_for_epoch()
        got.append(t.lr)
    assert got == pytest.approx(expected)


def test_several_recipes_train_in_parallel_with_split_threads(tmp_path, tiny_data):
    """`zoo train A B --jobs 2`: both runs finish into runs dirs, each child with one intra-op thread."""
    a = write_recipe(tmp_path / "a.toml", arch="alstm", epochs=1)
    b = write_recipe(tmp_path / "b.toml", arch="lstm", epochs=1)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-m", "zoo.cli", "train", str(a), str(b), "--jobs", "2", "--run-dir",
                           str(tmp_path / "runs"), "--data-dir", str(tiny_data)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("tiny-alstm", "tiny-lstm"):
        ev = json.loads((tmp_path / "runs" / name / "eval.json").read_text())
        assert ev["epochs_trained"] == 1
        assert ev["device"].endswith(f"{max(1, (os.cpu_count() or 1) // 2)} threads)")


def test_sigterm_to_parallel_training_stops_every_run_with_a_checkpoint(tmp_path, tiny_data):
    """`zoo train A B --jobs 2` passes SIGTERM on: each child checkpoints and stops; nothing new starts."""
    import signal
    import time

    recipes = [str(write_recipe(tmp_path / f"{arch}.toml", arch=arch, epochs=50)) for arch in ("alstm", "lstm")]
    runs = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "zoo.cli", "train", *recipes, "--jobs", "2", "--run-dir",
                             str(runs), "--data-dir", str(tiny_data)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        deadline = time.time() + 300
        while not all((runs / n / "log.jsonl").is_file() for n in ("tiny-alstm", "tiny-lstm")):
            assert proc.poll() is None and time.time() < deadline, "the runs did not get going"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "--resume" in out.strip().splitlines()[-1]
    for name in ("tiny-alstm", "tiny-lstm"):
        log = [json.loads(x) for x in (runs / name / "log.jsonl").read_text().splitlines()]
        assert any(r.get("event") == "interrupted" for r in log), name
        assert (runs / name / "checkpoint" / "meta.json").is_file()


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_logging_with_the_jsonl_log_as_record(tmp_path, kill_data):
    """`zoo train --log-to tensorboard`: step-level loss and lr every N steps, epoch validation equal to log.jsonl;
    after a SIGTERM and --resume the curves continue without a step written twice."""
    recipe = write_recipe(tmp_path / "r.toml", epochs=2)
    base = ["train", str(recipe), "--data-dir", str(kill_data), "--device", "cpu", "--log-to", "tensorboard",
            "--log-every-steps", "5", "--run-dir", str(tmp_path / "run")]
    stopped = hooked(*base, "--crash-after-steps", "12", "--crash-signal", "TERM")
    assert stopped.returncode == 128 + 15, stopped.stderr[-2000:]
    done = zoo(*base, "--resume")
    assert done.returncode == 0, done.stderr[-2000:]
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    epochs = [r for r in log if "valid_ppl" in r]
    tb = _scalars(tmp_path / "run" / "tensorboard")
    assert [v for _, v in tb["epoch/valid_ppl"]] == pytest.approx([r["valid_ppl"] for r in epochs], rel=1e-6)
    steps = [s for s, _ in tb["train/loss"]]
    assert steps == sorted(set(steps)) and steps[0] == 5 and all(s % 5 == 0 for s in steps)  # none twice
    assert len(steps) >= 4 and all(math.isfinite(v) and v > 0 for _, v in tb["train/loss"])
    assert all(v == pytest.approx(0.003) for _, v in tb["train/lr"])  # stored as float32


def test_unknown_log_target_is_a_clear_error(tmp_path, tiny_data):
    proc = zoo("train", str(write_recipe(tmp_path / "r.toml")), "--log-to", "wandb", "--data-dir", str(tiny_data))
    assert proc.returncode == 2 and "invalid choice: 'wandb'" in proc.stderr


def test_a_plain_train_never_replaces_an_earlier_run(tmp_path, kill_data):
    """`zoo train` into a folder holding a run would have deleted its log and, ten minutes later, its checkpoint
    (a missed --resume on a six-hour run): refused with one line, exit 2, nothing touched. --restart starts over
    with the old products removed; --resume with --restart is a usage error; several recipes are checked before
    any starts."""
    recipe = write_recipe(tmp_path / "r.toml", epochs=1)
    run = tmp_path / "tiny-alstm"   # the recipe's name: where the several-recipe call below puts it too
    base = ["train", str(recipe), "--data-dir", str(kill_data), "--device", "cpu", "--run-dir", str(run)]
    assert zoo(*base).returncode == 0
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    refused = zoo(*base)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "already holds a run (checkpoint, best, release, eval.json, log.jsonl)" in refused.stderr
    assert "--resume" in refused.stderr and "--restart" in refused.stderr
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
    both = zoo(*base, "--resume", "--restart")
    assert both.returncode == 2 and "exclude each other" in both.stderr
    (run / "notes.txt").write_text("mine")   # not a run product: a restart leaves it alone
    (run / "best" / "stale").write_text("x")
    restarted = hooked(*base, "--restart", "--crash-after-steps", "3", "--crash-signal", "TERM")
    assert restarted.returncode == 128 + 15, restarted.stderr[-2000:]
    assert not (run / "eval.json").exists() and not (run / "best").exists()
    assert (run / "notes.txt").read_text() == "mine"
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert not any("valid_ppl" in r for r in log)   # the old run's epoch is gone with its log
    two = subprocess.run([sys.executable, "-m", "zoo.cli", "train", str(recipe), str(write_recipe(
        tmp_path / "r2.toml", arch="lstm")), "--jobs", "2", "--run-dir", str(tmp_path), "--data-dir", str(kill_data)],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert two.returncode == 2 and "tiny-alstm already holds a run" in two.stderr, two.stderr
    assert not (tmp_path / "tiny-lstm").exists()   # refused before anything started


def test_a_sweep_prefix_continued_to_the_full_budget_equals_the_full_run(tmp_path, kill_data):
    """The long tiers sweep with prefixes: `zoo train NAME --epochs N` trains the full schedule's first N epochs
    and evaluates; if the prefix wins, `--epochs FULL --resume` continues it. That must be the same run as one
    trained to FULL at once (same epochs, same numbers), with the prefix's evaluation not counted as an epoch."""
    recipe = write_recipe(tmp_path / "r.toml", epochs=2)
    base = ["train", str(recipe), "--data-dir", str(kill_data), "--device", "cpu"]
    assert zoo(*base, "--run-dir", str(tmp_path / "full")).returncode == 0
    prefix = zoo(*base, "--run-dir", str(tmp_path / "prefix"), "--epochs", "1")
    assert prefix.returncode == 0, prefix.stderr[-2000:]
    assert json.loads((tmp_path / "prefix" / "eval.json").read_text())["epochs_trained"] == 1
    more = zoo(*base, "--run-dir", str(tmp_path / "prefix"), "--epochs", "2", "--resume")
    assert more.returncode == 0, more.stderr[-2000:]

    def epochs(run: str) -> list[tuple[int, float, float]]:
        return [(r["epoch"], r["train_loss"], r["valid_ppl"]) for r in map(json.loads, (
            tmp_path / run / "log.jsonl").read_text().splitlines()) if "valid_ppl" in r]

    assert epochs("prefix") == epochs("full") and len(epochs("full")) == 2
    evs = [json.loads((tmp_path / run / "eval.json").read_text()) for run in ("full", "prefix")]
    assert evs[1]["epochs_trained"] == 2 and evs[1]["test"]["ppl"] == evs[0]["test"]["ppl"]


def test_evaluation_after_fused_adam_steps_reads_the_new_weights(tmp_path, kill_data):
    """On the CPU the trainer's Adam is fused, and the fused kernel writes the weights without counting an in-place
    change, which the compiled inference loop's weight cache keys on: without the trainer bumping the counters, a
    no-grad forward after a training step ran on the weights cached at the previous evaluation."""
    import copy

    from zoo.models import _compiled

    if _compiled.get("alstm_infer") is None:
        pytest.skip("the compiled aLSTM inference loop is not built here")
    t = Trainer(Recipe.load(write_recipe(tmp_path / "r.toml", arch="alstm")), tmp_path / "run",
                data_dir=str(kill_data), progress=False, device="cpu")
    assert t.optimizer.param_groups[0]["fused"]
    x, y = t.train_data[:12].t(), t.train_data[1:13].t()
    with torch.no_grad():
        before = t.model.eval()(x)[0]                  # fills the cache
    t.model.train()
    t.train_step(x, y, 12)
    with torch.no_grad():
        got = t.model.eval()(x)[0]
        fresh = copy.deepcopy(t.model)(x)[0]           # new storage: the cache cannot match
    assert not torch.equal(got, before), "the training step changed nothing"
    torch.testing.assert_close(got, fresh, rtol=0, atol=0)


def test_a_checkpoint_of_an_unfused_adam_resumes_fused(tmp_path, kill_data):
    """Checkpoints written before Adam was fused on the CPU carry ``fused: None`` in their param groups, which
    ``load_state_dict`` would put back: the resumed run is fused again, and trains."""
    recipe = write_recipe(tmp_path / "r.toml", arch="lstm")
    old = Trainer(Recipe.load(recipe), tmp_path / "run", data_dir=str(kill_data), progress=False, device="cpu")
    old._fused_adam = False
    old.optimizer = old._make_optimizer("adam")
    x, y = old.train_data[:12].t(), old.train_data[1:13].t()
    old.train_step(x, y, 12)
    old.save_training_checkpoint()
    new = Trainer(Recipe.load(recipe), tmp_path / "run", data_dir=str(kill_data), progress=False, device="cpu")
    assert new.load_training_checkpoint()
    assert all(g["fused"] for g in new.optimizer.param_groups)
    assert torch.isfinite(torch.tensor(new.train_step(x, y, 12)))


@pytest.mark.parametrize(("line", "message"), [
    ('save_dtype = "bogus"', "save_dtype must be one of float32, float16, bfloat16"),
    ("clip = -0.25", "clip must be a number >= 0"),
    ("bptt = 0", "bptt must be an integer >= 1"),
    ('epochs = "10"', "epochs must be an integer >= 1"),
    ("cut_steps = 3", "cut_steps must be a list"),
    ("batch_size = 20.5", "batch_size must be an integer >= 1"),
    ("lr = -1.0", "lr must be a number > 0"),
    ("test_batch_size = 0", "test_batch_size must be an integer >= 1"),
    ("adam_betas = [0.9, 1.0]", "adam_betas[] must be below 1"),
    ("variable_bptt = 1", "variable_bptt must be true or false"),
])
def test_recipe_values_are_checked_before_anything_trains(tmp_path, line, message):
    """A value out of its type or range is a one-line ConfigError at load: some used to fail only after the
    whole run (save_dtype, test_batch_size), others to train silently wrong (a negative clip reverses the
    gradient)."""
    from zoo.errors import ConfigError

    text = write_recipe(tmp_path / "r.toml").read_text()
    key = line.split(" =")[0]
    text = "\n".join(x for x in text.splitlines() if not x.startswith(f"{key} ="))
    text = text.replace("[train]", f"[train]\n{line}")
    (tmp_path / "r.toml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Recipe.load(tmp_path / "r.toml")


def test_a_recipe_name_is_a_plain_name_and_unknown_model_keys_are_config_errors(tmp_path, tiny_data):
    from zoo.errors import ConfigError

    path = write_recipe(tmp_path / "r.toml")
    path.write_text(path.read_text().replace('name = "tiny-alstm"', 'name = "../../escape"'))
    with pytest.raises(ConfigError, match="name must be a plain name"):
        Recipe.load(path)
    path = write_recipe(tmp_path / "r.toml")
    path.write_text(path.read_text().replace("emb_size = 8", "emb_size = 8\nembedding_size = 8"))
    with pytest.raises(ConfigError, match=r"\[model\]: .*embedding_size"):
        Trainer(Recipe.load(path), tmp_path / "run", data_dir=str(tiny_data), progress=False)


def test_resume_refuses_a_changed_recipe_but_takes_a_new_budget(tmp_path, kill_data):
    recipe = write_recipe(tmp_path / "r.toml", epochs=1)
    run = tmp_path / "run"
    base = ["train", str(recipe), "--data-dir", str(kill_data), "--device", "cpu", "--run-dir", str(run)]
    assert zoo(*base).returncode == 0
    recipe.write_text(recipe.read_text().replace("lr = 0.003", "lr = 0.01").replace("clip = 5.0", "clip = 1.0"))
    changed = zoo(*base, "--resume", "--epochs", "2")
    assert changed.returncode == 2 and len(changed.stderr.strip().splitlines()) == 1, changed.stderr
    assert "the recipe changed since" in changed.stderr and "train.clip, train.lr" in changed.stderr
    recipe.write_text(recipe.read_text().replace("lr = 0.01", "lr = 0.003").replace("clip = 1.0", "clip = 5.0"))
    stopped = hooked(*base, "--resume", "--epochs", "2", "--crash-after-steps", "3", "--crash-signal", "TERM")
    assert stopped.returncode == 128 + 15, stopped.stderr[-2000:]
    assert not (run / "eval.json").exists()          # a prefix being continued is not finished (bundle, tiers)
    more = zoo(*base, "--resume", "--epochs", "2")   # the budget may change: a sweep prefix continued
    assert more.returncode == 0, more.stderr[-2000:]
    again = zoo(*base, "--resume", "--epochs", "2")  # finished: its results stand, test is not scored again
    assert again.returncode == 0 and json.loads(again.stdout)["epochs"] == 2
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log if "valid_ppl" in r] == [1, 2]
    assert sum(r.get("event") == "finished" for r in log) == 2  # the prefix's and the full run's, not a third
    assert sum(r.get("event") == "continued" for r in log) == 1 and (run / "eval.json").is_file()


def test_resume_drops_epoch_lines_logged_after_its_checkpoint(tmp_path, kill_data):
    """A crash between an epoch's log line and its checkpoint (or a line cut short by a full disk): the resumed
    run logs that epoch once, from its own replay, and the log stays valid JSON lines."""
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", epochs=1))
    run = tmp_path / "run"
    Trainer(recipe, run, data_dir=str(kill_data), progress=False).run()
    with open(run / "log.jsonl", "a") as f:   # as if epoch 2 had been logged, then the process died
        f.write(json.dumps({"epoch": 2, "train_loss": 9.0, "valid_loss": 9.0, "valid_ppl": 8103.1}) + "\n")
        f.write('{"epoch": 3, "train_lo')
    recipe.train.epochs = 2
    Trainer(recipe, run, data_dir=str(kill_data), progress=False).run(resume=True)
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    epochs = [r for r in log if "valid_ppl" in r]
    assert [r["epoch"] for r in epochs] == [1, 2] and epochs[1]["valid_ppl"] != 8103.1


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, kill_data):
    recipe = write_recipe(tmp_path / "r.toml", optimizer="sgd", epochs=3, extra_train="")
    recipe.write_text(recipe.read_text().replace("lr = 0.003", "lr = 1e30").replace("clip = 5.0", "clip = 0.0"))
    run = tmp_path / "run"
    # a checkpoint after every step, so that one exists from before the divergence
    proc = hooked("train", str(recipe), "--data-dir", str(kill_data), "--device", "cpu", "--run-dir", str(run),
                  "--checkpoint-every-steps", "1")
    last = proc.stderr.strip().splitlines()[-1]   # (above it: the progress bar)
    assert proc.returncode == 2 and last.startswith("zoo: error: training diverged at epoch 1"), proc.stderr[-2000:]
    assert "--restart" in last and "Traceback" not in proc.stderr
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert log[-1]["event"] == "diverged" and not any("valid_ppl" in r for r in log)
    meta = json.loads((run / "checkpoint" / "meta.json").read_text())   # the last good one is kept ...
    assert 1 <= meta["step"] < log[-1]["step"], (meta, log[-1])         # ... from before the diverged step
    state = load_file(str(run / "checkpoint" / "state.safetensors"))
    assert all(torch.isfinite(t).all() for k, t in state.items() if k.startswith("model."))


def test_one_process_per_run_dir_and_no_silent_restart_over_results(tmp_path, kill_data):
    import fcntl

    from zoo.errors import UsageError

    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", epochs=1))
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UsageError, match="is being trained by another process"):
            Trainer(recipe, run, data_dir=str(kill_data), progress=False).run()
    first = Trainer(recipe, run, data_dir=str(kill_data), progress=False)
    first.run()
    # the lock lasts as long as the run, not the Trainer object: the same process may go on with the run dir
    assert Trainer(recipe, run, data_dir=str(kill_data), progress=False).run(resume=True)["epochs_trained"] == 1
    with open(run / ".lock", "a+") as held:   # --restart never clears a run another process is training
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        refused = zoo("train", str(tmp_path / "r.toml"), "--data-dir", str(kill_data), "--device", "cpu",
                      "--run-dir", str(run), "--restart")
        assert refused.returncode == 2 and "is being trained by another process" in refused.stderr
        assert (run / "eval.json").is_file() and (run / "checkpoint").is_dir()
    del first
    import shutil

    shutil.rmtree(run / "checkpoint")   # results without a checkpoint: --resume would have started over
    with pytest.raises(UsageError, match="holds an earlier run's results: start over with --restart"):
        Trainer(recipe, run, data_dir=str(kill_data), progress=False).run(resume=True)
    assert (run / "eval.json").is_file()


def test_a_checkpoint_old_left_by_a_crash_does_not_block_the_next_save(tmp_path, kill_data):
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", epochs=1))
    run = tmp_path / "run"
    trainer = Trainer(recipe, run, data_dir=str(kill_data), progress=False)
    run.mkdir()
    trainer.save_training_checkpoint()
    (run / "checkpoint.old").mkdir()
    (run / "checkpoint.old" / "state.safetensors").write_bytes(b"half-removed")
    trainer.save_training_checkpoint()
    assert (run / "checkpoint" / "meta.json").is_file() and not (run / "checkpoint.old").exists()


def test_an_epoch_line_without_a_finite_train_ppl_is_logged_and_printed(tmp_path, kill_data):
    """A mean training loss past float64's exp (over ~709 nats) has no perplexity: the line goes without it."""
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", epochs=1))
    trainer = Trainer(recipe, tmp_path / "run", data_dir=str(kill_data), progress=True)
    (tmp_path / "run").mkdir()
    trainer._log_line({"epoch": 1, "train_loss": 800.0, "train_ppl": None, "valid_ppl": 5.0, "lr": 1.0,
                       "tokens_per_s": 10.0})
    assert "train_ppl" not in json.loads((tmp_path / "run" / "log.jsonl").read_text())


PRE_SPLIT = REPO / "tests" / "fixtures" / "pre-split-run"


def test_a_checkpoint_written_before_the_training_split_resumes_exactly(tmp_path):
    """A run stopped mid-epoch by the code before ``zoo/train.py`` became ``zoo.training`` (commit 0d0c6a6,
    ``tests/fixtures/make_pre_split_run.py``) resumes where it stopped (epoch, data position, step), its log goes on
    after the old lines, and it ends with the weights and epoch records of an uninterrupted run of today's code,
    and with the old code's uninterrupted epoch records. The fixture's numbers were computed on the AMD EPYC machine
    that wrote them (bit for bit the same there): every comparison with them is to ``CROSS_CPU_TRAINING_REL`` /
    ``_ABS`` (``tests/conftest.py``: another CPU's BLAS kernels round differently and training carries that on; a
    resume bug moves these numbers a hundred times further)."""
    import shutil

    expected = json.loads((PRE_SPLIT / "expected.json").read_text())
    meta = json.loads((PRE_SPLIT / "run" / "checkpoint" / "meta.json").read_text())
    assert (meta["epoch"], meta["step"]) == (2, expected["stop_step"]) and 0 < meta["pos"]  # (mid-epoch 2)
    shutil.copytree(PRE_SPLIT / "run", tmp_path / "run")
    old_log = (tmp_path / "run" / "log.jsonl").read_bytes()
    recipe, data = Recipe.load(PRE_SPLIT / "recipe.toml"), str(PRE_SPLIT / "data")
    resumed = Trainer(recipe, tmp_path / "run", data_dir=data, device="cpu", progress=False).run(resume=True)
    whole = Trainer(recipe, tmp_path / "whole", data_dir=data, device="cpu", progress=False).run()
    log_bytes = (tmp_path / "run" / "log.jsonl").read_bytes()
    assert log_bytes.startswith(old_log)
    log = [json.loads(x) for x in log_bytes.splitlines()]
    assert {"event": "resumed", "epoch": 2, "pos": meta["pos"], "step": expected["stop_step"]}.items() <= \
        next(r for r in log if r.get("event") == "resumed").items()
    epochs = [r for r in log if "valid_ppl" in r]
    assert [r["epoch"] for r in epochs] == [1, 2] and all(math.isfinite(r["train_loss"]) for r in epochs)
    final = json.loads((tmp_path / "run" / "checkpoint" / "meta.json").read_text())
    assert final["step"] == expected["final_step"] > expected["stop_step"]
    assert_same_weights(tmp_path / "whole", tmp_path / "run", atol=CROSS_CPU_TRAINING_ABS)
    whole_epochs = [r for r in map(json.loads, (tmp_path / "whole" / "log.jsonl").read_text().splitlines())
                    if "valid_ppl" in r]
    keys = ("train_loss", "valid_loss", "valid_ppl")
    for reference in (whole_epochs, expected["epochs"]):  # today's uninterrupted run, the old code's
        assert [r["epoch"] for r in reference] == [1, 2]
        for got, ref in zip(epochs, reference, strict=True):
            assert [got[k] for k in keys] == pytest.approx([ref[k] for k in keys], rel=CROSS_CPU_TRAINING_REL, abs=0)
    assert resumed["test"]["ppl"] == pytest.approx(whole["test"]["ppl"], rel=CROSS_CPU_TRAINING_REL, abs=0)
    assert resumed["epochs_trained"] == 2


def test_callbacks_see_every_step_and_may_ask_for_a_checkpoint(tmp_path, kill_data):
    """The loop's one hook (the tests' crash and checkpoint-every hooks are callbacks: ``tests/train_hooks.py``):
    each step's :class:`StepEnd` in order, with the run's and this process's step counts, and a checkpoint asked for
    at a step is written at that step (a resumed process counts its own steps from 1 again)."""
    from zoo.training import StepEnd

    class Record:
        def __init__(self) -> None:
            self.events: list[StepEnd] = []
            self.meta_at_4: dict = {}

        def on_step_end(self, trainer: Trainer, event: StepEnd) -> None:
            assert trainer.step == event.step and math.isfinite(event.loss)
            self.events.append(event)
            event.checkpoint = event.step == 3
            if event.step == 4:
                self.meta_at_4 = json.loads((trainer.ckpt_dir / "meta.json").read_text())

    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", epochs=1))
    first = Record()
    Trainer(recipe, tmp_path / "run", data_dir=str(kill_data), progress=False, callbacks=[first]).run()
    n = len(first.events)
    assert [(e.step, e.steps_this_process) for e in first.events] == [(s, s) for s in range(1, n + 1)]
    assert first.meta_at_4["step"] == 3 and n > 4
    recipe.train.epochs = 2
    second = Record()
    Trainer(recipe, tmp_path / "run", data_dir=str(kill_data), progress=False, callbacks=[second]).run(resume=True)
    assert [(e.step, e.steps_this_process) for e in second.events][:2] == [(n + 1, 1), (n + 2, 2)]
