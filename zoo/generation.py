"""Sampling from a runner with explicit state: greedy, temperature, top-k, top-p, seeded.

The prompt is encoded like scored text (without a final ``<eos>`` unless it ends in a line end), preceded by one
``<eos>`` as the start-of-sentence context, run through the sequence path once, then extended one
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
from zoo.scoring import LOGIT_BUDGET, Steps, run_steps
from zoo.tokenizer import UNK, Tokenizer
from zoo.validate import as_bool, as_float, as_int

MAX_NEW_TOKENS_LIMIT = 4096
#: The smallest non-zero temperature: below it ``logits / T`` leaves float32's range (a temperature of 1e-40
#: turned every probability into NaN); at 1e-6 sampling is already greedy to float precision.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings (the one schema every front end uses; see ``zoo.api.service``).

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


def read_context(runner, ids: list[int], vocab_size: int) -> tuple[Tensor, ...]:
    """The state after ``ids`` from a zero state. They run through in pieces whose logits (computed and dropped)
    stay within the scoring budget: the state is carried, so this is the whole context's state, without a
    ``[1, T, V]`` tensor for a long prompt."""
    return run_steps(read_context_steps(runner, ids, vocab_size))


@torch.no_grad()
def read_context_steps(runner, ids: list[int], vocab_size: int,
                       step_tokens: int | None = None) -> Steps[tuple[Tensor, ...]]:
    """:func:`read_context`, one piece of at most ``step_tokens`` tokens per step (the same state), yielding between
    pieces."""
    state = runner.init_state(1)
    piece = max(1, LOGIT_BUDGET // vocab_size)
    if step_tokens is not None:
        piece = max(1, min(piece, step_tokens))
    device = device_of(runner)
    for start in range(0, len(ids), piece):
        if start:
            yield
        _, state = runner.forward(torch.tensor([ids[start:start + piece]], dtype=torch.long, device=device), state)
    return state


def unk_spelling(tokenizer: Tokenizer) -> list[int]:
    """The ids that spell ``<unk>`` in a character model's vocabulary (``< u n k >``: :mod:`zoo.tokenizer`), or
    ``[]`` (a word model has the one id ``unk_id``; a vocabulary without those characters cannot spell it)."""
    return [tokenizer.index[ch] for ch in UNK] if tokenizer.is_char and all(ch in tokenizer.index for ch in UNK) \
        else []


def unk_ban(context: list[int], unk_id: int | None, spelled: list[int]) -> int | None:
    """The one id that may not come next when ``<unk>`` is not to be generated (``allow_unk=False``), or ``None``.

    A word model's ``<unk>`` is one id, never drawn; a character model's is spelled over five ids, and only its
    last character is withheld, right after the other four (``< u n k`` itself may be text). Plain Python on
    lists, no torch: ``exports/onnx_example.py`` carries a copy of this function, line for line, for generating
    from an export without torch or the zoo (``tests/test_onnx_without_torch.py`` checks the two are the same).
    """
    if unk_id is not None:
        return unk_id
    if spelled and context[len(context) - len(spelled) + 1:] == spelled[:-1]:
        return spelled[-1]
    return None


class Sampler:
    """The sampling rule, written once for every caller that draws tokens (:func:`generate_steps`, the one loop, which
    the native route, the OpenAI-compatible completions and the lm-eval plugin all run): the seeded generator, the
    ``<unk>`` rules and the greedy / temperature / top-k / top-p choice, so the same seed gives the same tokens on
    every route. ``context`` is the ids read so far (the ``<unk>`` spelling rule looks at its end); each chosen id
    is appended to it."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, context: list[int]):
        self.tokenizer, self.params, self.context = tokenizer, params, context
        self.gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        # a character model's <unk> is spelled as characters (zoo.tokenizer): the ids of that spelling, if it has them
        self.spelled = unk_spelling(tokenizer)

    def choose(self, logits: Tensor) -> int:
        """The next id from one step's logits ``[V]`` (float32); the id is appended to the context."""
        params, context = self.params, self.context
        logits = logits.clone()
        banned = None if params.allow_unk else unk_ban(context, self.tokenizer.unk_id, self.spelled)
        if banned is not None:
            logits[banned] = float("-inf")
        if params.temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            probs = torch.softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p), -1)
            nxt = int(torch.multinomial(probs, 1, generator=self.gen))
        context.append(nxt)
        return nxt


def prompt_context(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """A text prompt's context, as every route reads it: one ``<eos>`` (the start of a sentence) and its tokens,
    each line end an ``<eos>``. A last line without a line end is left open (the continuation goes on with it); a
    prompt that ends in a line end is read with that line ended, so the continuation starts a new line, as
    ``prompt + text`` shows it."""
    return [tokenizer.eos_id] + tokenizer.encode(prompt, add_eos=prompt.endswith("\n")).ids


def sample_ids(runner, tokenizer: Tokenizer, prompt: str, params: SamplingParams) -> Iterator[int]:
    """Yield generated token ids one by one: ``max_new_tokens`` of them, unless ``stop_at_eos`` and ``<eos>``."""
    return (idx for idx in sample_steps(runner, tokenizer, prompt, params) if idx is not None)


@torch.no_grad()
def generate_steps(runner, sampler: Sampler, state: tuple[Tensor, ...], limit: int
                   ) -> Iterator[tuple[int, Tensor]]:
    """The one generation loop: from ``state``, the state after all of ``sampler.context`` but its last id, step that
    id, choose the next (:meth:`Sampler.choose`), step it, and so on, ``limit`` times. Yields each chosen id with the
    float32 CPU logits it was drawn from (for a route that reports log-probabilities); stopping early (``<eos>``,
    a stop string) is the caller's, by not asking for more."""
    device = device_of(runner)
    token = sampler.context[-1]
    for _ in range(limit):
        logits, state = runner.step(torch.tensor([token], dtype=torch.long, device=device), state)
        row = logits[0].float().cpu()  # (sampled on the CPU, by its seeded generator, on any device)
        token = sampler.choose(row)
        yield token, row


def sample_steps(runner, tokenizer: Tokenizer, prompt: str, params: SamplingParams,
                 prompt_piece: int | None = None) -> Iterator[int | None]:
    """:func:`sample_ids`, with a ``None`` after each piece of at most ``prompt_piece`` prompt tokens read: a
    server interleaves a long prompt with other requests' work instead of reading it in one go."""
    context = prompt_context(tokenizer, prompt)
    sampler = Sampler(tokenizer, params, context)
    reading = read_context_steps(runner, context[:-1], len(tokenizer), prompt_piece)
    if prompt_piece is None:
        state = run_steps(reading)
    else:
        state = yield from reading
    for nxt, _ in generate_steps(runner, sampler, state, params.max_new_tokens):
        if params.stop_at_eos and nxt == tokenizer.eos_id:
            return
        yield nxt


def word_gap(tokenizer: Tokenizer, before: str, piece: str) -> str:
    """The one spacing rule, for every caller that joins text the zoo generated (the detokeniser below, the
    transformers pipeline's prompt + completion): a word model puts a space before a word unless what precedes it
    is empty or ends in white space, or the piece starts a line (``<eos>`` reads as a line break); a character
    model's pieces are joined as they are (its ``_`` is already a space)."""
    spaced = bool(before) and not before[-1].isspace()
    return " " if spaced and not tokenizer.is_char and not piece.startswith("\n") else ""


class Detokenizer:
    """Token ids to display pieces whose concatenation is the text, by :func:`word_gap` (``before``: the text the
    pieces follow, empty at the start of a text)."""

    def __init__(self, tokenizer: Tokenizer, before: str = ""):
        self.tokenizer = tokenizer
        self.before = before[-1:]  # the last character so far: all the spacing rule reads

    def piece(self, idx: int) -> str:
        piece = self.tokenizer.token_text(idx)
        piece = word_gap(self.tokenizer, self.before, piece) + piece
        if piece:
            self.before = piece[-1]
        return piece


def stream_text(runner, tokenizer: Tokenizer, prompt: str, params: SamplingParams) -> Iterator[str]:
    """Yield detokenised pieces; their concatenation is the generated continuation."""
    return (piece for piece in stream_steps(runner, tokenizer, prompt, params) if piece is not None)


def stream_steps(runner, tokenizer: Tokenizer, prompt: str, params: SamplingParams,
                 prompt_piece: int | None = None) -> Iterator[str | None]:
    """:func:`stream_text` with :func:`sample_steps`' ``None`` after each piece of the prompt read."""
    pieces = Detokenizer(tokenizer)
    for idx in sample_steps(runner, tokenizer, prompt, params, prompt_piece):
        yield None if idx is None else pieces.piece(idx)
