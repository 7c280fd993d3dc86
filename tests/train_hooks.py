"""``zoo train`` with the tests' hooks: ``python -m tests.train_hooks train ARGS [--crash-after-steps N]
[--crash-signal KILL|TERM|INT] [--checkpoint-every-steps N]``.

The hooks used to be hidden ``zoo train`` flags reaching test-only code in the trainer; now they are callbacks
(:mod:`zoo.training.callbacks`) that live here, and this script runs the real command (``zoo.cli.main``: its
parsing, run-dir checks, error lines and exit codes) with a :class:`~zoo.training.Trainer` that gets them. It works
under ``torchrun`` too (``-m tests.train_hooks``). The command builds its Trainer by name, so the script hands it a
subclass that appends the hooks to the callbacks, before ``zoo.cli`` is imported.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import zoo.training
import zoo.training.trainer
from zoo.training import StepEnd, Trainer


class CrashAfter:
    """Send ``signum`` to this process after ``steps`` steps of it (SIGKILL: a crash; SIGTERM / SIGINT: a polite
    stop). Under torchrun only the last rank signals itself: the others learn of the stop from the ranks' agreement.
    """

    def __init__(self, steps: int, signum: int = signal.SIGKILL) -> None:
        self.steps, self.signum = steps, signum

    def on_step_end(self, trainer: Any, event: StepEnd) -> None:
        if event.steps_this_process == self.steps and trainer.rank == trainer.world - 1:
            os.kill(os.getpid(), self.signum)


class CheckpointEvery:
    """Ask for a checkpoint every ``steps`` steps of the run."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(self, trainer: Any, event: StepEnd) -> None:
        if event.step % self.steps == 0:
            event.checkpoint = True


def hooks_from(argv: list[str]) -> tuple[list[Any], list[str]]:
    """The callbacks the hook flags ask for, and the rest of the command line (the ``zoo`` command's)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--checkpoint-every-steps", type=int, default=0)
    p.add_argument("--crash-after-steps", type=int, default=0)
    p.add_argument("--crash-signal", default="KILL", choices=["KILL", "TERM", "INT"])
    hooks, rest = p.parse_known_args(argv)
    callbacks: list[Any] = []
    if hooks.checkpoint_every_steps:
        callbacks.append(CheckpointEvery(hooks.checkpoint_every_steps))
    if hooks.crash_after_steps:
        callbacks.append(CrashAfter(hooks.crash_after_steps, getattr(signal, f"SIG{hooks.crash_signal}")))
    return callbacks, rest


def main(argv: list[str]) -> int:
    callbacks, rest = hooks_from(argv)

    class HookedTrainer(Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["callbacks"] = [*kwargs.get("callbacks", ()), *callbacks]
            super().__init__(*args, **kwargs)

    zoo.training.Trainer = zoo.training.trainer.Trainer = HookedTrainer
    from zoo.cli import main as zoo_main

    return zoo_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
