"""Shared fixtures: tiny models of every architecture and tiny checkpoints built with the real code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from zoo.checkpoint import save_checkpoint
from zoo.lm import LanguageModel
from zoo.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent

_ALSTM = {"hidden_size": 12, "num_layers": 2, "adapt_size": 4, "dropout_hidden": 0.0, "dropout_adapt": 0.0}

#: Tiny constructor arguments per architecture variant (name -> (architecture, arch_args)).
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "lstm": ("lstm", {"hidden_size": 12, "num_layers": 2}),
    "alstm": ("alstm", dict(_ALSTM)),
    "alstm-lstm": ("alstm", dict(_ALSTM, adaptation_model="lstm")),
    "alstm-ff": ("alstm", dict(_ALSTM, adaptation_model="feedforward")),
    "alstm-output": ("alstm", dict(_ALSTM, policy="output", layer0_wraparound=False)),
    "hyperlstm": ("hyperlstm", {"hidden_size": 12, "num_layers": 1, "hyper_size": 6, "hyper_embedding_size": 3}),
    "hyperlstm-ln": ("hyperlstm", {"hidden_size": 12, "num_layers": 2, "hyper_size": 6, "hyper_embedding_size": 3,
                                   "use_layer_norm": True}),
    "pnorm_gru": ("pnorm_gru", {"hidden_size": 12, "num_layers": 2, "p": 1.0}),
    "pnorm_gru-p2": ("pnorm_gru", {"hidden_size": 12, "num_layers": 2, "p": 2.0}),
}

WORDS = ["<eos>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "N", "mr.", "'s", "n't", "$"]


def tiny_lm(variant: str, vocab_size: int = len(WORDS), emb_size: int = 8, seed: int = 0, **kw) -> LanguageModel:
    arch, args = TINY_ARCHS[variant]
    torch.manual_seed(seed)
    return LanguageModel(vocab_size, arch, dict(args), emb_size=emb_size, **kw)


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(list(WORDS), "ptb")


@pytest.fixture(params=sorted(TINY_ARCHS))
def variant(request) -> str:
    return request.param


@pytest.fixture
def tiny_checkpoint(tmp_path) -> Path:
    """A real checkpoint directory of a tiny (untrained) tied aLSTM with the PTB normalisation."""
    lm = tiny_lm("alstm").eval()
    return save_checkpoint(tmp_path / "tiny-alstm", lm, tiny_tokenizer(), {"name": "tiny-alstm", "dataset": "ptb"})


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add synchronisation (and on a busy 2-core box, waiting). A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _threads(tmp_path_factory):
    torch.set_flush_denormal(True)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # what the suite makes on demand (exports, dynamic evaluation's statistics) stays out of the user's cache
    previous = os.environ.get("ZOO_CACHE_DIR")
    os.environ["ZOO_CACHE_DIR"] = str(tmp_path_factory.mktemp("zoo-cache"))
    yield
    if previous is None:
        os.environ.pop("ZOO_CACHE_DIR", None)
    else:
        os.environ["ZOO_CACHE_DIR"] = previous
