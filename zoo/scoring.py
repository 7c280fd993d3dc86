"""Exact, stateful scoring of text and corpora.

Conventions (the same for every architecture and backend):

* Each text is scored from a zero state, its first token conditioned on one ``<eos>`` (the
  sentence boundary the corpora use), and every token of the text, including the ``<eos>`` that
  ends each line, is scored exactly once. An empty text is one line end: it scores a single ``<eos>``
  (in Python; the CLI and the servers refuse empty input, where it is more likely a mistake than a question).
* Long inputs are processed in chunks with the hidden state carried across chunks and no window
  overlap, so the result equals one pass over the whole text while memory stays bounded.
* Log base e (nats). Two bit rates, never one name for both: ``bits_per_token = avg_nll / ln 2`` per
  predicted token (for a character model, per predicted symbol: the "bits per character" of its card and
  of the papers) and ``bits_per_input_char = nll / (ln 2 * characters of the raw input text)``; aggregates are
  token-weighted (not a mean of per-text perplexities).
* Comparing models that tokenise differently (a word and a character model, two vocabularies): the one rate for
  that is ``bits_per_input_char_charged`` (:func:`input_char_bits`, defined here and nowhere else). The plain
  ``bits_per_input_char`` divides by the same characters but not the same work: a word model that turned a word
  into ``<unk>`` predicted only a cheap class, and a model that dropped a character (PTB's punctuation) predicted
  nothing for it. The charged rate adds :data:`UNSEEN_CHAR_BITS` for every input character a model did not
  predict exactly (``num_unseen_chars``: the characters of its ``<unk>`` words or characters and the ones it
  dropped), so knowing fewer words can no longer look better.

Everything here talks to a *runner*: an object with ``init_state(batch)`` and
``forward(tokens [B, T], state) -> (logits [B, T, V], state)``. The eager :class:`zoo.lm.LanguageModel`
is one; the TorchScript and ONNX Runtime backends are others. Token tensors are made on the runner's
``device`` (:func:`zoo.device.device_of`; the CPU for the exports), and what is summed comes back as float64.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor
from tqdm.auto import tqdm

from zoo.data import PAD_TARGET, batchify, pad_batch
from zoo.device import device_of
from zoo.dynamic import DynamicParams, GradStats, dynamic_logprobs
from zoo.models._fused_loss import logits_target_logprobs
from zoo.tokenizer import Tokenizer

T = TypeVar("T")
#: A computation cut into bounded steps: it yields ``None`` after each step and returns its result (a server runs
#: the steps of several requests in turn, :mod:`zoo.api.scheduler`; :func:`run_steps` runs them all at once).
Steps = Generator[None, None, T]

LN2 = math.log(2.0)
#: Upper bound on logits held at once (floats), which bounds memory for any text length.
LOGIT_BUDGET = 1 << 24
#: Warn when more than this share of a text's scored tokens is ``<unk>`` (word models) or characters outside the
#: alphabet (character models). The corpora's own test splits have 6.1% (PTB) and 6.3% (WikiText-2) ``<unk>``
#: words: four times that means the model knows little of the text, and predicting ``<unk>`` is easy, so the
#: perplexity flatters it (German input to the PTB model: 13 of 14 tokens ``<unk>``, perplexity 8.6).
UNK_SHARE_WARNING = 0.25
#: The cost, in bits, of an input character a model did not predict exactly (inside an ``<unk>``, or dropped), in
#: ``bits_per_input_char_charged``: one byte sent with no model at all. A model-free price that any model fitted
#: to text beats (uniform guessing over PTB-char's 50 symbols costs log2(50) = 5.6 bits), so on words a word model
#: does not know, a character model that spells them better than chance always compares better.
UNSEEN_CHAR_BITS = 8.0


class Runner(Protocol):
    """What scoring talks to. A runner may also have ``target_logprobs(tokens, targets, state) -> (log p [B, T],
    state)``, the targets' log-probabilities without handing over the logits (the eager model's fused decoder,
    :meth:`zoo.lm.LanguageModel.target_logprobs`); :func:`target_logprobs` uses it where it exists."""

    def init_state(self, batch_size: int) -> tuple[Tensor, ...]: ...

    def forward(self, tokens: Tensor, state: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]: ...


def target_logprobs(runner: Runner, tokens: Tensor, targets: Tensor,
                    state: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``(log p(targets) [B, T] float32, state)`` from any runner: its own ``target_logprobs`` where it has one,
    else its logits' float32 log-softmax. Targets outside the vocabulary (padding) give values to be masked."""
    own = getattr(runner, "target_logprobs", None)
    if own is not None:
        return own(tokens, targets, state)
    logits, state = runner.forward(tokens, state)
    return logits_target_logprobs(logits, targets), state


@dataclass
class ScoreReport:
    """Per-text results (dicts with the documented fields) plus a token-weighted corpus aggregate."""

    texts: list[dict[str, Any]]
    corpus: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.texts[i]

    def __len__(self) -> int:
        return len(self.texts)

    def to_dict(self) -> dict[str, Any]:
        return {"texts": self.texts, "corpus": self.corpus}


def _exp(x: float) -> float:
    """``exp(x)``, infinite past float64's range (a diverged model or a dynamic-evaluation lr that blew up the
    weights has a mean NLL over ~709 nats; ``math.exp`` would raise OverflowError instead of reporting it)."""
    return math.exp(x) if x < 709.0 else (float("inf") if x == x else x)


def summarize(nll: float, num_tokens: int, num_chars: int | None, num_unseen_chars: int = 0) -> dict[str, Any]:
    """The metric fields shared by per-text results, aggregates and corpus evaluation (``num_chars=None``: a
    corpus split, which has tokens but no raw text, so no rate per input character)."""
    avg = nll / num_tokens if num_tokens else float("nan")
    out = {
        "num_tokens": num_tokens,
        "nll": nll,
        "avg_nll": avg,
        "ppl": _exp(avg) if num_tokens else float("nan"),
        "bits_per_token": avg / LN2 if num_tokens else float("nan"),
    }
    return out if num_chars is None else out | input_char_bits(nll, num_chars, num_unseen_chars)


def input_char_bits(nll: float, num_chars: int, num_unseen_chars: int) -> dict[str, float | None]:
    """The two rates per input character (``None`` for an empty text): plain, and charged for what the model could
    not see (:data:`UNSEEN_CHAR_BITS` per character in ``num_unseen_chars``), the one that compares models that
    tokenise differently (see the module docstring)."""
    if not num_chars:
        return {"bits_per_input_char": None, "bits_per_input_char_charged": None}
    return {"bits_per_input_char": nll / (LN2 * num_chars),  # (this order: the recorded cards' exact floats)
            "bits_per_input_char_charged": (nll / LN2 + UNSEEN_CHAR_BITS * num_unseen_chars) / num_chars}


def unseen_chars(enc: Any) -> int:
    """Input characters an encoding does not let the model predict exactly: those of its out-of-vocabulary items
    (scored as ``<unk>``, or spelled ``< u n k >`` by a character model) and those the normalisation dropped."""
    return sum(len(item) for item in enc.oov_items) + sum(len(d) for d in enc.dropped)


def _chunk_len(batch: int, vocab: int, cap: int = 256) -> int:
    return max(1, min(cap, LOGIT_BUDGET // max(1, batch * vocab)))


def run_steps(steps: Steps[T]) -> T:
    """The result of a stepped computation, all its steps run now."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def token_logprobs(runner: Runner, sequences: list[list[int]], bos_id: int, vocab_size: int) -> list[Tensor]:
    """Log-probability of every token of every sequence (one float64 tensor per sequence).

    Sequences are right-padded into one batch; an RNN is causal, so padding after a sequence's end
    cannot change its scores, and batched scores equal one-at-a-time scores to float tolerance.
    """
    return run_steps(token_logprob_steps(runner, sequences, bos_id, vocab_size))


@torch.no_grad()
def token_logprob_steps(runner: Runner, sequences: list[list[int]], bos_id: int, vocab_size: int,
                        step_tokens: int | None = None) -> Steps[list[Tensor]]:
    """:func:`token_logprobs` one chunk of columns per step, the state carried across chunks (the same numbers:
    this is how a long text is always scored); a step covers at most ``step_tokens`` tokens (rows x columns: its
    time, mostly the decoder's), so a server can interleave one request's long texts with other requests' work.
    It yields *between* chunks, never after the last: a request that fits one step is done in one."""
    bsz = len(sequences)
    longest = max(len(s) for s in sequences)
    tgt = torch.full((bsz, longest), bos_id, dtype=torch.long)
    for b, seq in enumerate(sequences):
        tgt[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    inp = torch.cat([torch.full((bsz, 1), bos_id, dtype=torch.long), tgt[:, :-1]], dim=1)
    device = device_of(runner)
    inp, tgt = inp.to(device), tgt.to(device)
    state = runner.init_state(bsz)
    out = torch.empty(bsz, longest, dtype=torch.float64)
    step = _chunk_len(bsz, vocab_size)
    if step_tokens is not None:
        step = max(1, min(step, step_tokens // bsz))
    for start in range(0, longest, step):
        if start:
            yield
        logp, state = target_logprobs(runner, inp[:, start:start + step], tgt[:, start:start + step], state)
        out[:, start:start + step] = logp.double().cpu()
    return [out[b, : len(seq)] for b, seq in enumerate(sequences)]


def score_texts(runner: Runner, tokenizer: Tokenizer, texts: list[str], *, return_tokens: bool = False,
                batch_size: int = 16, progress: bool = False, dynamic: DynamicParams | None = None,
                dynamic_stats: GradStats | None = None) -> ScoreReport:
    """Score raw texts; see the module docstring for exactly what is counted. With ``dynamic``, each text is
    scored by dynamic evaluation (:mod:`zoo.dynamic`: a copy of the model adapts within the text, the model itself
    is never written), one text at a time; ``runner`` must then be the eager model, and ``dynamic_stats`` its
    gradient statistics when the rule needs them (``rule="rms"``)."""
    encs = [tokenizer.encode(t) for t in texts]
    if dynamic is not None:
        if not isinstance(runner, torch.nn.Module):
            raise ValueError("dynamic evaluation needs the eager model (backend 'eager', precision fp32)")
        logps: list[Tensor] = []
        for enc in tqdm(encs, desc="scoring", unit="text", disable=not progress or len(encs) < 2):
            ids = torch.tensor(enc.ids, dtype=torch.long)
            inputs = torch.cat([ids.new_tensor([tokenizer.eos_id]), ids[:-1]])
            logps.append(dynamic_logprobs(runner, inputs, ids, dynamic, stats=dynamic_stats))
        return report_of(texts, encs, logps, tokenizer, return_tokens)
    return run_steps(score_steps(runner, tokenizer, texts, return_tokens=return_tokens, batch_size=batch_size,
                                 progress=progress, encodings=encs))


def length_batches(lengths: Sequence[int], batch_size: int = 16) -> list[list[int]]:
    """How :func:`score_steps` batches texts of these token lengths: their indices sorted by length, in groups of
    ``batch_size``; each group is computed padded to its longest text."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def padded_positions(lengths: Sequence[int], batch_size: int = 16) -> int:
    """The positions :func:`score_steps` computes for texts of these token lengths (each group of
    :func:`length_batches` is as many rows as texts, as long as its longest): what a request's work is, where its
    token count is not (15 one-word texts beside a long one cost 16 long ones)."""
    return sum(len(group) * max(lengths[i] for i in group) for group in length_batches(lengths, batch_size))


def score_steps(runner: Runner, tokenizer: Tokenizer, texts: list[str], *, return_tokens: bool = False,
                batch_size: int = 16, step_tokens: int | None = None, progress: bool = False,
                encodings: list[Any] | None = None) -> Steps[ScoreReport]:
    """:func:`score_texts` (without dynamic evaluation) as steps of at most ``step_tokens`` tokens each (rows x
    columns; None: the memory budget's chunks), yielding between them. Only ``texts`` are
    batched together (sorted by length, in groups of ``batch_size``), so whoever calls this for one request never
    pads its texts to another request's.
    ``encodings``: the texts' :meth:`Tokenizer.encode`, when the caller already has them (a token budget)."""
    encs = encodings if encodings is not None else [tokenizer.encode(t) for t in texts]
    logps: list[Tensor | None] = [None] * len(encs)
    batches = length_batches([len(e.ids) for e in encs], batch_size)
    for k, idx in enumerate(tqdm(batches, desc="scoring", unit="batch", disable=not progress or len(batches) < 2)):
        if k:
            yield
        group = yield from token_logprob_steps(runner, [encs[i].ids for i in idx], tokenizer.eos_id, len(tokenizer),
                                               step_tokens)
        for i, lp in zip(idx, group, strict=True):
            logps[i] = lp
    return report_of(texts, encs, logps, tokenizer, return_tokens)


def report_of(texts: list[str], encs: list[Any], logps: list[Tensor | None], tokenizer: Tokenizer,
              return_tokens: bool) -> ScoreReport:
    """The report of scored texts, from their encodings and every token's log-probability."""
    results = []
    for text, enc, lp in zip(texts, encs, logps, strict=True):
        assert lp is not None
        res = summarize(float(lp.sum().neg()), len(enc.ids), enc.num_chars, unseen_chars(enc))
        res["oov"] = enc.oov
        res["num_unk"] = tokenizer.count_unk(enc)
        if enc.oov_items:
            res["oov_items"] = sorted(set(enc.oov_items))[:50]
        res["num_dropped"] = sum(len(d) for d in enc.dropped)
        if enc.dropped:
            res["dropped_items"] = sorted(set(enc.dropped))[:50]
        res["num_visible_chars"] = sum(1 for ch in text if not ch.isspace())
        res["num_unseen_chars"] = unseen_chars(enc)
        res["warnings"] = warnings_for(res, tokenizer)
        if return_tokens:
            res["tokens"] = [{"token": t, "id": i, "logprob": float(v)}
                             for t, i, v in zip(enc.tokens, enc.ids, lp.tolist(), strict=True)]
        results.append(res)
    return ScoreReport(results, aggregate(results, sum(e.num_chars for e in encs), tokenizer))


#: The per-text counts that add up over texts (a corpus aggregate, a shard's sums): written once for every caller.
COUNT_FIELDS = ("oov", "num_unk", "num_dropped", "num_visible_chars", "num_unseen_chars")


def aggregate(results: list[dict[str, Any]], num_chars: int, tokenizer: Tokenizer) -> dict[str, Any]:
    """The token-weighted aggregate of per-text results (``num_chars``: the texts' raw characters), with its own
    warnings: a corpus's numbers are never the mean of per-text perplexities."""
    corpus = summarize(sum(r["nll"] for r in results), sum(r["num_tokens"] for r in results), num_chars,
                       sum(r["num_unseen_chars"] for r in results))
    corpus["num_texts"] = len(results)
    for key in COUNT_FIELDS:
        corpus[key] = sum(r[key] for r in results)
    corpus["warnings"] = warnings_for(corpus, tokenizer)
    return corpus


def warnings_for(res: dict[str, Any], tokenizer: Tokenizer) -> list[str]:
    """Where the number misleads: a high share of ``<unk>`` / out-of-alphabet tokens, or of input characters the
    normalisation dropped (both over :data:`UNK_SHARE_WARNING`)."""
    out = []
    unk = res["num_unk"]
    # a character model spells an unknown character as the five symbols of <unk>: its share is one of the input's
    # characters, not of the scored symbols (of which it could never pass a fifth)
    n, unit, what = ((res.get("num_visible_chars", 0), "characters", "outside the model's alphabet")
                     if tokenizer.is_char else (res["num_tokens"], "tokens", "<unk> (unknown to the model)"))
    if n and unk / n > UNK_SHARE_WARNING:
        out.append(f"{unk} of {n} {unit} ({unk / n:.0%}) are {what}: above {UNK_SHARE_WARNING:.0%}, the text is "
                   "largely outside what the model was trained on and its perplexity means little")
    dropped, visible = res.get("num_dropped", 0), res.get("num_visible_chars", 0)
    if visible and dropped / visible > UNK_SHARE_WARNING:
        out.append(f"{dropped} of {visible} characters ({dropped / visible:.0%}) were dropped (not scored): the "
                   "model's corpus has no such characters (PTB removed punctuation), so the score covers only the "
                   "rest of the text")
    return out


class _Nll:
    """The NLL ``0 - lp_1 - lp_2 - ...`` (float64) of chunks' summed log-probabilities, kept on the scoring device:
    on a GPU, reading each chunk's sum back would make the host wait for every chunk. The subtractions are the
    ones a Python float would do, so the number is the same bit for bit."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)

    def sub(self, logprob_sum: Tensor) -> None:
        self.total -= logprob_sum.to(self.total.device)

    def value(self) -> float:
        return float(self.total)


@torch.no_grad()
def evaluate_stream(runner: Runner, stream: Tensor, batch_size: int = 10, bptt: int = 70,
                    progress: bool = True, desc: str = "eval", vocab_size: int | None = None) -> dict[str, Any]:
    """Standard corpus perplexity (AWD-LSTM / aLSTM protocol, without its off-by-one).

    The stream is cut into ``batch_size`` contiguous columns; the state starts at zero and is
    carried across ``bptt``-long chunks; every next-token prediction of every column is counted once.
    ``vocab_size``: when given, a ``bptt`` chunk whose logits would pass ``4 * LOGIT_BUDGET`` floats is run in
    shorter pieces (the state is carried, so the numbers are the same up to float summation order; a huge
    ``bptt`` would otherwise ask for the whole split's logits at once).
    """
    max_rows = max(1, 4 * LOGIT_BUDGET // (batch_size * vocab_size)) if vocab_size else bptt
    data = batchify(stream, batch_size).to(device_of(runner))
    state = runner.init_state(batch_size)
    nll, count = _Nll(data.device), 0
    for i in tqdm(range(0, data.shape[0] - 1, bptt), desc=desc, unit="chunk", disable=not progress,
                  leave=False):
        seq = min(bptt, data.shape[0] - 1 - i)
        for j in range(i, i + seq, step := min(seq, max_rows)):
            n = min(step, i + seq - j)
            x, y = data[j:j + n].t(), data[j + 1:j + 1 + n].t()
            logp, state = target_logprobs(runner, x, y, state)
            nll.sub(logp.sum(dtype=torch.float64))
            count += y.numel()
    res = summarize(nll.value(), count, None)
    res.update(batch_size=batch_size, bptt=bptt)
    return res


@torch.no_grad()
def evaluate_sentences(runner: Runner, seqs: list[Tensor], batch_size: int = 32, pad_id: int = 0,
                       progress: bool = True, desc: str = "eval") -> dict[str, Any]:
    """Sentence-level perplexity / bits per symbol: every sequence scored from a zero state on its own.

    Counted: exactly the predicted symbols of every sequence (its tokens after the leading ``<eos>``, and its
    closing ``<eos>`` when the line was not truncated; see :func:`zoo.data.sentences`); padding never counts.
    Sequences are batched in length order (batched scores equal one-at-a-time scores: the model is causal).
    """
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].numel())
    device = device_of(runner)
    nll, count = _Nll(device), 0
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for idx in tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False):
        x, y = pad_batch([seqs[i] for i in idx], pad_id)
        count += int((y != PAD_TARGET).sum())
        x, y = x.to(device), y.to(device)
        logp, _ = target_logprobs(runner, x, y, runner.init_state(len(idx)))
        keep = (y != PAD_TARGET).to(logp.device)
        nll.sub(logp.masked_fill(~keep, 0.0).sum(dtype=torch.float64))
    res = summarize(nll.value(), count, None)
    res.update(batch_size=batch_size, mode="sentences", num_sequences=len(seqs))
    return res
