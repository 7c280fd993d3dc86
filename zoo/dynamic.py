"""Dynamic evaluation (Krause et al. 2018, "Dynamic Evaluation of Neural Sequence Models"): scoring that adapts.

A recurrent LM's state carries only so much of a text's history; dynamic evaluation lets the *weights* follow
the text too. The sequence is cut into segments of ``segment`` tokens; each segment is scored first, with the
weights as they are, and only then does the model take one gradient step on that segment's loss, so no token is
ever scored by weights that have seen it. The step is Krause et al.'s SGD rule with a decay back to the trained
weights ``theta_0`` (their "global prior", which keeps the adapted weights from drifting over a long text)::

    theta <- theta - lr * grad(mean NLL of the segment) + decay * (theta_0 - theta)

The state is carried across segments (the gradient is truncated at segment boundaries, like BPTT), dropout is
off, and the trained weights are restored when the sequence ends, also on error: scoring the same text twice
gives the same numbers. Costs a forward and a backward pass per segment at batch 1.

``lr`` and ``decay`` defaults are chosen on the validation split, never on test (:data:`DEFAULTS` says from what).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm


@dataclass(frozen=True)
class DynamicParams:
    """Dynamic-evaluation settings: tokens per update, step size, and the decay towards the trained weights."""

    segment: int = 10
    lr: float = 1e-3
    decay: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.segment, int) or self.segment < 1:
            raise ValueError(f"segment must be a positive integer, got {self.segment!r}")
        for name in ("lr", "decay"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not (v >= 0) or v == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.decay > 1:
            raise ValueError(f"decay must be at most 1, got {self.decay!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


#: The defaults (see DynamicParams): placeholders until tuned on the validation split.
DEFAULTS = DynamicParams()


def dynamic_logprobs(lm: torch.nn.Module, inputs: Tensor, targets: Tensor, params: DynamicParams = DEFAULTS,
                     progress: bool = False, desc: str = "dynamic") -> Tensor:
    """Log-probability (float64) of every ``targets[t]`` given ``inputs[:t+1]``, for one sequence (1-D tensors of
    equal length), with the weights adapting segment by segment; the trained weights are restored at the end."""
    if inputs.dim() != 1 or inputs.shape != targets.shape:
        raise ValueError("inputs and targets must be 1-D tensors of the same length")
    params_list = [p for p in lm.parameters() if p.requires_grad]
    theta0 = [p.detach().clone() for p in params_list]
    was_training = lm.training
    lm.eval()
    out = torch.empty(targets.numel(), dtype=torch.float64)
    device = theta0[0].device if theta0 else torch.device("cpu")
    state = lm.init_state(1, device)
    seg = params.segment
    try:
        for start in tqdm(range(0, targets.numel(), seg), desc=desc, unit="segment", disable=not progress,
                          leave=False):
            x = inputs[start:start + seg].to(device)[None]
            y = targets[start:start + seg].to(device)
            state = tuple(s.detach() for s in state)
            with torch.enable_grad():
                logits, state = lm(x, state)
                logp = torch.log_softmax(logits[0].float(), dim=-1).gather(1, y[:, None]).squeeze(1)
                out[start:start + y.numel()] = logp.detach().double().cpu()
                if params.lr == 0 and params.decay == 0:
                    continue
                grads = torch.autograd.grad(-logp.mean(), params_list, allow_unused=True)
            with torch.no_grad():
                for p, g, p0 in zip(params_list, grads, theta0, strict=True):
                    if g is not None and params.lr:
                        p.add_(g, alpha=-params.lr)
                    if params.decay:
                        p.add_(p0 - p, alpha=params.decay)
    finally:
        with torch.no_grad():
            for p, p0 in zip(params_list, theta0, strict=True):
                p.copy_(p0)
        lm.train(was_training)
    return out
