"""Dynamic evaluation (Krause et al. 2018, "Dynamic Evaluation of Neural Sequence Models"): scoring that adapts.

A recurrent LM's state carries only so much of a text's history; dynamic evaluation lets the *weights* follow
the text too. The sequence is cut into segments of ``segment`` tokens; each segment is scored first, with the
weights as they are, and only then does the model take one gradient step on that segment's loss (``g``, the
gradient of the segment's mean NLL), so no token is ever scored by weights that have seen it. Two update rules
(``DynamicParams.rule``), both with a decay back to the trained weights ``theta_0`` (the paper's "global prior",
which keeps the adapted weights from drifting over a long text), both computed from the weights before the step:

* ``"sgd"`` (the paper's Eq. 5 with the prior)::

      theta <- theta - lr * g + decay * (theta_0 - theta)

* ``"rms"`` (the paper's Sec. 4 "RMS normalised" rule with an "RMS global prior"): the step is divided by the
  root mean square ``R = sqrt(MS)`` of the gradients the *trained* model has on its training data (collected once,
  :func:`gradient_stats`; from the training split, never from the text being scored), and the decay is stronger
  where the weights are more sensitive::

      theta <- theta - lr * g / (R + eps) + min(1, decay * R / mean(R)) * (theta_0 - theta)

  ``mean(R)`` is the mean over every scalar weight of the model; ``min(1, .)`` keeps a weight from being pulled
  past ``theta_0``. The paper finds it the better of the two; the validation grid here compares them too
  (:data:`DEFAULTS`).

The state is carried across segments (the gradient is truncated at segment boundaries, like BPTT), dropout is off,
and the weights that adapt are a private copy of the model's: the caller's model is never written (a server shares
it between concurrent requests, so adapting it in place and restoring it afterwards would let an overlapping request
see, or keep, half-adapted weights), and scoring the same text twice gives the same numbers. The gradient statistics
are read, never written. Costs a forward and a backward pass per segment at batch 1.

``lr``, ``decay`` and ``segment`` defaults are chosen on the validation split, never on test (:data:`DEFAULTS`
says from what). A model tuned on its own validation split carries its chosen settings in its checkpoint
(``config.json`` ``dynamic_eval``; a setting it leaves out is :data:`DEFAULTS`'), and scoring it with
``dynamic=True`` uses them: the number its card shows is what ``--dynamic`` gives.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from zoo.errors import ConfigError
from zoo.files import write_atomic

#: The update rules of :class:`DynamicParams` (see the module docstring).
RULES = ("sgd", "rms")


#: The longest segment (tokens per update; the paper uses 5): a segment's forward and backward run as one graph.
MAX_SEGMENT = 10_000


#: The largest step size accepted: the tuned values are ~1e-5..1e-4 (RMS) and ~1e-2 (SGD).
MAX_LR = 1.0


@dataclass(frozen=True)
class DynamicParams:
    """Dynamic-evaluation settings.

    ``segment``: tokens per update. ``lr``: step size. ``decay``: the pull towards the trained weights per step
    (for ``rule="rms"`` scaled per weight by ``R / mean(R)`` and clipped at 1). ``rule``: ``"sgd"`` or ``"rms"``.
    ``eps``: added to ``R`` in the RMS step (keeps weights whose training gradients vanish from taking huge
    steps). ``stats_tokens``, ``stats_batch``, ``stats_bptt``: how the RMS rule's gradient statistics are collected
    (the first ``stats_tokens`` tokens of the training split, mini-batches of ``stats_batch`` x ``stats_bptt``,
    the state carried, dropout off); they are part of the statistics' identity (:meth:`stats_key`) and unused by
    ``rule="sgd"``.
    """

    segment: int = 20
    lr: float = 5e-5
    decay: float = 0.001
    rule: str = "rms"
    eps: float = 1e-5
    stats_tokens: int = 100_000
    stats_batch: int = 20
    stats_bptt: int = 70

    def __post_init__(self) -> None:
        for name in ("segment", "stats_tokens", "stats_batch", "stats_bptt"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("lr", "decay", "eps"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not (v >= 0) or v == float("inf"):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.segment > MAX_SEGMENT:  # a segment is one autograd graph at batch 1: bounded memory
            raise ConfigError(f"segment must be at most {MAX_SEGMENT} tokens, got {self.segment}")
        if self.decay > 1:
            raise ConfigError(f"decay must be at most 1, got {self.decay!r}")
        if self.lr > MAX_LR:
            raise ConfigError(f"lr must be at most {MAX_LR:g}, got {self.lr!r}")
        if self.rule not in RULES:
            raise ConfigError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.rule == "rms" and self.eps == 0:
            raise ConfigError("eps must be > 0 with rule 'rms' (it divides by R + eps)")
        if self.rule == "rms" and self.stats_tokens < self.stats_batch * (self.stats_bptt + 1):
            need = self.stats_batch * (self.stats_bptt + 1)  # (each row's inputs and its shifted targets)
            raise ConfigError(f"stats_tokens must be at least {need:,} (one {self.stats_batch} x {self.stats_bptt} "
                              f"mini-batch and its targets), got {self.stats_tokens}")

    @property
    def needs_stats(self) -> bool:
        """Whether scoring needs :func:`gradient_stats` (the RMS rule with a step or a decay)."""
        return self.rule == "rms" and (self.lr > 0 or self.decay > 0)

    def stats_key(self) -> tuple[int, int, int]:
        """What identifies the gradient statistics (for one model): a cache key."""
        return (self.stats_tokens, self.stats_batch, self.stats_bptt)

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)

    def with_changes(self, changes: Mapping[str, Any]) -> DynamicParams:
        """These settings with some replaced: how a model's own settings (a checkpoint's ``dynamic_eval``) and a
        user's options combine. An unknown name is a :class:`ConfigError` naming the known ones (a misspelt setting
        must not be silently ignored); values are checked as in the constructor."""
        if not isinstance(changes, Mapping):
            raise ConfigError(f"dynamic-evaluation settings must be a mapping of names to values, got "
                              f"{type(changes).__name__}")
        unknown = sorted(str(k) for k in changes if k not in _FIELDS)
        if unknown:
            raise ConfigError(f"unknown dynamic-evaluation setting(s) {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(_FIELDS)})")
        return replace(self, **changes)


#: The defaults (see DynamicParams): ``rule="rms"``, ``segment=20``, ``lr=5e-5``, ``decay=0.001``, ``eps=1e-5``,
#: statistics from the first 100k training tokens (batch 20, BPTT 70). Chosen as the lowest PTB *validation*
#: perplexity of ``alstm-ptb-5m-light`` over the grid of ``benchmarks/dynamic_eval.py`` (never on test; every grid
#: point, and the test number of the chosen point only, are in ``benchmarks/results/dynamic_eval.json``, which
#: ``tests/test_dynamic.py`` checks this against). Segment 20 (not the paper's 5) for speed at batch 1; ``eps``
#: and the statistics' settings were not tuned; the best decay was the grid's smallest. A model tuned on its own
#: validation split keeps its settings in its checkpoint (``ZooModel.dynamic_defaults``).
DEFAULTS = DynamicParams()
_FIELDS = tuple(f.name for f in fields(DynamicParams))


@dataclass(frozen=True)
class GradStats:
    """The RMS rule's statistics of one model: ``rms[i] = sqrt(mean over mini-batches of grad_i ** 2)`` for the
    ``i``-th trainable parameter (``lm.parameters()`` order), collected with the trained weights."""

    rms: tuple[Tensor, ...]
    num_tokens: int
    key: tuple[int, int, int]

    def check(self, params_list: list[torch.nn.Parameter]) -> None:
        if len(self.rms) != len(params_list) or any(r.shape != p.shape for r, p in zip(self.rms, params_list,
                                                                                           strict=True)):
            raise ConfigError("gradient statistics do not match this model's parameters")


def save_stats(stats: GradStats, path: str | os.PathLike) -> None:
    """Write ``stats`` to ``path`` atomically as safetensors (``rms.0`` ... in parameter order; the token count and
    key as metadata): :meth:`zoo.zoo_model.ZooModel.dynamic_stats` keeps them on disk, since collecting them
    takes about a minute of CPU for the bundled models and every ``zoo ... --dynamic`` command is a new process."""
    from safetensors.torch import save

    write_atomic(path, save({f"rms.{i}": r.detach().cpu().contiguous() for i, r in enumerate(stats.rms)},
                            metadata={"num_tokens": str(stats.num_tokens), "key": json.dumps(list(stats.key))}))


def load_stats(path: str | os.PathLike, params_list: list[torch.nn.Parameter]) -> GradStats:
    """Statistics written by :func:`save_stats`, checked against the model's parameters (names, count, shapes):
    a :class:`ConfigError` when they do not match; safetensors' or json's own error when the file is not such a
    file. Nothing is unpickled."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta, names = f.metadata() or {}, set(f.keys())
        if names != {f"rms.{i}" for i in range(len(names))}:
            raise ConfigError(f"{path}: not a gradient statistics file (tensor names)")
        rms = tuple(f.get_tensor(f"rms.{i}") for i in range(len(names)))
    stats = GradStats(rms, int(meta["num_tokens"]), tuple(json.loads(meta["key"])))
    stats.check(params_list)
    return stats


def gradient_stats(lm: torch.nn.Module, train: Tensor, params: DynamicParams = DEFAULTS,
                   progress: bool = False) -> GradStats:
    """The RMS rule's gradient statistics of ``lm`` on a training stream (1-D token ids, of the *training* split:
    statistics of the text being scored would leak it): the first ``params.stats_tokens`` tokens in
    ``stats_batch`` columns, ``stats_bptt`` steps per mini-batch, state carried, dropout off, the mean NLL's
    gradient squared and averaged over mini-batches. The weights are not changed."""
    from zoo.data import batchify, get_batch

    if train.dim() != 1:
        raise ConfigError("train must be a 1-D tensor of token ids")
    stream = train[:params.stats_tokens]
    if stream.numel() < params.stats_batch * (params.stats_bptt + 1):
        raise ConfigError(f"{stream.numel()} training tokens are too few for one {params.stats_batch} x "
                         f"{params.stats_bptt} mini-batch")
    params_list = [p for p in lm.parameters() if p.requires_grad]
    device = params_list[0].device if params_list else torch.device("cpu")
    source = batchify(stream, params.stats_batch)
    sq = [torch.zeros_like(p, dtype=torch.float32) for p in params_list]
    was_training = lm.training
    lm.eval()
    state = lm.init_state(params.stats_batch, device)
    batches = 0
    try:
        for i in tqdm(range(0, source.shape[0] - 1, params.stats_bptt), desc="gradient statistics", unit="batch",
                      disable=not progress, leave=False):
            x, y = get_batch(source, i, params.stats_bptt)
            state = tuple(s.detach() for s in state)
            with torch.enable_grad():
                logits, state = lm(x.to(device), state)
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                         y.to(device).reshape(-1))
                grads = torch.autograd.grad(loss, params_list, allow_unused=True)
            for s, g in zip(sq, grads, strict=True):
                if g is not None:
                    s.addcmul_(g.float(), g.float())
            batches += 1
    finally:
        lm.train(was_training)
    rms = tuple(torch.sqrt(s / batches) for s in sq)
    return GradStats(rms, int(source.numel()), params.stats_key())


def dynamic_logprobs(lm: torch.nn.Module, inputs: Tensor, targets: Tensor, params: DynamicParams = DEFAULTS,
                     progress: bool = False, desc: str = "dynamic", stats: GradStats | None = None,
                     cuda_graphs: bool = True) -> Tensor:
    """Log-probability (float64) of every ``targets[t]`` given ``inputs[:t+1]``, for one sequence (1-D tensors of
    equal length), with the weights adapting segment by segment; the model itself is never written (a copy adapts).
    ``stats``: the model's :func:`gradient_stats`, required by ``rule="rms"`` (``ZooModel`` computes them from its
    training split and caches them). On CUDA each segment's step replays from a CUDA graph unless ``cuda_graphs`` is
    false (the same kernels: the same numbers, to float rounding)."""
    if inputs.dim() != 1 or inputs.shape != targets.shape:
        raise ConfigError("inputs and targets must be 1-D tensors of the same length")
    params_list = [p for p in lm.parameters() if p.requires_grad]
    inv_denom: list[Tensor] = []
    decay_rate: list[Tensor] = []
    if params.needs_stats:
        if stats is None:
            raise ConfigError("rule 'rms' needs the model's gradient statistics from its training split "
                             "(zoo.dynamic.gradient_stats; ZooModel computes them)")
        stats.check(params_list)
        total = sum(float(r.double().sum()) for r in stats.rms)
        mean_rms = total / max(1, sum(r.numel() for r in stats.rms))
        if not math.isfinite(mean_rms) or mean_rms <= 0:
            raise ConfigError("gradient statistics are all zero or not finite")
        inv_denom = [1.0 / (r.to(p.device, p.dtype) + params.eps) for r, p in zip(stats.rms, params_list,
                                                                                 strict=True)]
        decay_rate = [(r.to(p.device, p.dtype) * (params.decay / mean_rms)).clamp_(max=1.0)
                      for r, p in zip(stats.rms, params_list, strict=True)]
    seg = params.segment
    adapt = params.lr > 0 or params.decay > 0
    if adapt:  # a private copy adapts (module docstring); its parameters in the order of the statistics
        lm = copy.deepcopy(lm)
        params_list = [p for p in lm.parameters() if p.requires_grad]
    theta0 = [p.detach().clone() for p in params_list]
    was_training = lm.training
    lm.eval()
    out = torch.empty(targets.numel(), dtype=torch.float64)
    device = theta0[0].device if theta0 else torch.device("cpu")
    state = lm.init_state(1, device)

    def segment(x: Tensor, y: Tensor, state: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Score a segment, then take the step on its loss: ``(log p [n], state)``."""
        with torch.enable_grad():
            logits, state = lm(x, state)
            logp = torch.log_softmax(logits[0].float(), dim=-1).gather(1, y[:, None]).squeeze(1)
            grads = torch.autograd.grad(-logp.mean(), params_list, allow_unused=True)
        with torch.no_grad():
            _step(params_list, grads, theta0, params, inv_denom, decay_rate)
        return logp.detach(), tuple(s.detach() for s in state)

    run = _segment_runner(device, cuda_graphs and adapt)
    try:
        for start in tqdm(range(0, targets.numel(), seg), desc=desc, unit="segment", disable=not progress,
                          leave=False):
            x = inputs[start:start + seg].to(device)[None]
            y = targets[start:start + seg].to(device)
            state = state if hasattr(state, "flat") else tuple(s.detach() for s in state)
            if adapt:
                logp, state = run(segment, (x, y), state)
            else:
                with torch.no_grad():
                    logits, state = lm(x, state)
                    logp = torch.log_softmax(logits[0].float(), dim=-1).gather(1, y[:, None]).squeeze(1)
            out[start:start + y.numel()] = logp.double().cpu()
            if adapt and not bool(torch.isfinite(out[start:start + y.numel()]).all()):
                raise ConfigError(f"dynamic evaluation diverged at token {start:,}: the adapted weights are no "
                                  f"longer finite: the steps are too large for this model (lr {params.lr:g}"
                                  f"{f', eps {params.eps:g}' if params.rule == 'rms' else ''}); try a smaller lr")
    finally:
        lm.train(was_training)
    return out


def _segment_runner(device: torch.device, graphs: bool) -> Any:
    """How a segment step runs: replayed from CUDA graphs on a GPU (:mod:`zoo.captured_inference`: a segment is a
    forward, a backward and an update of small kernels, launch-bound at batch 1), else called as it is."""
    if graphs and device.type == "cuda":
        from zoo.captured_inference import CapturedCalls

        calls = CapturedCalls(device)
        return lambda fn, inputs, state: calls("dynamic", fn, inputs, state)
    return lambda fn, inputs, state: fn(*inputs, state)


def _step(params_list: list[torch.nn.Parameter], grads: tuple[Tensor | None, ...], theta0: list[Tensor],
          params: DynamicParams, inv_denom: list[Tensor], decay_rate: list[Tensor]) -> None:
    """One update of the rule (module docstring), both terms from the weights before it."""
    rms = params.rule == "rms"
    for i, (p, g, p0) in enumerate(zip(params_list, grads, theta0, strict=True)):
        pull = (p0 - p) if params.decay else None
        if g is not None and params.lr:
            if rms:
                p.addcmul_(g, inv_denom[i], value=-params.lr)
            else:
                p.add_(g, alpha=-params.lr)
        if pull is not None:
            if rms:
                p.addcmul_(pull, decay_rate[i])
            else:
                p.add_(pull, alpha=params.decay)
