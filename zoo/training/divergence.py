"""A run whose loss or weights stop being finite stops, keeping its last good checkpoint and best model.

Why the weights too: an exploding step's loss is still finite while the update it makes is not, so checking the loss
alone would write that update as the "last good" checkpoint; and every later step and checkpoint would be garbage.
"""

from __future__ import annotations

import math

import torch

from zoo.errors import ZooError


class TrainingDiverged(ZooError):
    """The training loss became NaN or infinite: the run stops, keeping its last good checkpoint (exit 2)."""


def loss_and_weights_finite(loss: float, model: torch.nn.Module) -> bool:
    """Whether the running loss and every weight are finite."""
    return math.isfinite(loss) and bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())
