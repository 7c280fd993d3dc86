"""Sampling from a runner with explicit state: greedy, temperature, top-k, top-p, seeded.

The prompt is encoded like scored text (without a final ``<eos>``), preceded by one ``<eos>`` as
the start-of-sentence context, run through the sequence path once, then extended one
single-step call at a time; so the same code serves eager, TorchScript and ONNX Runtime runners
(anything with ``init_state``, ``forward`` and ``step``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from zoo.tokenizer import Tokenizer

MAX_NEW_TOKENS_LIMIT = 4096


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 50
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or not 0 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(f"max_new_tokens must be an integer in [0, {MAX_NEW_TOKENS_LIMIT}]")
        if not self.temperature >= 0:
            raise ValueError("temperature must be >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError("top_k must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Mask all but the top-k tokens and the smallest set whose probability reaches ``top_p``."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


@torch.no_grad()
def sample_ids(runner, tokenizer: Tokenizer, prompt: str, params: SamplingParams) -> Iterator[int]:
    """Yield generated token ids one by one (``<eos>`` ends generation when ``stop_at_eos``)."""
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    context = [tokenizer.eos_id] + tokenizer.encode(prompt, add_eos=False).ids
    state = runner.init_state(1)
    if len(context) > 1:
        _, state = runner.forward(torch.tensor([context[:-1]], dtype=torch.long), state)
    token = torch.tensor([context[-1]], dtype=torch.long)
    for _ in range(params.max_new_tokens):
        logits, state = runner.step(token, state)
        logits = logits[0].float()
        if params.temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            probs = torch.softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p), -1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        if params.stop_at_eos and nxt == tokenizer.eos_id:
            return
        yield nxt
        token = torch.tensor([nxt], dtype=torch.long)


def stream_text(runner, tokenizer: Tokenizer, prompt: str, params: SamplingParams) -> Iterator[str]:
    """Yield detokenised pieces; their concatenation is the generated continuation."""
    first, after_newline = True, False
    for idx in sample_ids(runner, tokenizer, prompt, params):
        piece = tokenizer.token_text(idx)
        if not tokenizer.is_char and piece != "\n" and not first and not after_newline:
            piece = " " + piece
        after_newline = piece == "\n"
        first = False
        yield piece
