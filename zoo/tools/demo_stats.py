"""The demo's dynamic-evaluation statistics, collected at start-up in a background process.

Why: collecting them (:meth:`zoo.pretrained.ZooModel.dynamic_stats`) takes about a minute of CPU per model, and
when the first visitor's request did it, two 20,000-character dynamic calls held both of the demo's compute
slots for 7 minutes while a plain score waited behind them. Here they are collected once, before anyone asks,
by a child process at the lowest CPU priority, into the library's disk cache (a later start reads them back in
well under a second); a dynamic request for a model whose statistics are not ready yet is told so at once.

A process rather than a thread: it can be ended at any moment (a thread inside a minute-long torch computation
cannot, and one still running at interpreter exit aborted it), and its memory goes when it ends.

    python -m zoo.tools.demo_stats '[["name", "bundled" or "<checkpoint dir>"], ...]'   # the child's side
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence


class DynamicStats:
    """Collects the statistics of ``models`` (``[(name, "bundled" | checkpoint dir), ...]``, in that order) in a
    child process; :meth:`problem` says, per model, whether dynamic evaluation can run now."""

    def __init__(self, models: Sequence[tuple[str, str]]):
        self.models = list(models)
        #: name -> None (ready) or why dynamic evaluation cannot run; absent: still pending
        self.state: dict[str, str | None] = {}
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> DynamicStats:
        if self.proc is None and self.models:
            self.proc = subprocess.Popen([sys.executable, "-m", "zoo.tools.demo_stats", json.dumps(self.models)],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            atexit.register(self.stop)
            self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
            self._reader.start()
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                name, why = json.loads(line)
            except ValueError:
                continue
            self.state[str(name)] = None if why is None else str(why)
        for name, _ in self.models:  # the child ended (or was ended) before this one: say so on use
            self.state.setdefault(name, "collecting its statistics stopped; restart the demo to try again")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def problem(self, name: str) -> str | None:
        """Why dynamic evaluation cannot run on ``name`` now, or None when its statistics are ready."""
        if name not in self.state:
            return ("dynamic evaluation's statistics are still being collected (at start-up, about a minute per "
                    "model); plain scoring works meanwhile")
        return self.state[name]

    def wait(self, name: str, timeout: float) -> bool:
        """Whether ``name`` is settled (ready or refused) within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while name not in self.state and time.monotonic() < deadline:
            time.sleep(0.1)
        return name in self.state


def collect(models: Sequence[tuple[str, str]]) -> None:
    """The child: each model's statistics into the disk cache, one JSON line ``[name, null | why not]`` each."""
    import torch

    import zoo
    from zoo.errors import ZooError

    torch.set_num_threads(1)
    try:
        os.nice(19)
    except OSError:
        pass
    for name, source in models:
        try:
            model = zoo.load(name if source == "bundled" else source)
            model.dynamic_stats(model._dynamic(True))
            why = None
        except ZooError as e:  # this model cannot do it (no training data, sentence-level)
            why = str(e)
        except Exception as e:  # noqa: BLE001 (a bug: reported on use, not raised in a background process)
            why = f"collecting its statistics failed ({type(e).__name__}: {e})"
        print(json.dumps([name, why]), flush=True)


if __name__ == "__main__":
    collect([tuple(m) for m in json.loads(sys.argv[1])])
