"""The HyperLSTM's CUDA-graph training step (zoo/training/captured_step.py) against its eager step.

The captured step is :meth:`zoo.training.Trainer.update` itself, replayed from a graph per BPTT length; nothing in it
is architecture-specific, so the HyperLSTM needs no step of its own, only a forward and backward without host
synchronisation (``zoo/models/_hyper_fast.py``: its time loop is Python, its masks are drawn on the device, no
value is read back). These tests check that on a GPU; without one they are skipped (CUDA graphs are CUDA-only:
``tests/test_train.py`` checks the one-line refusal on a CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_train import _steps, tiny_data  # noqa: F401 (tiny_data is a fixture)
from zoo.training import Recipe, Trainer

NO_CUDA = "no CUDA device: CUDA graphs capture CUDA kernels only (the GPU queue runs this: model_cards/runs/QUEUE.md)"


def hyper_recipe(path: Path, precision: str = "fp32", dropout: float = 0.0) -> Recipe:
    path.write_text(f"""
name = "tiny-hyperlstm-ln"
dataset = "ptb"
seed = 7
[model]
architecture = "hyperlstm"
emb_size = 8
dropouti = {dropout}
dropouto = {dropout}
[model.arch_args]
hidden_size = 16
num_layers = 2
hyper_size = 8
hyper_embedding_size = 2
use_layer_norm = true
recurrent_dropout = {dropout}
hyper_recurrent_dropout = {dropout}
[train]
precision = "{precision}"
epochs = 1
batch_size = 4
bptt = 12
variable_bptt = true
optimizer = "adam"
lr = 0.003
adam_betas = [0.9, 0.999]
clip = 1.0
eval_batch_size = 4
test_batch_size = 1
eval_bptt = 20
""")
    return Recipe.load(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_captured_hyperlstm_step_matches_its_eager_step(tmp_path, tiny_data, precision):  # noqa: F811
    """With dropout off (replays draw their masks at other RNG offsets), 30 variable-length steps give the same
    losses and weights eagerly and from graphs, and each length is captured once."""
    recipe = hyper_recipe(tmp_path / "r.toml", precision)
    runs = {}
    for graphs in (False, True):
        t = Trainer(recipe, tmp_path / f"g{graphs}", data_dir=str(tiny_data), device="cuda", progress=False,
                    cuda_graphs=graphs)
        runs[graphs] = (_steps(t, 30), torch.cat([p.detach().flatten() for p in t.model.parameters()]), t)
    (eager, w_eager, _), (captured, w_captured, t) = runs[False], runs[True]
    tol = 1e-4 if precision == "fp32" else 2e-2
    assert captured == pytest.approx(eager, rel=tol)
    assert float((w_captured - w_eager).abs().max()) < tol
    assert t._graphs.captures == len(t._graphs.graphs) < 30 - t._graphs.warmup


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_captured_hyperlstm_step_draws_fresh_recurrent_dropout_and_resumes(tmp_path, tiny_data):  # noqa: F811
    """Per-step recurrent dropout (main and hyper cell) inside a graph: replays of one graph on the same input
    draw new masks, and a captured run resumes from its own checkpoint."""
    recipe = hyper_recipe(tmp_path / "r.toml", dropout=0.2)
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
    t.save_training_checkpoint()
    b = Trainer(recipe, tmp_path / "a", data_dir=str(tiny_data), device="cuda", progress=False, cuda_graphs=True)
    assert b.load_training_checkpoint()
    assert all(float(st["step"]) == 6 for st in b.optimizer.state.values())  # 4 + 2 updates, carried
    assert all(0 < v < 20 for v in _steps(b, 5))
