"""Where a run's records go: ``log.jsonl`` (always: the source of record that cards, tiers and resumes read), the
console's epoch line, and TensorBoard (``zoo train --log-to tensorboard``).

Why a protocol: the trainer says what happened (an event or an epoch's record; a step's loss) once, and every
logger takes what it shows from that; a new target is a class here, not a branch in the loop. Only rank 0 logs.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from zoo.errors import ConfigError
from zoo.files import write_atomic

#: Where ``zoo train --log-to`` can send metrics besides ``log.jsonl`` (always written: the source of record).
LOG_TARGETS = ("tensorboard",)


def is_epoch_record(rec: Any) -> bool:
    """An epoch's record (its validation result), as opposed to an event line."""
    return isinstance(rec, dict) and "epoch" in rec and "valid_ppl" in rec


class Logger(Protocol):
    """What the trainer reports: every record (events and epoch records), each step's loss, the end."""

    def record(self, rec: dict[str, Any], step: int) -> None: ...

    def train_step(self, step: int, loss: float, lr: float) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """``RUN_DIR/log.jsonl``: one JSON object a line, ``None`` values left out, each with its ``time``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, rec: dict[str, Any], step: int) -> None:
        rec = {k: v for k, v in rec.items() if v is not None}
        rec["time"] = time.time()
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def train_step(self, step: int, loss: float, lr: float) -> None:
        pass  # (epoch records only: the log stays small for the cards and tiers that read it)

    def close(self) -> None:
        pass  # (each record is appended and closed)

    def size(self) -> int:
        """The log's size in bytes (a checkpoint records it: what a resume keeps)."""
        return self.path.stat().st_size if self.path.exists() else 0

    def trim(self, size: int) -> None:
        """Drop what the log gained after the checkpoint that the run resumes from: epoch records (the resumed
        run writes them again) and a line cut short by a crash; event lines (an interruption) stay."""
        if not self.path.exists() or self.path.stat().st_size <= size:
            return
        data = self.path.read_bytes()
        kept = [data[:size]]
        for line in data[size:].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a partial line
            if is_epoch_record(rec):
                continue
            kept.append(line + b"\n")
        write_atomic(self.path, b"".join(kept))


class ConsoleLogger:
    """The epoch's line on the console (above the progress bar)."""

    def record(self, rec: dict[str, Any], step: int) -> None:
        if "valid_ppl" in rec:
            train_ppl = math.inf if rec.get("train_ppl") is None else rec["train_ppl"]
            tqdm.write(f"epoch {rec['epoch']}: train ppl {train_ppl:.2f}  valid ppl {rec['valid_ppl']:.2f}  "
                       f"lr {rec['lr']:.3g}  {rec['tokens_per_s']:.0f} tok/s")

    def train_step(self, step: int, loss: float, lr: float) -> None:
        pass  # (the progress bar shows the running loss)

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """``RUN_DIR/tensorboard``: the mean training loss of the last ``every`` steps and the lr, every ``every``
    steps; each epoch's perplexities, validation loss and speed. On a resume, events past ``step`` (written after
    the checkpoint the run resumes from) are purged, so the curves never show a step twice."""

    def __init__(self, logdir: Path, step: int, every: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise ConfigError("--log-to tensorboard needs the tensorboard package: pip install 'alstm-zoo[train]' "
                              f"({e})") from None
        self.writer = SummaryWriter(str(logdir), purge_step=step or None)
        self.every = every
        self._loss = [0.0, 0]      # loss sum and steps since the last step-level record

    def record(self, rec: dict[str, Any], step: int) -> None:
        if "valid_ppl" not in rec:
            return
        for key in ("train_ppl", "valid_ppl", "valid_loss", "tokens_per_s"):
            if rec.get(key) is not None:
                self.writer.add_scalar(f"epoch/{key}", rec[key], rec["epoch"])
        self.writer.add_scalar("valid/ppl", rec["valid_ppl"], step)
        self.writer.flush()

    def train_step(self, step: int, loss: float, lr: float) -> None:
        self._loss[0] += loss
        self._loss[1] += 1
        if step % self.every == 0:
            self.writer.add_scalar("train/loss", self._loss[0] / self._loss[1], step)
            self.writer.add_scalar("train/lr", lr, step)
            self._loss = [0.0, 0]

    def close(self) -> None:
        self.writer.close()


def check_log_options(log_to: tuple[str, ...], log_every_steps: int) -> None:
    """Refuse an unknown target or step count before anything trains."""
    unknown = set(log_to) - set(LOG_TARGETS)
    if unknown:
        raise ConfigError(f"unknown log target(s) {sorted(unknown)}; known: {', '.join(LOG_TARGETS)}")
    if log_every_steps < 1:
        raise ConfigError("log_every_steps must be >= 1")
