"""The demo's dynamic-evaluation statistics, collected at start-up in a background process.

Why: collecting them (:meth:`zoo.zoo_model.ZooModel.dynamic_stats`) takes about a minute of CPU per model, and
when the first visitor's request did it, two 20,000-character dynamic calls held both of the demo's compute
slots for 7 minutes while a plain score waited behind them. Here they are collected once, before anyone asks,
by a child process at the lowest CPU priority, into the library's disk cache (a later start reads them back in
well under a second); a dynamic request for a model whose statistics are not ready yet is told so at once.

A process rather than a thread: it can be ended at any moment (a thread inside a minute-long torch computation
cannot, and one still running at interpreter exit aborted it), and its memory goes when it ends.

    python -m zoo.tools.demo.stats '[["name", "bundled" or "<checkpoint dir>"], ...]'   # the child's side
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
    """Collects dynamic evaluation's statistics in a child process, one model after another: ``models`` (``[(name,
    "bundled" | checkpoint dir), ...]``) at start-up, in that order, and any other model of ``known`` the first
    time a visitor asks for it. :meth:`problem` says, per model, whether dynamic evaluation can run now.

    Why not every model at start-up: about a minute of CPU each, so the whole catalogue would keep a core busy for
    a quarter of an hour after every start (and every test that builds a demo); the models a visitor meets first
    (the operator's ``--model-dir`` ones and the default) are ready before anyone asks, the rest on first use."""

    def __init__(self, models: Sequence[tuple[str, str]], known: Sequence[tuple[str, str]] = ()):
        self.queue = list(models)
        self.known = dict(known) | dict(models)
        #: name -> None (ready) or why dynamic evaluation cannot run; absent: pending (queued or collecting)
        self.state: dict[str, str | None] = {}
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> DynamicStats:
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self._next()
        return self

    def _next(self) -> None:
        """Start a child for the queued models (the lock held), unless stopped or nothing is queued."""
        batch, self.queue = self.queue, []
        if self._stopped or not batch:
            self.proc = None
            return
        self.proc = subprocess.Popen([sys.executable, "-m", "zoo.tools.demo.stats", json.dumps(batch)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        atexit.register(self.stop)
        threading.Thread(target=self._read, args=(self.proc, batch), daemon=True).start()

    def _read(self, proc: subprocess.Popen, batch: list[tuple[str, str]]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                name, why = json.loads(line)
            except ValueError:
                continue
            self.state[str(name)] = None if why is None else str(why)
        proc.wait()
        with self._lock:
            for name, _ in batch:  # the child ended (or was ended) before this one: say so on use
                self.state.setdefault(name, "collecting its statistics stopped; restart the demo to try again")
            if self.proc is proc:
                self._next()

    def stop(self) -> None:
        """End the collection (the demo is closing): the child is terminated, nothing more is started."""
        with self._lock:
            self._stopped, self.queue, proc = True, [], self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def problem(self, name: str) -> str | None:
        """Why dynamic evaluation cannot run on ``name`` now, or None when its statistics are ready (a model not
        collected yet is queued for collection by this call)."""
        if name in self.state:
            return self.state[name]
        with self._lock:
            pending = any(n == name for n, _ in self.queue)
            if not pending and name in self.known and not self._stopped:
                self.queue.append((name, self.known[name]))
                if self.proc is None or self.proc.poll() is not None:
                    self._next()
        return ("dynamic evaluation's statistics are being collected (about a minute per model, once; then kept on "
                "disk); plain scoring works meanwhile: try again shortly")

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
