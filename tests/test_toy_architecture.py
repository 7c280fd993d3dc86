"""Adding an architecture is one registration: a toy Elman RNN defined in this test module goes through
training, scoring, generation, both exports, card generation and the demo's model list, with no other file of
the zoo edited (the registries are the only place the rest of the code learns about architectures)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import Tensor, nn

from tests.olah_fixture import make_tiny_data
from zoo.models.base import RecurrentStack, State
from zoo.registry import ArchitectureSpec, register_architecture, unregister_architecture

TOY_BIBTEX = """@article{elman1990finding,
  title   = {Finding Structure in Time},
  author  = {Elman, Jeffrey L.},
  journal = {Cognitive Science},
  year    = {1990}
}"""


class ElmanStack(RecurrentStack):
    """One tanh RNN layer: the smallest thing that speaks the :class:`RecurrentStack` protocol."""

    def __init__(self, input_size: int, output_size: int, hidden_size: int = 8) -> None:
        super().__init__(input_size, output_size)
        self.cell = nn.RNNCell(input_size, output_size)

    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> State:
        w = self.cell.weight_hh
        return (torch.zeros(batch_size, self.output_size, device=device or w.device, dtype=dtype or w.dtype),)

    def state_names(self) -> list[str]:
        return ["h0"]

    def step_with_masks(self, x: Tensor, state: State, masks: object) -> tuple[Tensor, State]:
        h = self.cell(x, state[0])
        return h, (h,)


TOY_RECIPE = """
name = "toy-elman"
dataset = "ptb"
seed = 5
description = "A toy Elman RNN for the registry test."
[model]
architecture = "toy_elman"
emb_size = 8
tie_weights = true
[model.arch_args]
hidden_size = 8
[train]
epochs = 1
batch_size = 4
bptt = 10
optimizer = "adam"
lr = 0.003
eval_batch_size = 4
test_batch_size = 1
eval_bptt = 20
save_dtype = "float32"
"""


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy architecture registered from this module, trained for one epoch on the first lines of PTB."""
    from zoo.training import Recipe, Trainer

    register_architecture(ArchitectureSpec("toy_elman", ElmanStack, "Elman RNN (toy)", ("elman1990",)),
                          citations={"elman1990": TOY_BIBTEX})
    root = tmp_path_factory.mktemp("toy")
    data = make_tiny_data(root / "data")
    (root / "recipe.toml").write_text(TOY_RECIPE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(Recipe.load(root / "recipe.toml"), root / "run", data_dir=str(data), device="cpu",
                progress=False).run()
    finally:
        torch.set_num_threads(threads)
    yield {"root": root, "run": root / "run", "release": root / "run" / "release"}
    unregister_architecture("toy_elman")


def test_scoring_and_generation(toy):
    import zoo

    model = zoo.load(toy["release"])
    assert model.lm.architecture == "toy_elman" and isinstance(model.lm.rnn, ElmanStack)
    rep = model.score(["the company said", "the market fell"])
    assert all(math.isfinite(t["ppl"]) and t["ppl"] > 1 for t in rep.texts)
    text = model.generate("the company", max_new_tokens=5, seed=0)
    assert text == model.generate("the company", max_new_tokens=5, seed=0) and text.strip()


def test_exports_match_eager(toy, tmp_path):
    pytest.importorskip("onnxruntime")
    import zoo
    from zoo.backends import attach_backend
    from zoo.export import export_model

    model = zoo.load(toy["release"])
    export_model(model, tmp_path / "exp", formats=("onnx", "torchscript"), verify=True)
    ref = model.score("the company said the market fell")[0]["ppl"]
    for backend in ("onnx", "torchscript"):
        other = attach_backend(zoo.load(toy["release"]), backend, tmp_path / "exp" / backend)
        assert other.score("the company said the market fell")[0]["ppl"] == pytest.approx(ref, rel=1e-5)


def test_card_names_the_architecture_and_cites_its_paper(toy):
    from zoo.tools.release import cards

    ev = json.loads((toy["run"] / "eval.json").read_text())
    config = json.loads((toy["release"] / "config.json").read_text())
    text = cards.build_card("toy-elman", ev, [], config, repo_id="o/toy-elman", revision="v1.0")
    assert "Elman RNN (toy)" in text and "Finding Structure in Time" in text
    assert cards.card_metrics(text)["test"]["perplexity"] == pytest.approx(ev["release"]["test"]["ppl"])


def test_demo_lists_and_loads_it(toy):
    pytest.importorskip("gradio")
    import app

    reg = app.ModelRegistry(extra_dirs=[toy["release"]])
    assert "toy-elman" in reg.names() and not reg.has_adaptation("toy-elman")
    row = next(r for r in reg.table() if r[0].startswith("toy-elman"))
    assert row[1] == "toy_elman"
    assert reg.get("toy-elman").lm.architecture == "toy_elman"
