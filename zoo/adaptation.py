"""How much the adaptation policy changes the weights at each token ("the adaptation at work").

Adaptive-parameterization models (aLSTM, HyperLSTM) rescale their weights at every step with
vectors computed from the input and the state. The HyperNetworks paper (Ha et al. 2017, the
weight-change figure under its generated text) shows how strongly those vectors move from one
character to the next; this module measures the same thing for any zoo model.

Why it only talks to the generic interface: every architecture exposes its adaptation vectors
through :meth:`~zoo.models.base.RecurrentStack.adaptation_signals` (``{"layer{l}.{name}": [B, n]}``,
``{}`` for models without input-dependent weights), so one loop over :meth:`zoo.lm.LanguageModel.step`
serves the aLSTM, the HyperLSTM and any future architecture, and returns an empty trace for the rest.

Alignment: the text's first token is conditioned on one ``<eos>`` (as in :mod:`zoo.scoring`). The
change at index ``t`` is ``||s_t - s_{t-1}||_2`` where ``s_t`` are the vectors after *reading* token
``t`` (``s_{-1}``: after reading the leading ``<eos>``), so the value sits under the token that caused it.
``logprobs[t]`` is the log-probability of token ``t`` given the tokens before it, the same number
:func:`zoo.scoring.score_texts` reports (computed here on the step path).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from zoo.lm import LanguageModel
from zoo.tokenizer import Tokenizer

_KEY = re.compile(r"^layer(\d+)\.(.+)$")
#: Tokens stepped at most by default: one Python-level step per token is the slow path.
DEFAULT_MAX_TOKENS = 2000


@dataclass
class AdaptationTrace:
    """Per-token step-to-step change of every adaptation signal, grouped by layer.

    ``changes[layer][signal]`` is a list with one float per token (the L2 norm of the change of that
    vector); ``layer_total[layer]`` is the norm of the change of all the layer's vectors together.
    """

    tokens: list[str]
    ids: list[int]
    logprobs: list[float]
    changes: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    truncated: bool = False
    total_tokens: int = 0

    @property
    def has_signals(self) -> bool:
        """False for architectures without input-dependent weights (nothing to plot)."""
        return bool(self.changes)

    @property
    def layer_total(self) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for layer, sigs in self.changes.items():
            cols = list(sigs.values())
            out[layer] = [math.sqrt(sum(c[t] ** 2 for c in cols)) for t in range(len(self.tokens))]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "ids": self.ids,
            "logprobs": self.logprobs,
            "changes": {f"layer{layer}": sigs for layer, sigs in self.changes.items()},
            "layer_total": {f"layer{layer}": vals for layer, vals in self.layer_total.items()},
            "signal_sizes": self.sizes,
            "truncated": self.truncated,
            "total_tokens": self.total_tokens,
        }


def _split_key(key: str) -> tuple[int, str]:
    """``"layer1.pi_hh"`` -> ``(1, "pi_hh")``; a key without the layer prefix counts as layer 0."""
    m = _KEY.match(key)
    return (int(m.group(1)), m.group(2)) if m else (0, key)


def _flat_signals(lm: LanguageModel, state: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """The signals of batch row 0, each flattened to a float64 vector (exact differences)."""
    return {k: v[0].reshape(-1).double() for k, v in lm.rnn.adaptation_signals(state).items()}


@torch.no_grad()
def adaptation_trace(lm: LanguageModel, ids: Sequence[int], bos_id: int,
                     tokens: Sequence[str] | None = None, max_tokens: int | None = DEFAULT_MAX_TOKENS
                     ) -> AdaptationTrace:
    """Step ``lm`` through ``ids`` (after one ``bos_id``) and measure each signal's change per token.

    Only the first ``max_tokens`` tokens are stepped (``truncated`` says so); architectures without
    adaptation signals are detected on the first step and cost nothing more.
    """
    ids = [int(i) for i in ids]
    total = len(ids)
    tokens = list(tokens) if tokens is not None else [str(i) for i in ids]
    if len(tokens) != total:
        raise ValueError(f"{len(tokens)} tokens for {total} ids")
    truncated = max_tokens is not None and total > max_tokens
    if truncated:
        ids, tokens = ids[:max_tokens], tokens[:max_tokens]
    was_training = lm.training
    lm.eval()
    try:
        state = lm.init_state(1)
        device = lm.device
        logits, state = lm.step(torch.tensor([bos_id], dtype=torch.long, device=device), state)
        prev = _flat_signals(lm, state)
        trace = AdaptationTrace(tokens=tokens, ids=ids, logprobs=[], truncated=truncated, total_tokens=total)
        if not prev:
            return trace
        deltas: dict[str, list[float]] = {k: [] for k in prev}
        for tok in ids:
            trace.logprobs.append(float(torch.log_softmax(logits[0].double(), -1)[tok]))
            logits, state = lm.step(torch.tensor([tok], dtype=torch.long, device=device), state)
            cur = _flat_signals(lm, state)
            for key, vec in cur.items():
                deltas[key].append(float(torch.linalg.vector_norm(vec - prev[key])))
            prev = cur
    finally:
        lm.train(was_training)
    for key, vals in deltas.items():
        layer, name = _split_key(key)
        trace.changes.setdefault(layer, {})[name] = vals
        trace.sizes[key] = int(prev[key].numel())
    trace.changes = dict(sorted(trace.changes.items()))
    return trace


def trace_text(lm: LanguageModel, tokenizer: Tokenizer, text: str,
               max_tokens: int | None = DEFAULT_MAX_TOKENS) -> AdaptationTrace:
    """:func:`adaptation_trace` on raw text, tokenised exactly as :mod:`zoo.scoring` does."""
    enc = tokenizer.encode(text)
    return adaptation_trace(lm, enc.ids, tokenizer.eos_id, enc.tokens, max_tokens=max_tokens)
