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

from zoo.device import device_of
from zoo.errors import InvalidRequest
from zoo.scoring import LOGIT_BUDGET
from zoo.tokenizer import UNK, Tokenizer
from zoo.validate import as_bool, as_float, as_int

MAX_NEW_TOKENS_LIMIT = 4096
#: The smallest non-zero temperature: below it ``logits / T`` leaves float32's range (a temperature of 1e-40
#: turned every probability into NaN); at 1e-6 sampling is already greedy to float precision.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings (the one schema every front end uses; see ``zoo.service``).

    ``max_new_tokens`` is how many tokens are generated: ``<eos>`` is a token like any other (it renders as a
    line break) unless ``stop_at_eos``, which ends generation at the first one. ``temperature == 0`` means
    greedy decoding. ``allow_unk=False`` never produces ``<unk>`` (its probability is moved to the rest); a
    character model, which spells ``<unk>`` as its five characters, never completes that spelling.
    Bad values raise :class:`zoo.errors.InvalidRequest` (a ``ValueError``) naming the field.
    """

    max_new_tokens: int = 50
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = False
    allow_unk: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise integral floats (slider values) to int once, here
        set_(self, "max_new_tokens", as_int(self.max_new_tokens, "max_new_tokens", 0, MAX_NEW_TOKENS_LIMIT))
        t = as_float(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        if 0 < t < MIN_TEMPERATURE:
            raise InvalidRequest("temperature", f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                                                f"{MAX_TEMPERATURE:g}], got {t:g}")
        set_(self, "temperature", t)
        set_(self, "top_k", as_int(self.top_k, "top_k", 0))
        set_(self, "top_p", as_float(self.top_p, "top_p", 0.0, 1.0, lo_open=True))
        if self.seed is not None:
            set_(self, "seed", as_int(self.seed, "seed", 0, 2**63 - 1))
        as_bool(self.stop_at_eos, "stop_at_eos")
        as_bool(self.allow_unk, "allow_unk")


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Mask all but the top-k tokens and the smallest set whose probability reaches ``top_p``."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        drop[..., 0] = False  # and always the most likely one (a top_p below float32's range dropped all)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


@torch.no_grad()
def read_context(runner, ids: list[int], vocab_size: int) -> tuple[Tensor, ...]:
    """The state after ``ids`` from a zero state. They run through in pieces whose logits (computed and dropped)
    stay within the scoring budget: the state is carried, so this is the whole context's state, without a
    ``[1, T, V]`` tensor for a long prompt."""
    state = runner.init_state(1)
    piece = max(1, LOGIT_BUDGET // vocab_size)
    device = device_of(runner)
    for start in range(0, len(ids), piece):
        _, state = runner.forward(torch.tensor([ids[start:start + piece]], dtype=torch.long, device=device), state)
    return state


@torch.no_grad()
def sample_ids(runner, tokenizer: Tokenizer, prompt: str, params: SamplingParams) -> Iterator[int]:
    """Yield generated token ids one by one: ``max_new_tokens`` of them, unless ``stop_at_eos`` and ``<eos>``."""
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    context = [tokenizer.eos_id] + tokenizer.encode(prompt, add_eos=False).ids
    # a character model's <unk> is spelled as characters (zoo.tokenizer): the ids of that spelling, if it has them
    spelled = [tokenizer.index[ch] for ch in UNK] if tokenizer.is_char and all(ch in tokenizer.index for ch in UNK) \
        else []
    state = read_context(runner, context[:-1], len(tokenizer))
    device = device_of(runner)
    token = torch.tensor([context[-1]], dtype=torch.long, device=device)
    for _ in range(params.max_new_tokens):
        logits, state = runner.step(token, state)
        logits = logits[0].float().cpu()   # (sampled on the CPU, by its seeded generator, on any device)
        if not params.allow_unk and tokenizer.unk_id is not None:
            logits[tokenizer.unk_id] = float("-inf")
        elif not params.allow_unk and spelled and context[len(context) - len(spelled) + 1:] == spelled[:-1]:
            logits[spelled[-1]] = float("-inf")  # the last character of a spelled <unk>
        if params.temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            probs = torch.softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p), -1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        if params.stop_at_eos and nxt == tokenizer.eos_id:
            return
        context.append(nxt)
        yield nxt
        token = torch.tensor([nxt], dtype=torch.long, device=device)


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
