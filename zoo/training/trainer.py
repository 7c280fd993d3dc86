"""``zoo train RECIPE``: the training loop of a recipe and its epoch end; the rest of training lives beside it.

Design points:

* **Nothing lost on a crash.** A training checkpoint (model, optimiser, every RNG, data position)
  is written atomically at every epoch end and every ``checkpoint_minutes`` (:mod:`.checkpoint_saver`);
  ``--resume`` continues exactly where it stopped, so a killed and resumed run ends with the same weights as an
  uninterrupted one; SIGTERM / Ctrl-C stop after the current step with a checkpoint (:mod:`.signals`).
* **The references' optimisers** (:mod:`.optimizers`), with variable BPTT and the lr scaled by ``seq_len / bptt``,
  gradient clipping, weight decay, AR/TAR (here, in :meth:`Trainer.update`).
* **Honest model selection.** The best-validation model is kept (Hub layout, ``best/``); the test
  split is evaluated once, on it, at the end (:mod:`.release`).
* **Scale-out on an existing engine.** Under ``torchrun --nproc-per-node N`` the global batch is
  split across ranks with DistributedDataParallel (gloo on CPU, nccl on CUDA); only rank 0 writes
  (:mod:`.distributed`).

Callers (tests) hook into the loop with callbacks (:mod:`.callbacks`); the loop itself knows none of them.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from zoo.checkpoint import save_checkpoint
from zoo.data import PAD_TARGET, load_corpus
from zoo.datasets import get_dataset
from zoo.errors import ConfigError, UsageError
from zoo.lm import LanguageModel
from zoo.precision import autocast
from zoo.tokenizer import Tokenizer
from zoo.training.batches import Batch, TrainBatches
from zoo.training.callbacks import Callback, StepEnd
from zoo.training.checkpoint_saver import (
    carry_of_rank,
    carry_tensors,
    find_training_checkpoint,
    flatten_optimizer,
    read_training_checkpoint,
    restore_rngs,
    rng_tensors,
    run_lock,
    set_capturable,
    unflatten_optimizer,
    write_training_checkpoint,
)
from zoo.training.distributed import Ranks, device_name, local_device, parse_device, rank_seed
from zoo.training.divergence import TrainingDiverged, loss_and_weights_finite
from zoo.training.evaluation import Evaluator, restore_weights, swap_in_averaged
from zoo.training.loggers import ConsoleLogger, JsonlLogger, Logger, TensorBoardLogger, check_log_options
from zoo.training.objective import training_objective
from zoo.training.optimizers import lr_for_epoch, make_optimizer, nonmonotone_trigger
from zoo.training.recipe import Recipe
from zoo.training.release import finish_run, finished_result
from zoo.training.signals import Interrupted, StopOnSignals

#: What a training checkpoint's ``meta.json`` restores as they are, besides the generators and the optimiser (in
#: the order it has always written them: the first seven before the optimiser, the epoch's sums after the generators).
COUNTERS = ("epoch", "pos", "step", "lr", "best_val", "history", "elapsed", "epoch_loss", "epoch_tokens",
            "epoch_seconds")


class _TrainForward(torch.nn.Module):
    """The module DDP wraps: its forward is the LM's ``training_loss`` (the loss inside the forward, so DDP sees
    every parameter used; the hidden outputs come back for AR/TAR)."""

    def __init__(self, model: LanguageModel):
        super().__init__()
        self.model = model

    def forward(self, x, y, state=None):
        return self.model.training_loss(x, y, state, ignore_index=PAD_TARGET)


class Trainer:
    """Trains one recipe into ``run_dir``; see the module docstring."""

    def __init__(self, recipe: Recipe, run_dir: str | Path, data_dir: str | None = None, device: str | None = None,
                 progress: bool = True, log_to: tuple[str, ...] = (), log_every_steps: int = 50,
                 cuda_graphs: bool = False, pause_after_minutes: float = 0.0, callbacks: Iterable[Callback] = ()):
        self.recipe, self.cfg = recipe, recipe.train
        # a piece of a longer run (a lent GPU's ten-minute call): stop at the first epoch end past this many minutes
        # of this process, checkpointed and unfinished (no test evaluation), for a later --resume to continue
        if not (math.isfinite(pause_after_minutes) and pause_after_minutes >= 0):
            raise ConfigError(f"pause_after_minutes must be a number >= 0, got {pause_after_minutes!r}")
        self.pause_after_minutes = pause_after_minutes
        self.run_dir = Path(run_dir)
        requested = parse_device(device)
        # Carried recurrent states drift into denormal floats, which made CPU training ~15x slower
        # (measured: 7.6k vs 0.4k tokens/s for the 2x200 LSTM); flushing them changes no metric.
        torch.set_flush_denormal(True)
        self.ranks = Ranks(local_device(requested))
        self.device, self.rank, self.world = self.ranks.device, self.ranks.rank, self.ranks.world
        if self.cfg.batch_size % self.world:
            raise ConfigError(f"batch_size {self.cfg.batch_size} is not divisible by {self.world} processes")
        self.progress = progress and self.rank == 0
        self.callbacks = list(callbacks)
        check_log_options(tuple(log_to), log_every_steps)
        self.log_to, self.log_every_steps = tuple(log_to), log_every_steps
        self.log = JsonlLogger(self.run_dir / "log.jsonl")
        self.loggers: list[Logger] = [self.log, *([ConsoleLogger()] if self.progress else [])]
        self.corpus = load_corpus(recipe.dataset, data_dir)
        self.tokenizer = Tokenizer(self.corpus.vocab, get_dataset(recipe.dataset).normalization)
        torch.manual_seed(recipe.seed)
        self.model = recipe.build_model(len(self.corpus.vocab)).to(self.device)
        self.train_module = self.ranks.wrap(_TrainForward(self.model))
        if self.rank > 0:
            torch.manual_seed(rank_seed(recipe.seed, self.rank))
        self.cuda_graphs = cuda_graphs
        self._fused_adam = self.device.type == "cpu" and self.cfg.optimizer == "adam"
        self._params = list(self.model.parameters())
        self.optimizer = self._make_optimizer(self.cfg.optimizer)
        self.bptt_rng = np.random.default_rng(recipe.seed)  # (restored by a checkpoint, as everything below)
        self.batches = TrainBatches(self.corpus, self.cfg, recipe.seed, self.tokenizer.eos_id, self.rank, self.world,
                                    self.device, self.bptt_rng)
        self.sentence_mode, self.sentences = self.batches.sentence_mode, self.batches.sentences
        self.train_data = self.batches.train_data
        self.evaluator = Evaluator(self.device, self.corpus, self.cfg.eval_bptt, self.progress, self.sentences,
                                   self.tokenizer.eos_id)
        self.epoch, self.pos, self.step, self.lr = 1, 0, 0, self.cfg.lr
        self.best_val, self.history, self.elapsed = math.inf, [], 0.0
        self.state = None
        self.epoch_loss, self.epoch_tokens, self.epoch_seconds = 0.0, 0, 0.0
        self.asgd = False  # set when NT-ASGD switches to averaged SGD
        self._graphs: Any = None
        if cuda_graphs:
            from zoo.training.captured_step import CapturedSteps
            self._graphs = CapturedSteps(self)

    def _make_optimizer(self, kind: str) -> torch.optim.Optimizer:
        return make_optimizer(kind, self.model.parameters(), self.cfg, self.lr if kind == "asgd" else self.cfg.lr,
                              capturable=self.cuda_graphs, fused=self._fused_adam)

    def _log_line(self, rec: dict[str, Any]) -> None:
        if self.rank == 0:
            for logger in self.loggers:
                logger.record(rec, self.step)

    # -- checkpoints ------------------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoint"

    def save_training_checkpoint(self) -> None:
        self._check_finite()  # a diverged run keeps its last good checkpoint
        carry = self.ranks.gather_carry(self.state)  # (collective under torchrun: before rank 0 alone goes on)
        if self.rank != 0:
            return
        tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()
                   if k not in self.model.tied_keys()}
        opt_t, opt_s = flatten_optimizer(self.optimizer)
        tensors.update(opt_t)
        tensors.update(rng_tensors(self.device))
        tensors.update(carry_tensors(carry))
        meta = {
            **{k: getattr(self, k) for k in COUNTERS[:7]}, "optimizer": "asgd" if self.asgd else self.cfg.optimizer,
            "optim_scalars": opt_s, "bptt_rng": self.bptt_rng.bit_generator.state,
            "python_rng": list(random.getstate()[1]), **{k: getattr(self, k) for k in COUNTERS[7:]},
            "has_carry": self.state is not None, "recipe": self.recipe.to_dict(), "world_size": self.world,
            # the log as far as this checkpoint: a resume drops the epoch lines written after it (a crash between
            # an epoch's log line and its checkpoint would otherwise log that epoch twice)
            "log_bytes": self.log.size(),
        }
        write_training_checkpoint(self.run_dir, tensors, meta)

    def load_training_checkpoint(self) -> bool:
        ckpt = find_training_checkpoint(self.run_dir)
        if ckpt is None:
            return False
        tensors, meta = read_training_checkpoint(ckpt, self.recipe, self.world)
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=False)
        if meta["optimizer"] == "asgd":
            self.asgd = True
            self.optimizer = self._make_optimizer("asgd")
        self.optimizer.load_state_dict(unflatten_optimizer(tensors, meta["optim_scalars"]))
        set_capturable(self.optimizer, self.cuda_graphs, self._fused_adam)
        restore_rngs(tensors, self.device)
        self.bptt_rng.bit_generator.state = meta["bptt_rng"]
        if self.rank > 0:  # the checkpoint holds rank 0's generator: give this rank its own stream again
            torch.manual_seed(rank_seed(self.recipe.seed, self.rank, int(meta["step"])))
        random.setstate((3, tuple(meta["python_rng"]), None))
        for k in COUNTERS:
            setattr(self, k, meta[k])
        self.state = carry_of_rank(tensors, self.rank, self.device) if meta["has_carry"] else None
        if "log_bytes" in meta and self.rank == 0:
            self.log.trim(meta["log_bytes"])
        return True

    def _check_finite(self) -> None:
        """Stop a run whose training loss or weights have become NaN or infinite (:mod:`.divergence`), logging
        where, and keeping the last good checkpoint and best model. Under torchrun the ranks agree, so all stop."""
        if self.ranks.all_true(loss_and_weights_finite(self.epoch_loss, self.model)):
            return
        self._log_line({"event": "diverged", "epoch": self.epoch, "pos": self.pos, "step": self.step,
                        "lr": self.lr})
        raise TrainingDiverged(f"training diverged at epoch {self.epoch}, step {self.step} (the training loss or "
                               f"the weights are not finite); the last good checkpoint and best model in "
                               f"{self.run_dir} are kept: lower the lr (or clip) and train again with --restart")

    # -- batches and the step ---------------------------------------------------------------------------------
    def evaluate(self, split: str, batch_size: int) -> dict[str, Any]:
        self.model.eval()
        res = self.evaluator(self.model, split, batch_size, split)
        self.model.train()
        return res

    def _sentence_batches(self) -> list[list[int]] | None:
        return self.batches.epoch_order(self.epoch)

    def _next_batch(self, order: list[list[int]] | None) -> Batch | None:
        return self.batches.next(self.pos, order)

    def _lr_for_epoch(self) -> None:
        """Apply the per-epoch schedule at the start of ``self.epoch``."""
        self.lr = lr_for_epoch(self.cfg, self.epoch, self.lr)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, seq_len: int) -> float:
        """One update on ``x -> y`` (``[B, T]``); returns the mean loss over the predicted targets. Targets equal
        to ``PAD_TARGET`` (sentence mode's padding) are not predicted: they count in neither the loss nor AR/TAR.
        With ``cuda_graphs`` the same update is replayed from a CUDA graph (:mod:`zoo.training.captured_step`)."""
        if self._graphs is not None:
            return self._graphs.step(x, y, seq_len)
        if self.state is not None:
            self.state = tuple(s.detach() for s in self.state)
        loss, self.state = self.update(x, y, seq_len, self.state)
        return float(loss)

    def update(self, x: torch.Tensor, y: torch.Tensor, seq_len: int, state: Any,
               capturing: bool = False) -> tuple[torch.Tensor, Any]:
        """The arithmetic of one update: ``(mean loss, new state)`` as tensors, with no host synchronisation, so
        that :mod:`zoo.training.captured_step` can capture exactly this code as a CUDA graph (``capturing``: autocast's
        weight cache off, as graphs require)."""
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr * seq_len / self.cfg.bptt
        with autocast(self.cfg.precision, self.device, cache=not capturing):
            # logits, softmax and loss in float32 (on the CPU the decoder is fused with the loss: zoo.lm)
            loss, raw, dropped, state = self.train_module(x, y, state)
        total = training_objective(self.cfg, loss, raw, dropped, y, seq_len, self.sentence_mode)
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        if self.cfg.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.optimizer.step()
        if self._fused_adam:
            # the fused kernel writes the weights without counting an in-place change, and the compiled loops'
            # weight cache (zoo.models._compiled.cached_weights) keys on that count: evaluation would read
            # the weights of the last evaluation (a test resumes a sweep prefix and compares)
            torch.autograd.graph.increment_version(self._params)
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr
        return loss.detach(), state

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict[str, Any]:
        """Train to the recipe's end (or its time budget), then :meth:`finish`.

        SIGTERM or SIGINT (Ctrl-C) stops the run after the current step with a checkpoint written, so a stop loses
        nothing (``--resume`` continues from it); the process then exits with :class:`Interrupted`.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with run_lock(self.run_dir) if self.rank == 0 else contextlib.nullcontext():
            return self._run_locked(resume)

    def _run_locked(self, resume: bool) -> dict[str, Any]:
        if resume and self.load_training_checkpoint():
            if self.epoch > self.cfg.epochs and (done := finished_result(self.run_dir, self.epoch - 1)) is not None:
                return done  # nothing left to train: its results stand (the test split is not scored again)
            self._log_line({"event": "resumed", "epoch": self.epoch, "pos": self.pos, "step": self.step})
            if (self.run_dir / "eval.json").exists() and self.rank == 0:  # a sweep prefix continued: not finished
                (self.run_dir / "eval.json").unlink()  # until it is (bundle and tiers would take its old numbers)
                self._log_line({"event": "continued", "epochs": self.cfg.epochs})
        elif self.rank == 0:
            if resume:
                if any((self.run_dir / n).exists() for n in ("best", "release", "eval.json")):
                    raise UsageError(f"nothing to resume in {self.run_dir} (no checkpoint), but it holds an earlier "
                                     f"run's results: start over with --restart")
                print(f"zoo train: nothing to resume in {self.run_dir} (no checkpoint): training from the start",
                      file=sys.stderr, flush=True)
            self.log.path.unlink(missing_ok=True)
        opened = [TensorBoardLogger(self.run_dir / "tensorboard", self.step, self.log_every_steps)] \
            if "tensorboard" in self.log_to and self.rank == 0 else []
        self.loggers += opened
        try:
            with StopOnSignals() as self._signals:
                return self._run()
        finally:
            for logger in opened:
                logger.close()
                self.loggers.remove(logger)
            self.ranks.teardown()

    def _run(self) -> dict[str, Any]:
        self.model.train()
        cfg = self.cfg
        self._start_wall = time.time() - self.elapsed
        self._piece_start = self._last_ckpt = time.time()
        self._steps_here = 0
        while self.epoch <= cfg.epochs:
            if self.pos == 0:
                self._lr_for_epoch()
                self.state = None
                self.epoch_loss, self.epoch_tokens, self.epoch_seconds = 0.0, 0, 0.0
            self._train_epoch(self._sentence_batches() if self.sentence_mode else None)
            self._end_epoch()
            self.elapsed = time.time() - self._start_wall
            self.save_training_checkpoint()
            self._last_ckpt = time.time()
            over, _ = self.ranks.agree(bool(cfg.max_minutes) and self.elapsed > cfg.max_minutes * 60, 0)  # (own clocks)
            if over and self.epoch <= cfg.epochs:
                self._log_line({"event": "budget_stop", "epoch": self.epoch - 1, "elapsed": self.elapsed})
                break
            pause, _ = self.ranks.agree(bool(self.pause_after_minutes) and
                                        time.time() - self._piece_start > self.pause_after_minutes * 60, 0)
            if pause and self.epoch <= cfg.epochs:
                self._log_line({"event": "paused", "epoch": self.epoch - 1, "step": self.step, "elapsed": self.elapsed})
                return {"paused": True, "epochs_trained": self.epoch - 1, "epochs": cfg.epochs,
                        "valid_ppl": math.exp(self.history[-1]) if self.history else None}
        self.ranks_in_sync = self.ranks.check_in_sync(self.model)
        return self.finish()

    def _train_epoch(self, order: list[list[int]] | None) -> None:
        """The rest of the epoch from ``self.pos`` (``order``: sentence mode's batches; ``None``: the stream)."""
        total = self.batches.total(order)
        bar = tqdm(total=total, initial=self.pos, desc=f"epoch {self.epoch}/{self.cfg.epochs}",
                   unit="batch" if order is not None else "row", disable=not self.progress, leave=False)
        self._t0 = time.time()
        try:
            while (batch := self._next_batch(order)) is not None:
                x, y, seq_len, new_pos = batch
                if order is not None:
                    self.state = None            # sentences: every sequence starts from a zero state
                loss = self.train_step(x, y, seq_len)
                if order is not None:
                    self.state = None
                n = y.numel() if order is None else int((y != PAD_TARGET).sum())
                self.epoch_loss += loss * n
                self.epoch_tokens += n
                bar.update(new_pos - self.pos)
                self.pos = new_pos
                self.step += 1
                self._steps_here += 1
                for logger in self.loggers:
                    logger.train_step(self.step, loss, self.lr)
                if self.progress and self.step % 20 == 0:
                    bar.set_postfix(loss=f"{self.epoch_loss / self.epoch_tokens:.3f}", lr=f"{self.lr:.3g}")
                self._after_step(loss, total, bar)
        except BaseException:  # (a divergence, a crash): the error line starts on a line of its own
            bar.close()
            raise
        bar.close()
        self.epoch_seconds += time.time() - self._t0

    def _after_step(self, loss: float, total: int, bar: Any) -> None:
        """The callbacks, then the decisions every rank must share: checkpoint now, stop now (a signal). The signal
        handler's flag is only read here, never overwritten (a signal arriving later is acted on at the next step)."""
        now = time.time()
        event = StepEnd(self.step, self._steps_here, loss)
        for callback in self.callbacks:  # (before the decisions: a signal a callback sends is acted on at this step)
            callback.on_step_end(self, event)
        due = event.checkpoint or now - self._last_ckpt > self.cfg.checkpoint_minutes * 60
        due, stop = self.ranks.agree(due and self.pos < total, self._signals.received)
        if due and not stop:  # (a stop writes its own checkpoint just below)
            self.epoch_seconds += now - self._t0
            self._t0 = now
            self.elapsed = now - self._start_wall
            self.save_training_checkpoint()
            self._last_ckpt = now
        if stop:
            self.epoch_seconds += time.time() - self._t0
            self.elapsed = time.time() - self._start_wall
            self.save_training_checkpoint()
            self._log_line({"event": "interrupted", "signal": signal.Signals(stop).name,
                            "epoch": self.epoch, "pos": self.pos, "step": self.step})
            bar.close()
            self.ranks.barrier()  # no rank exits before rank 0 has written: torchrun answers a rank's exit by
            raise Interrupted(stop, self.ckpt_dir)  # sending SIGTERM to the others

    def _end_epoch(self) -> None:
        backup = swap_in_averaged(self.model, self.optimizer) if self.asgd else None
        self._check_finite()
        val = self.evaluate("valid", self.cfg.eval_batch_size)
        if not math.isfinite(val["avg_nll"]):
            restore_weights(backup)
            self.epoch_loss = math.nan  # the weights give non-finite logits: diverged as well
            self._check_finite()
        train_loss = self.epoch_loss / max(1, self.epoch_tokens)
        improved = val["avg_nll"] < self.best_val
        if improved:
            self.best_val = val["avg_nll"]
            if self.rank == 0:
                save_checkpoint(self.run_dir / "best", self.model, self.tokenizer, {
                    "name": self.recipe.name, "dataset": self.recipe.dataset, "recipe": self.recipe.to_dict()})
        restore_weights(backup)
        self._log_line({"epoch": self.epoch, "train_loss": train_loss,
                        "train_ppl": math.exp(train_loss) if train_loss < 709 else None,  # (None: past float64)
                        "valid_loss": val["avg_nll"], "valid_ppl": val["ppl"], "lr": self.lr,
                        "seconds": self.epoch_seconds, "tokens_per_s": self.epoch_tokens * self.world /
                        max(1e-9, self.epoch_seconds), "optimizer": "asgd" if self.asgd else self.cfg.optimizer,
                        "best": improved, "wall_seconds": time.time() - self._start_wall,
                        "device": device_name(self.device)})  # per epoch: a run trained in pieces may change machines
        if self.cfg.optimizer == "ntasgd" and not self.asgd:
            if nonmonotone_trigger(self.history, val["avg_nll"], self.cfg.nonmono):
                self.asgd = True
                self.optimizer = self._make_optimizer("asgd")
                self._log_line({"event": "switch_to_asgd", "epoch": self.epoch})
        self.history.append(val["avg_nll"])
        self.epoch += 1
        self.pos = 0

    def finish(self) -> dict[str, Any]:
        """Evaluate the best checkpoint on valid and (once) on test; write ``release/`` and ``eval.json``."""
        if self.rank != 0:
            return {}
        info = {"name": self.recipe.name, "dataset": self.recipe.dataset, "architecture": self.model.architecture,
                "num_parameters": self.model.num_parameters(), "device": device_name(self.device),
                "world_size": self.world, "recipe": self.recipe.to_dict(), "mode": self.cfg.mode}
        if self.world > 1:
            info["ranks_in_sync"] = getattr(self, "ranks_in_sync", False)
        sizes = {"valid": self.cfg.eval_batch_size, "test": self.cfg.test_batch_size}
        result = finish_run(self.run_dir, self.cfg.save_dtype, self.device,
                            lambda model, split, desc: self.evaluator(model, split, sizes[split], desc), info)
        self._log_line({"event": "finished", "best_valid_ppl": result["valid"]["ppl"],
                        "best_test_ppl": result["test"]["ppl"]})
        return result
