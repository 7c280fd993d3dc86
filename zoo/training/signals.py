"""SIGTERM and Ctrl-C during training: a polite stop that loses nothing.

Why: a preempted machine, a lent GPU's time limit or an impatient user stop a run with a signal; dying at once would
lose everything since the last checkpoint. The first signal asks the trainer to stop after its current step (it then
writes a checkpoint and raises :class:`Interrupted`); a second one kills the process at once.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path


class Interrupted(Exception):
    """Training stopped by SIGTERM / SIGINT after writing a checkpoint (``zoo train`` exits 128 + the signal)."""

    def __init__(self, signum: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} with a checkpoint in {checkpoint}; continue with "
                         f"--resume")
        self.signum = signum


class StopOnSignals:
    """While entered, SIGTERM and SIGINT set :attr:`received` (the signal number; 0: none) for the trainer to read
    after its step; a second signal of either kind kills the process at once. Handlers are restored on exit. Only
    in the main thread (Python delivers signals there; elsewhere the default handling stays)."""

    def __init__(self) -> None:
        self.received = 0
        self.previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.received:   # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
