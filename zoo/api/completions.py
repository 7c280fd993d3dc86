"""OpenAI-compatible completions (``POST /v1/completions``) on the zoo's own scoring and sampling.

Why: the de-facto API of language-model servers (vLLM, TGI, llama.cpp) is OpenAI's completions API, and the
clients researchers already use speak it: the ``openai`` package, lm-evaluation-harness's ``local-completions``
model (``echo: true, logprobs: 1`` to score a text). This module is that dialect over the same model, sampling rule
(:class:`zoo.generation.Sampler`) and limits (:class:`zoo.api.service.Limits`) as the native route: no second engine.

How a prompt is conditioned (the zoo's scoring protocol, :mod:`zoo.scoring`):

* A **text** prompt is one or more lines, each ending with ``<eos>`` as in the corpora, its first token
  conditioned on one ``<eos>`` (the start of a sentence) from a zero state. So *every* token of a text prompt has a
  log-probability (none is ``null``) and, with ``max_tokens: 0``, their sum is ``zoo score``'s NLL of that text.
  When tokens are generated (``max_tokens`` > 0) the prompt is read as ``zoo generate`` reads it
  (:func:`zoo.generation.prompt_context`): a last line without a line end is left open (no final ``<eos>``), so the
  completion continues that line; a prompt ending in a line end is read with that line ended (its ``<eos>`` is the
  last prompt token), so the completion starts a new line, as ``prompt + text`` shows it.
* A **token-id** prompt (a list of integers) is taken literally: its first id is the context, with no
  log-probability (``null``, as OpenAI servers report it), and each later id is conditioned on the ids before it
  from a zero state. lm-evaluation-harness sends ``[<eos>, t1, ..., tn]``, which is exactly the text protocol.
* ``tokens`` are the model's vocabulary symbols (``the``, ``<eos>``, ``N``, ``<unk>``): unique, unlike display
  text. ``top_logprobs[i]`` holds the ``logprobs`` most likely symbols at that position and always the token itself
  (so ``logprobs`` or ``logprobs + 1`` entries, as vLLM reports them).
* ``text_offset`` (one convention for every token, echoed or generated): where the token's own text starts in the
  prompt followed by the completion, i.e. in ``choices[i].text`` with ``echo`` and in ``prompt + choices[i].text``
  without (a token-id prompt counts as its display text). So ``text[o:o + len(tok)] == tok`` wherever the token is a
  literal piece of the text (the space a word model puts between words is not part of the word). ``<eos>`` points
  at the line break it stands for. A token the normalisation changed points at the first character of the text it
  came from (PTB's ``N`` at ``1985``, ``sales`` at ``Sales``, a character model's ``_`` at its space; for a text
  prompt, in the NFC form of the prompt, which is the prompt itself for NFC text); one it inserted (a character
  model's spelled ``<unk>``) at the next character. Log-probabilities are natural logs of the model's own
  distribution (before temperature, top-k, top-p and the ``<unk>`` rules), float32 softmax, reported as floats.
* Generated text is the native route's ``text``, with one space in front for a word model when the prompt is
  non-empty and does not end in white space (so ``prompt + text`` reads as words, as ``echo`` shows it). At a
  ``stop`` sequence the text is cut before it, and the tokens are cut with it: a generated token whose own text
  starts at or after the cut is neither reported in ``logprobs`` nor counted in ``usage``.
* Sampling fields: ``temperature``, ``top_p``, ``seed`` and vLLM's ``top_k`` (0 or -1: every token), the native
  route's sampling rule (:class:`zoo.generation.Sampler`). A field outside the schema is ignored (as vLLM does).

Work is done in slices (:meth:`CompletionRun.steps`: at most ``positions`` prompt tokens or one generated
token each), so a server can interleave a long request with other requests' work.
"""

from __future__ import annotations

import logging
import secrets
import time
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from zoo.api.dialects import Work
from zoo.api.http import JSON_TYPE, SSE_TYPE, openai_error_of, to_json
from zoo.api.service import decode_json
from zoo.device import device_of
from zoo.errors import InvalidRequest, ModelNotServed, RequestTooLarge, ZooError
from zoo.generation import MAX_TEMPERATURE, Detokenizer, Sampler, SamplingParams, generate_steps, prompt_context
from zoo.scoring import LOGIT_BUDGET
from zoo.tokenizer import EOS, Tokenizer
from zoo.validate import as_bool, as_float, as_int, check_text, json_type, surrogate_position

log = logging.getLogger(__name__)

#: The most alternatives per token ``logprobs`` may ask for (OpenAI's own cap is 5; vLLM's default 20).
MAX_LOGPROBS = 20
#: Stop sequences per request (OpenAI's cap) and their longest length in characters.
MAX_STOP, MAX_STOP_CHARS = 4, 100
#: Prompt tokens run per slice of work (one slice: at most this many tokens through the model).
PROMPT_SLICE = 128
#: Fields of OpenAI's completions schema the zoo does not implement, with the one value each that is accepted.
NEUTRAL_FIELDS: dict[str, Any] = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {},
                                  "suffix": None}
OPENAI_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Prompt:
    """One prompt: a text, or token ids taken literally (``text`` is then None)."""

    text: str | None = None
    ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[Prompt, ...]
    max_tokens: int
    echo: bool
    logprobs: int | None
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    warnings: tuple[str, ...] = ()
    #: the prompts' tokens as the model reads them, and each prompt opened for reading (:func:`_context`), both
    #: set as it is parsed (the budget needs them: the run reuses them rather than tokenise twice)
    prompt_tokens: int = 0
    opened: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    task: str = field(default="completion", init=False)


# -- parsing ---------------------------------------------------------------------------------------------------
def _prompts(raw: Any, vocab_size: int, limits: Any) -> tuple[list[Prompt], list[str]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists."""
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):  # bools: refused per id below
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        what = "an empty list" if isinstance(raw, list) else json_type(raw)
        raise InvalidRequest("prompt", f"must be a string, a list of strings or a list of token ids, got {what}")
    if len(items) > limits.max_texts:
        raise InvalidRequest("prompt", f"has {len(items)} prompts; the limit is {limits.max_texts} per request")
    prompts, warnings = [], []
    for i, item in enumerate(items):
        name = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            text, warns = check_text(item, name, limits.max_chars, allow_empty=True, truncate=limits.truncate)
            prompts.append(Prompt(text=text))
            warnings += warns
            continue
        if not isinstance(item, list) or not item:
            raise InvalidRequest(name, f"must be a string or a non-empty list of token ids, got {json_type(item)}")
        if len(item) > limits.max_total_tokens:
            raise RequestTooLarge(name, f"has {len(item):,} token ids; the limit is {limits.max_total_tokens:,} "
                                       "per request")
        ids = tuple(as_int(t, f"{name}[{k}]", 0, vocab_size - 1) for k, t in enumerate(item))
        prompts.append(Prompt(ids=ids))
    total = sum(len(p.text) for p in prompts if p.text is not None)
    if total > limits.max_total_chars:
        raise InvalidRequest("prompt", f"has {total:,} characters in all; the limit is {limits.max_total_chars:,} "
                                       "per request")
    return prompts, warnings


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise InvalidRequest("stop", f"must be a string or a list of at most {MAX_STOP} strings")
    out = []
    for i, s in enumerate(items):  # white space is a fine stop sequence ("\n"): not check_text's rules
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS or surrogate_position(s) is not None:
            raise InvalidRequest(f"stop[{i}]", f"must be a non-empty string of at most {MAX_STOP_CHARS} characters "
                                               "(valid Unicode)")
        out.append(s)
    return tuple(out)


def _neutral(payload: Mapping[str, Any]) -> None:
    """OpenAI fields the zoo does not implement: accepted at their neutral value, refused otherwise."""
    for key, neutral in NEUTRAL_FIELDS.items():
        value = payload.get(key)
        if value is not None and value != neutral:
            raise InvalidRequest(key, f"is not supported by this server (only {neutral!r} is accepted)")
    n = payload.get("n")
    if n is not None and as_int(n, "n", 1) != 1:
        raise InvalidRequest("n", "must be 1 here (send the request again, with another seed, for more choices)")


def parse_completion(payload: Any, tokenizer: Tokenizer, limits: Any, served: str | None = None
                     ) -> CompletionRequest:
    """A decoded JSON body -> a validated :class:`CompletionRequest` (fields outside OpenAI's schema and vLLM's
    ``top_k`` are ignored, as vLLM ignores them; OpenAI's own service refuses them with a 400; wrong types and ranges
    raise :class:`InvalidRequest` naming the field, over-budget requests :class:`~zoo.errors.RequestTooLarge`, a
    model not served here :class:`~zoo.errors.ModelNotServed`)."""
    if not isinstance(payload, Mapping):
        raise InvalidRequest("body", f"expected a JSON object, got {json_type(payload)}")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model", "is missing: name a served model (GET /v1/models lists them)")
    if served is not None and model != served:
        raise ModelNotServed(f"the model {model[:64]!r} is not served here (GET /v1/models lists them)")
    if "prompt" not in payload:
        raise InvalidRequest("prompt", "is missing")
    prompts, warnings = _prompts(payload["prompt"], len(tokenizer), limits)
    _neutral(payload)

    def opt(key: str, default: Any) -> Any:
        return default if payload.get(key) is None else payload[key]

    max_tokens = as_int(opt("max_tokens", min(OPENAI_DEFAULT_MAX_TOKENS, limits.max_new_tokens)), "max_tokens", 0,
                        limits.max_new_tokens)
    logprobs = payload.get("logprobs")
    if logprobs is not None:
        logprobs = as_int(logprobs, "logprobs", 0, MAX_LOGPROBS)
    temperature = as_float(opt("temperature", 1.0), "temperature", 0.0, min(MAX_TEMPERATURE, limits.max_temperature))
    top_k = as_int(opt("top_k", 0), "top_k", -1, limits.max_top_k)  # (vLLM's extension; -1 or 0: all tokens)
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=max(0, top_k),
                              top_p=opt("top_p", 1.0), seed=payload.get("seed"))
    options = opt("stream_options", {})
    if not isinstance(options, Mapping):
        raise InvalidRequest("stream_options", f"must be an object, got {json_type(options)}")
    request = CompletionRequest(
        model=model, prompts=tuple(prompts), max_tokens=max_tokens, echo=as_bool(opt("echo", False), "echo"),
        logprobs=logprobs, sampling=sampling, stop=_stop(payload.get("stop")),
        stream=as_bool(opt("stream", False), "stream"),
        include_usage=as_bool(options.get("include_usage") or False, "stream_options.include_usage"),
        warnings=tuple(warnings))
    if any(p.text == "" for p in request.prompts) and max_tokens == 0 and request.echo:
        raise InvalidRequest("prompt", "is empty and nothing is generated: there is nothing to score")
    opened = tuple(_context(p, tokenizer, max_tokens) for p in request.prompts)
    prompt_tokens, _ = check_budget(request, tokenizer, limits, opened)
    return replace(request, prompt_tokens=prompt_tokens, opened=opened)


def check_budget(request: CompletionRequest, tokenizer: Tokenizer, limits: Any,
                 opened: Sequence[Any] = ()) -> tuple[int, int]:
    """Refuse, before any model work, a request over the deployment's token budgets (as the native routes'): a
    request that generates nothing reads its prompts as a score request does (their tokens, all prompts, after
    tokenisation, against ``max_total_tokens``); one that generates is a generate request (prompt tokens plus the
    tokens it may generate, prompts x ``max_tokens``, together against ``max_generate_tokens``: counted apart, one
    request cost 3.0-3.4 CPU-s on the default model). Returns both counts. ``opened``: the prompts' :func:`_context`,
    when the caller has them."""
    opened = opened or [_context(p, tokenizer, request.max_tokens) for p in request.prompts]
    prompt = sum(len(echoed) for _, echoed, _ in opened)
    if prompt > limits.max_total_tokens:
        raise RequestTooLarge("prompt", f"is {prompt:,} tokens for this model; the limit is "
                                        f"{limits.max_total_tokens:,} per request")
    generated = request.max_tokens * len(request.prompts)
    if generated and prompt + generated > limits.max_generate_tokens:
        raise RequestTooLarge("max_tokens", f"{request.max_tokens:,} for each of {len(request.prompts)} prompt(s) "
                                            f"after {prompt:,} prompt tokens is {prompt + generated:,} tokens; the "
                                            f"limit is {limits.max_generate_tokens:,} per request (prompt and "
                                            "generated together)")
    if generated > limits.max_generate_tokens:
        raise RequestTooLarge("max_tokens", f"{request.max_tokens:,} for each of {len(request.prompts)} prompt(s) is "
                                            f"{generated:,} tokens; the limit is {limits.max_generate_tokens:,} "
                                            "per request")
    return prompt, generated


# -- running ---------------------------------------------------------------------------------------------------
def _context(prompt: Prompt, tokenizer: Tokenizer, max_tokens: int) -> tuple[list[int], list[int], Any]:
    """``(context ids, echoed ids, encoding or None)``: what the model reads, and which of it is reported."""
    if prompt.text is None:
        return list(prompt.ids), list(prompt.ids), None
    if max_tokens > 0:  # (a final line end is read as <eos>: prompt_context)
        ctx = prompt_context(tokenizer, prompt.text)
        return ctx, ctx[1:], tokenizer.encode(prompt.text, add_eos=prompt.text.endswith("\n"))
    enc = tokenizer.encode(prompt.text)
    return [tokenizer.eos_id] + enc.ids, enc.ids, enc


def text_offsets(text: str, tokens: Sequence[str], sources: Sequence[str]) -> list[int]:
    """Where each token of a text prompt starts in ``text`` (see the module docstring), from the sources the
    tokenizer kept: each line is searched left to right, in its NFC form (the tokenizer's)."""
    lines = text.split("\n")
    out, line_no, start, pos = [], 0, 0, 0
    line = unicodedata.normalize("NFC", lines[0])
    for tok, src in zip(tokens, sources, strict=True):
        if tok == EOS and not src:
            out.append(min(start + len(line), len(text)))
            start += len(lines[line_no]) + 1
            line_no += 1
            line, pos = (unicodedata.normalize("NFC", lines[line_no]) if line_no < len(lines) else ""), 0
            continue
        found = line.find(src, pos) if src else -1
        if found >= 0:
            pos = found
        out.append(min(start + pos, len(text)))
        if found >= 0:
            pos += len(src)
    return out


#: a prompt opened for reading: (context ids, echoed ids, encoding or None), :func:`_context`'s
Opened = tuple[list[int], list[int], Any]


@dataclass
class Choice:
    """One choice being built: its text, the reported tokens and where the stream has got to."""

    index: int
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)  # in ``text``; reported plus ``shift``
    shift: int = 0  # what precedes ``text`` in the string the offsets index: the prompt, when it is not echoed
    generated_at: list[int] = field(default_factory=list)  # where each generated token's own text starts in ``text``
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finished: bool = False
    sent: int = 0  # characters of ``text`` already streamed
    sent_tokens: int = 0
    closed: bool = False  # its last chunk was streamed

    def logprobs(self, since: int = 0) -> dict[str, Any]:
        return {"tokens": self.tokens[since:], "token_logprobs": self.token_logprobs[since:],
                "top_logprobs": self.top_logprobs[since:],
                "text_offset": [o + self.shift for o in self.text_offset[since:]]}


class CompletionRun:
    """A completion request being computed on one model, a slice of work per :meth:`advance`.

    Non-streamed: :meth:`reply` once :attr:`done`. Streamed: each :meth:`advance` returns the server-sent events
    it produced (``data: {...}`` chunks, at the end ``data: [DONE]``)."""

    def __init__(self, model: Any, request: CompletionRequest, created: int | None = None):
        self.model, self.request = model, request
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time()) if created is None else created
        self.choices = [Choice(i) for i in range(len(request.prompts))]
        self.done = False
        self.positions = PROMPT_SLICE
        self._work: Iterator[None] | None = None

    # the work ------------------------------------------------------------------------------------------------
    def steps(self, positions: int = PROMPT_SLICE) -> Iterator[bytes | None]:
        """The work, one slice per item (for a scheduler: at most ``positions`` prompt tokens or one generated
        token each). Streamed, each item is the events that slice produced and the return value the last ones (the
        finish, usage, ``[DONE]``); otherwise each item is ``None`` and the return value the whole reply."""
        self.positions = max(1, int(positions))
        stream = self.request.stream
        for choice, prompt in zip(self.choices, self.request.prompts, strict=True):
            for _ in self._one(choice, prompt):
                yield self.events() if stream else None
            choice.finished = True
        self.done = True
        return self.events() if stream else self.reply()

    def advance(self) -> bytes:
        """One slice of work; the events it produced when streamed (else ``b""``)."""
        if self._work is None:
            self._work = self.steps()
        try:
            out = next(self._work)
        except StopIteration as finished:
            out = finished.value
        return out if self.request.stream else b""

    @torch.no_grad()
    def _one(self, choice: Choice, prompt: Prompt) -> Iterator[None]:
        """One prompt: its context read in slices (each reported when asked), then its tokens generated."""
        req, runner = self.request, self.model.runner
        ctx, echoed, enc = self._open(choice, prompt)
        state, device = runner.init_state(1), device_of(runner)
        if req.max_tokens > 0 or self.reports:  # the model reads ctx[:-1]; the last id is the first step's input
            for start in range(0, len(ctx) - 1, self.positions):
                piece = ctx[start:min(start + self.positions, len(ctx) - 1)]
                logits, state = runner.forward(torch.tensor([piece], dtype=torch.long, device=device), state)
                if self.reports:
                    self._report(choice, logits[0], ctx[start + 1:start + 1 + len(piece)])
                yield
        if req.echo:
            self._echo_text(choice, prompt, echoed, enc)
        yield from self._generate(choice, prompt, ctx, state)

    @property
    def reports(self) -> bool:
        """Whether the prompts' tokens are reported (echo with logprobs): only then does reading them need the
        model when nothing is generated."""
        return self.request.echo and self.request.logprobs is not None

    def _open(self, choice: Choice, prompt: Prompt, opened: Opened | None = None) -> Opened:
        """A prompt's context, echoed ids and encoding (:func:`_context`, unless ``opened`` has them), its token count
        and, where reported, a literal first id (it has no context: no log-probability)."""
        ctx, echoed, enc = opened or self._opened(choice.index)
        choice.prompt_tokens = len(echoed)
        if prompt.text is None and self.reports:
            self._add(choice, ctx[0], None, None)
        return ctx, echoed, enc

    def _opened(self, k: int) -> Opened:
        """Prompt ``k``'s :func:`_context`, as the request was parsed with it where it was."""
        req = self.request
        return req.opened[k] if req.opened else _context(req.prompts[k], self.model.tokenizer, req.max_tokens)

    def read_from(self, opened: list[Opened], logits: list[torch.Tensor]) -> Any:
        """The whole work of a request that generates nothing, from its prompts' :func:`_context` and, when
        :attr:`reports`, each prompt's ``[len(context) - 1, V]`` logits computed elsewhere: what :meth:`steps`
        returns, for :func:`read_together`."""
        for k, (choice, prompt) in enumerate(zip(self.choices, self.request.prompts, strict=True)):
            ctx, echoed, enc = self._open(choice, prompt, opened[k])
            if self.reports:
                self._report(choice, logits[k], ctx[1:])
            if self.request.echo:
                self._echo_text(choice, prompt, echoed, enc)
            choice.finish_reason, choice.finished = "length", True
        self.done = True
        return self.events() if self.request.stream else self.reply()

    def _report(self, choice: Choice, logits: torch.Tensor, targets: list[int]) -> None:
        """Each target's log-probability and the top alternatives at its position, the target among them (``k`` or
        ``k + 1`` entries), from one float32 softmax (so a target's entry equals its ``token_logprobs`` exactly)."""
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()
        k = self.request.logprobs or 0
        vocab = self.model.tokenizer.vocab
        own = logp.gather(1, torch.tensor(targets, dtype=torch.long).view(-1, 1)).view(-1).tolist()
        if k:  # (the most likely token alone: a max, several times faster than topk over the vocabulary)
            top = logp.max(dim=-1, keepdim=True) if k == 1 else torch.topk(logp, k, dim=-1)
            values, indices = top.values.tolist(), top.indices.tolist()
        for t, target in enumerate(targets):
            alts = {vocab[i]: v for v, i in zip(values[t], indices[t], strict=True)} if k else {}
            alts.setdefault(vocab[target], own[t])  # the token itself is always there (as vLLM)
            self._add(choice, target, own[t], alts)

    def _add(self, choice: Choice, idx: int, logprob: float | None, alts: dict[str, float] | None) -> None:
        choice.tokens.append(self.model.tokenizer.vocab[idx])
        choice.token_logprobs.append(logprob)
        choice.top_logprobs.append(alts)

    def _echo_text(self, choice: Choice, prompt: Prompt, echoed: list[int], enc: Any) -> None:
        """The prompt as text, and its tokens' offsets when they are reported."""
        if prompt.text is not None:
            choice.text = prompt.text
            offsets = text_offsets(prompt.text, enc.tokens + [EOS] * (len(echoed) - len(enc.tokens)),
                                   enc.sources + [""] * (len(echoed) - len(enc.tokens)))
        else:
            pieces = Detokenizer(self.model.tokenizer)
            offsets = []
            for idx in echoed:
                piece = pieces.piece(idx)
                offsets.append(len(choice.text) + _lead(piece, self.model.tokenizer, idx))
                choice.text += piece
        if self.request.logprobs is not None:
            choice.text_offset = offsets

    def _generate(self, choice: Choice, prompt: Prompt, ctx: list[int], state: Any) -> Iterator[None]:
        """The tokens after the prompt, from :func:`zoo.generation.generate_steps` (the one loop and sampling rule)
        and spaced by :class:`~zoo.generation.Detokenizer` after the prompt's text; here only their report and the
        stop sequences."""
        req, tok = self.request, self.model.tokenizer
        choice.finish_reason = "length"
        if req.max_tokens == 0:
            return
        shown = prompt.text if prompt.text is not None else "".join(map(Detokenizer(tok).piece, prompt.ids))
        pieces = Detokenizer(tok, before=shown)
        choice.shift = 0 if req.echo else len(shown)
        generated = ""
        base = len(choice.text)
        for nxt, row in generate_steps(self.model.runner, Sampler(tok, req.sampling, list(ctx)), state,
                                       req.max_tokens):
            piece = pieces.piece(nxt)
            choice.generated_at.append(base + len(generated) + _lead(piece, tok, nxt))
            generated += piece
            choice.completion_tokens += 1
            if req.logprobs is not None:
                self._report(choice, row[None], [nxt])
                choice.text_offset.append(choice.generated_at[-1])
            cut = _stop_at(generated, req.stop)
            if cut is not None:
                choice.text = choice.text[:base] + generated[:cut]
                choice.finish_reason = "stop"
                self._trim(choice, base + cut)
                return
            choice.text = choice.text[:base] + generated
            yield

    def _trim(self, choice: Choice, end: int) -> None:
        """Cut the generated tokens with the text at a stop sequence: a token whose own text starts at or after
        ``end`` is not in the text, so it is neither reported nor counted in ``usage``."""
        drop = sum(1 for o in choice.generated_at if o >= end)
        choice.completion_tokens -= drop
        if drop and self.request.logprobs is not None:
            del choice.tokens[-drop:], choice.token_logprobs[-drop:], choice.top_logprobs[-drop:]
            del choice.text_offset[-drop:]

    # the reply -----------------------------------------------------------------------------------------------
    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.request.model}

    def usage(self) -> dict[str, int]:
        p = sum(c.prompt_tokens for c in self.choices)
        c = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def reply(self) -> dict[str, Any]:
        """The whole (non-streamed) reply in OpenAI's shape."""
        want = self.request.logprobs is not None
        choices = [{"index": c.index, "text": c.text, "logprobs": c.logprobs() if want else None,
                    "finish_reason": c.finish_reason} for c in self.choices]
        out = {**self._head(), "choices": choices, "usage": self.usage()}
        if self.request.warnings:
            out["warnings"] = list(self.request.warnings)
        return out

    def events(self) -> bytes:
        """What the stream has not sent yet: each choice's new text (a tail that could still become a stop sequence
        is held back until it cannot) with its tokens' log-probabilities, its finish, then usage and ``[DONE]``."""
        out, want = [], self.request.logprobs is not None
        for c in self.choices:
            if c.closed:
                continue
            end = len(c.text) if c.finished else _safe_end(c.text, c.sent, self.request.stop)
            n_tok = len(c.tokens) if c.finished else sum(1 for o in c.text_offset if o < end)
            if end > c.sent or c.finished:
                logprobs = {k: v[: n_tok - c.sent_tokens] for k, v in c.logprobs(c.sent_tokens).items()}
                chunk = {"index": c.index, "text": c.text[c.sent:end], "logprobs": logprobs if want else None,
                         "finish_reason": c.finish_reason if c.finished else None}
                out.append(_sse({**self._head(), "choices": [chunk]}))
                c.sent, c.sent_tokens, c.closed = end, n_tok, c.finished
        if self.done:
            if self.request.include_usage:
                out.append(_sse({**self._head(), "choices": [], "usage": self.usage()}))
            out.append(b"data: [DONE]\n\n")
        return b"".join(out)


def read_together(model: Any, runs: list[CompletionRun]) -> list[Any]:
    """Requests that generate nothing (:meth:`CompletionRun.read_from`), all their reported prompts read as rows of
    batched model calls: each request's result, or the exception it alone raised."""
    tok = model.tokenizer
    opened = [[run._opened(k) for k in range(len(run.request.prompts))] for run in runs]
    reads = [ctx[:-1] for run, prompts in zip(runs, opened, strict=True) if run.reports for ctx, _, _ in prompts]
    logits = iter(batched_logits(model.runner, reads, tok.eos_id, len(tok)))
    out: list[Any] = []
    for run, prompts in zip(runs, opened, strict=True):
        mine = [next(logits) for _ in prompts] if run.reports else []
        try:
            out.append(run.read_from(prompts, mine))
        except ZooError as e:
            out.append(e)
        except Exception as e:  # a bug: this request alone fails
            log.exception("reading a completion's prompts failed")
            out.append(e)
    return out


@torch.no_grad()
def batched_logits(runner: Any, rows: list[list[int]], pad: int, vocab: int) -> list[torch.Tensor]:
    """Each row's logits ``[len(row), vocab]`` from the initial state: rows sorted by length and right-padded into
    batches of at most :data:`zoo.scoring.LOGIT_BUDGET` logits (the model is causal: padding after a row's end changes
    its numbers only by float summation order, as the Python API's own batching does)."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    group: list[int] = []

    def run(group: list[int]) -> None:
        longest = max(len(rows[i]) for i in group)
        if not longest:
            for i in group:
                out[i] = torch.empty(0, vocab)
            return
        x = torch.full((len(group), longest), pad, dtype=torch.long)
        for j, i in enumerate(group):
            x[j, :len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
        logits, _ = runner.forward(x.to(device_of(runner)), runner.init_state(len(group)))
        for j, i in enumerate(group):
            out[i] = logits[j, :len(rows[i])]

    for i in sorted(range(len(rows)), key=lambda i: len(rows[i])):
        if group and (len(group) + 1) * len(rows[i]) * vocab > LOGIT_BUDGET:
            run(group)
            group = []
        group.append(i)
    if group:
        run(group)
    return [t for t in out if t is not None]


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + to_json(obj) + b"\n\n"


def _lead(piece: str, tokenizer: Tokenizer, idx: int) -> int:
    """The space :class:`~zoo.generation.Detokenizer` put before a token's own text (0 or 1 character)."""
    return len(piece) - len(tokenizer.token_text(idx))


def _stop_at(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop sequence starts in the generated text, if one occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _safe_end(text: str, sent: int, stops: Sequence[str]) -> int:
    """How much of ``text`` can be streamed now: all but a tail that could still become a stop sequence."""
    end = len(text)
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if s.startswith(text[len(text) - k:]):
                end = min(end, len(text) - k)
                break
    return max(end, sent)


# -- the dialect -------------------------------------------------------------------------------------------------
class OpenAIDialect:
    """OpenAI's completions API for the one model this worker serves (:class:`~zoo.api.dialects.Dialect`): a request
    becomes a :class:`CompletionRequest` run by a :class:`CompletionRun`; replies and errors are OpenAI's shapes, a
    stream is server-sent events ending with ``data: [DONE]``."""

    def __init__(self, service: Any, served: str):
        self.service, self.served = service, served

    def parse(self, raw: Any, content_type: str, limits: Any) -> CompletionRequest:
        media = (content_type or "").split(";")[0].strip().lower()
        if media not in ("", JSON_TYPE):
            raise InvalidRequest("Content-Type", f"unsupported {media[:40]!r}; send application/json")
        try:
            text = bytes(raw).decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
        except UnicodeDecodeError as e:
            raise InvalidRequest("body", f"not valid UTF-8 (byte {e.start})") from None
        if not isinstance(text, str):
            raise InvalidRequest("body", "send a JSON object (Content-Type: application/json)")
        return parse_completion(decode_json(text), self.service.model.tokenizer, limits, served=self.served)

    def generates(self, request: CompletionRequest) -> bool:
        return request.max_tokens > 0

    def work(self, request: CompletionRequest, step_tokens: int) -> Work:
        """Its budgets were checked as it was parsed; long when it generates or its prompts' tokens are over one
        step (else it can share a model call with others: :meth:`run_together`)."""
        long = request.max_tokens > 0 or request.prompt_tokens > step_tokens
        run = CompletionRun(self.service.model, request)
        return Work(run.steps(step_tokens), long, together=None if long else run)

    def run_together(self, items: list[CompletionRun]) -> list[Any]:
        """Requests that read one step of prompt tokens and generate nothing, in batched model calls
        (:func:`read_together`)."""
        return read_together(self.service.model, items)

    def content_type(self, request: CompletionRequest) -> str:
        return SSE_TYPE if request.stream else JSON_TYPE

    def error(self, err: Exception | None, what: str = "completion") -> tuple[int, dict[str, Any]]:
        return openai_error_of(err, what)

    def chunk(self, job: Any, fresh: list[Any]) -> bytes:
        """A stream's new events (an error once events went out is one more ``data: {"error": ...}`` event and
        ``[DONE]``); otherwise nothing until the whole reply (an error after the 200 status line is its body)."""
        stream = job.request.stream
        if job.error is not None:
            body = to_json(self.error(job.error, "completion")[1])
            return b"".join(fresh) + b"data: " + body + b"\n\ndata: [DONE]\n\n" if stream else body
        if stream:
            return b"".join(fresh) + (job.result if job.done else b"")
        return to_json(job.result) if job.done else b""
