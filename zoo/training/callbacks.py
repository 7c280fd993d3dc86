"""What a caller may hook into the training loop, without the loop knowing who.

Why: the tests need a run that crashes or is signalled at a chosen step, or that checkpoints every few steps, to show
that a resume loses nothing; those hooks belong to the tests (``tests/train_hooks.py``), not to the trainer or the
CLI. A callback sees the trainer after each step and may ask for a checkpoint at that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class StepEnd:
    """One finished training step, as the callbacks see it."""

    step: int                 # the run's step count, this step included (it continues across resumes)
    steps_this_process: int   # steps since this process started (or resumed) the run
    loss: float               # this step's mean loss
    checkpoint: bool = False  # set by a callback: write a checkpoint at this step (all ranks agree on it)


class Callback(Protocol):
    """Called by :class:`zoo.training.trainer.Trainer` after each step, before the ranks agree on a checkpoint or a
    stop: a signal a callback sends to its own process is acted on at this step."""

    def on_step_end(self, trainer: Any, event: StepEnd) -> None: ...
