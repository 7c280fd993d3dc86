"""The training objective: the LM loss, time-summed or not, plus AWD-LSTM's activation regularisers.

Why written once: the eager step and the CUDA graph captured from it (:mod:`zoo.training.captured_step`) must compute
the same arithmetic, and sentence mode's padding must count in neither the loss nor AR/TAR.
"""

from __future__ import annotations

import torch

from zoo.data import PAD_TARGET
from zoo.training.recipe import TrainConfig


def training_objective(cfg: TrainConfig, loss: torch.Tensor, raw: torch.Tensor, dropped: torch.Tensor,
                       y: torch.Tensor, seq_len: int, sentence_mode: bool) -> torch.Tensor:
    """What the step differentiates: ``loss`` (the mean over predicted targets) times ``seq_len`` when the recipe
    sums it over time (Zaremba et al.), plus ``alpha`` x AR (the mean square of the dropped-out last-layer outputs)
    and ``beta`` x TAR (of the raw outputs' step-to-step change), over unpadded positions only."""
    total = loss * seq_len if cfg.time_summed_loss else loss
    keep = (y != PAD_TARGET).unsqueeze(-1).to(raw.dtype) if sentence_mode else None
    if cfg.alpha:
        ar = dropped.pow(2)
        total = total + cfg.alpha * (ar.mean() if keep is None else (ar * keep).sum() / (keep.sum() * ar.shape[-1]))
    if cfg.beta:
        tar = (raw[:, 1:] - raw[:, :-1]).pow(2)
        if keep is None:
            total = total + cfg.beta * tar.mean()
        else:
            k = keep[:, 1:]
            total = total + cfg.beta * (tar * k).sum() / (k.sum().clamp_min(1) * tar.shape[-1])
    return total
