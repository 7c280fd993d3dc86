"""Evaluation during and after training: a split's metrics in the run's mode, and NT-ASGD's averaged weights.

Why apart from the loop: the same evaluation scores validation at every epoch end, the best model at the end and the
release's cast weights, always through :mod:`zoo.scoring` (the code ``zoo eval`` runs), so a card's number and the
run's own cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import torch

from zoo.data import Corpus
from zoo.lm import LanguageModel
from zoo.scoring import evaluate_sentences, evaluate_stream


class DeviceRunner:
    """Runs an LM on a device for evaluation, returning logits on that device."""

    def __init__(self, model: LanguageModel, device: torch.device):
        self.model, self.device = model, device

    def init_state(self, batch_size: int):
        return self.model.init_state(batch_size, self.device)

    def forward(self, tokens, state):
        return self.model(tokens.to(self.device), state)

    def target_logprobs(self, tokens, targets, state):
        return self.model.target_logprobs(tokens.to(self.device), targets.to(self.device), state)


class Evaluator:
    """A split's metrics in the run's mode: one carried stream (``eval_bptt`` per chunk), or every line on its own
    from a zero state (``sentences``: the split's sequences, padded with ``pad_id``)."""

    def __init__(self, device: torch.device, corpus: Corpus, eval_bptt: int, progress: bool,
                 sentences: dict[str, list[torch.Tensor]] | None = None, pad_id: int = 0) -> None:
        self.device, self.corpus, self.eval_bptt, self.progress = device, corpus, eval_bptt, progress
        self.sentences, self.pad_id = sentences, pad_id

    def __call__(self, model: LanguageModel, split: str, batch_size: int, desc: str) -> dict[str, Any]:
        runner = DeviceRunner(model, self.device)
        if self.sentences is not None:
            return evaluate_sentences(runner, self.sentences[split], batch_size=batch_size, pad_id=self.pad_id,
                                      progress=self.progress, desc=desc)
        return evaluate_stream(runner, self.corpus.split(split), batch_size=batch_size, bptt=self.eval_bptt,
                               progress=self.progress, desc=desc)


def swap_in_averaged(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """ASGD evaluates its averaged weights (``ax``): swap them in and return the originals for
    :func:`restore_weights`."""
    backup = {}
    for p in model.parameters():
        st = optimizer.state.get(p, {})
        if "ax" in st:
            backup[p] = p.detach().clone()
            with torch.no_grad():   # (not .data: an in-place change the compiled loops' weight cache sees)
                p.copy_(st["ax"])
    return backup


def restore_weights(backup: dict[torch.Tensor, torch.Tensor] | None) -> None:
    with torch.no_grad():
        for p, v in (backup or {}).items():
            p.copy_(v)
