"""The references' optimisers and learning-rate schedules.

Adam as in the aLSTM code (betas (0, 0.999), eps 1e-9, lr cuts after given epochs), SGD with per-epoch decay
(Zaremba et al.), NT-ASGD (AWD-LSTM: switch to averaged SGD when validation stops improving, and evaluate the
averaged weights). Why in one module: a recipe names its optimiser and schedule, and these few lines are where the
names become the papers' arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zoo.errors import ConfigError
from zoo.training.recipe import TrainConfig


def make_optimizer(kind: str, params: Iterable[torch.nn.Parameter], cfg: TrainConfig, lr: float,
                   capturable: bool = False, fused: bool = False) -> torch.optim.Optimizer:
    """``kind``'s optimiser over ``params`` (``lr``: ASGD's start, the lr in force when NT-ASGD switches)."""
    if kind == "adam":
        # capturable: its step count lives on the device, so a CUDA graph can replay the update.
        # fused on the CPU: one pass over each parameter instead of one per term of the update (the
        # WikiText-2 models' step: 9 ms against 91 ms, ~10% of a training step; same formula).
        return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                                weight_decay=cfg.weight_decay, capturable=capturable, fused=fused or None)
    if kind in ("sgd", "ntasgd"):
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if kind == "asgd":
        return torch.optim.ASGD(params, lr=lr, t0=0, lambd=0.0, weight_decay=cfg.weight_decay,
                                capturable=capturable)
    raise ConfigError(f"unknown optimizer {kind!r} (sgd, adam, ntasgd)")


def lr_for_epoch(cfg: TrainConfig, epoch: int, lr: float) -> float:
    """The lr of ``epoch`` (1-based) under the recipe's per-epoch schedule (``lr``: the current one, kept when the
    recipe has no schedule)."""
    if cfg.optimizer == "sgd" and cfg.lr_decay != 1.0 and cfg.lr_decay_start:
        return cfg.lr * cfg.lr_decay ** max(0, epoch - cfg.lr_decay_start + 1)
    if cfg.cut_steps:
        return cfg.lr / cfg.cut_rate ** sum(1 for e in cfg.cut_steps if epoch > e)
    return lr


def nonmonotone_trigger(history: list[float], val_loss: float, nonmono: int) -> bool:
    """AWD-LSTM's NT-ASGD condition: the validation loss is worse than the best one from more than
    ``nonmono`` epochs ago (``history`` holds the earlier epochs' validation losses)."""
    return len(history) > nonmono and val_loss > min(history[:-nonmono] if nonmono else history)
