"""``zoo train RECIPE``: resumable training of a recipe (a TOML file holding every hyper-parameter).

Design points:

* **Nothing lost on a crash.** A training checkpoint (model, optimiser, every RNG, data position)
  is written atomically (temp file + ``os.replace``) at every epoch end and every
  ``checkpoint_minutes``; ``--resume`` continues exactly where it stopped, so a killed and resumed
  run ends with the same weights as an uninterrupted one. Checkpoints are safetensors + JSON:
  nothing is ever unpickled.
* **The references' optimisers.** Adam as in the aLSTM code (betas (0, 0.999), eps 1e-9, lr cuts
  at given epochs), SGD with per-epoch decay (Zaremba et al.), NT-ASGD (AWD-LSTM: switch to
  averaged SGD when validation stops improving, and evaluate the averaged weights). Variable
  BPTT with the lr scaled by ``seq_len / bptt``, gradient clipping, weight decay, AR/TAR.
* **Honest model selection.** The best-validation model is kept (Hub layout, ``best/``); the test
  split is evaluated once, on it, at the end.
* **Scale-out on an existing engine.** Under ``torchrun --nproc-per-node N`` the global batch is
  split across ranks with DistributedDataParallel (gloo on CPU, nccl on CUDA); only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from zoo.checkpoint import load_checkpoint, save_checkpoint
from zoo.data import PAD_TARGET, Corpus, batchify, load_corpus, pad_batch, sentences
from zoo.datasets import get_dataset
from zoo.device import resolve_device
from zoo.errors import ConfigError, MissingFileError, UsageError, ZooError
from zoo.files import write_atomic
from zoo.lm import LanguageModel
from zoo.precision import autocast
from zoo.precision import check as check_precision
from zoo.scoring import evaluate_sentences, evaluate_stream
from zoo.tokenizer import Tokenizer

#: ``[train]`` options of the carried-stream protocol, with no meaning in sentence mode (a sequence is one line of at
#: most ``max_len`` tokens, from a zero state): refused there unless left at their defaults, and left out of the
#: recipe a sentence-mode card shows.
STREAM_ONLY = ("bptt", "variable_bptt", "eval_bptt", "time_summed_loss")


@dataclass
class TrainConfig:
    """The ``[train]`` table of a recipe."""

    epochs: int = 10
    batch_size: int = 20
    bptt: int = 35
    variable_bptt: bool = False
    optimizer: str = "sgd"  # sgd | adam | ntasgd
    lr: float = 1.0
    lr_decay: float = 1.0  # sgd: multiply lr by this every epoch after lr_decay_start
    lr_decay_start: int = 0  # first epoch (1-based) whose lr is decayed
    cut_steps: list[int] = field(default_factory=list)  # epochs after which lr /= cut_rate
    cut_rate: float = 10.0
    clip: float = 0.0
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.0, 0.999])
    adam_eps: float = 1e-9
    nonmono: int = 5
    # Zaremba et al. / TF ptb_word_lm: loss summed over the BPTT steps, averaged over the batch, so
    # the gradient, the lr and the clip threshold are all relative to T x the mean loss.
    time_summed_loss: bool = False
    alpha: float = 0.0  # AR
    beta: float = 0.0  # TAR
    eval_batch_size: int = 10
    test_batch_size: int = 1
    eval_bptt: int = 70
    checkpoint_minutes: float = 10.0
    max_minutes: float = 0.0  # wall-clock budget; 0 = none (stop cleanly at an epoch end)
    save_dtype: str = "float32"
    # compute precision of the training forward/backward: "fp32" or "bf16" (mixed precision, see zoo.precision);
    # weights, optimiser state and checkpoints are float32 either way, and validation/test run in float32
    precision: str = "fp32"
    # "stream": the corpus as one stream, state carried across BPTT segments (the LM benchmarks' protocol);
    # "sentences": every line an independent sequence from a zero state (truncated to max_len tokens, padded and
    # masked, shuffled each epoch), trained and evaluated that way (the p-norm paper's character-level setting)
    mode: str = "stream"
    max_len: int = 100            # sentences: tokens kept per line
    train_sentences: int = 0      # sentences: a fixed random sample of this many training lines (0: all)

    def __post_init__(self) -> None:
        """Every value's type and range, here, before anything trains: a bad one otherwise fails at the end of a
        run (a ``save_dtype`` typo after the last epoch) or trains silently wrong (a negative clip turns the
        gradient around)."""
        for name, low in (("epochs", 1), ("batch_size", 1), ("bptt", 1), ("eval_batch_size", 1),
                          ("test_batch_size", 1), ("eval_bptt", 1), ("max_len", 1), ("nonmono", 0),
                          ("lr_decay_start", 0), ("train_sentences", 0)):
            _check_number(name, getattr(self, name), low, integer=True)
        for name, low, open_low in (("lr", 0.0, True), ("lr_decay", 0.0, True), ("cut_rate", 0.0, True),
                                    ("clip", 0.0, False), ("weight_decay", 0.0, False), ("adam_eps", 0.0, False),
                                    ("alpha", 0.0, False), ("beta", 0.0, False), ("checkpoint_minutes", 0.0, True),
                                    ("max_minutes", 0.0, False)):
            _check_number(name, getattr(self, name), low, open_low=open_low)
        for name in ("variable_bptt", "time_summed_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.cut_steps, list):
            raise ConfigError(f"cut_steps must be a list of epochs, got {self.cut_steps!r}")
        for e in self.cut_steps:
            _check_number("cut_steps[]", e, 1, integer=True)
        if not (isinstance(self.adam_betas, list) and len(self.adam_betas) == 2):
            raise ConfigError(f"adam_betas must be a list of two numbers in [0, 1), got {self.adam_betas!r}")
        for b in self.adam_betas:
            _check_number("adam_betas[]", b, 0.0)
            if b >= 1:
                raise ConfigError(f"adam_betas[] must be below 1, got {b!r}")
        for name, allowed in (("optimizer", ("sgd", "adam", "ntasgd")), ("save_dtype", SAVE_DTYPES),
                              ("mode", ("stream", "sentences"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.mode == "sentences":
            defaults = {f.name: f.default for f in fields(self)}
            inert = [n for n in STREAM_ONLY if getattr(self, n) != defaults[n]]
            if inert:
                raise ConfigError(f"{', '.join(inert)}: stream-mode option(s), meaningless with mode = \"sentences\" "
                                  "(each sequence is one line of at most max_len tokens): remove them")


#: The dtypes a release may be written in (``save_dtype``).
SAVE_DTYPES = ("float32", "float16", "bfloat16")


def _check_number(name: str, value: Any, low: float, integer: bool = False, open_low: bool = False) -> None:
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) if integer else isinstance(value, int | float) and math.isfinite(value)
    if isinstance(value, bool) or not ok or value < low or (open_low and value == low):
        bound = f"> {low:g}" if open_low else f">= {low:g}"
        raise ConfigError(f"{name} must be {kind} {bound}, got {value!r}")


@dataclass
class Recipe:
    name: str
    dataset: str
    seed: int
    model: dict[str, Any]
    train: TrainConfig
    description: str = ""
    source: str = ""
    reference: dict[str, Any] | None = None  # published numbers to compare with (shown in the model card)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Recipe:
        path = Path(path)
        if not path.is_file():
            raise MissingFileError(f"recipe not found: {path}")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not a valid TOML recipe ({e})") from None
        try:
            train = TrainConfig(**raw.get("train", {}))
            check_precision(train.precision)
            if not isinstance(raw["model"], dict) or "architecture" not in raw["model"]:
                raise ConfigError("[model] must be a table with an `architecture`")
            # the name is the run dir's (runs/NAME), which --restart clears: a plain name, never a path
            if not isinstance(raw["name"], str) or not RUN_NAME.fullmatch(raw["name"]) or ".." in raw["name"]:
                raise ConfigError(f"name must be a plain name (letters, digits, '.', '_', '-'), got "
                                  f"{raw['name']!r}")
            if not isinstance(raw.get("seed", 1), int) or isinstance(raw.get("seed", 1), bool):
                raise ConfigError(f"seed must be an integer, got {raw.get('seed')!r}")
            return cls(name=raw["name"], dataset=raw["dataset"], seed=int(raw.get("seed", 1)),
                       model=dict(raw["model"]), train=train, description=raw.get("description", ""),
                       source=str(path), reference=raw.get("reference"))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        # a missing table or key, an unknown [train] field, a value of the wrong kind (seed = "abc")
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: invalid recipe ({type(e).__name__}: {e})") from None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dataset": self.dataset, "seed": self.seed, "model": self.model,
                "train": asdict(self.train), "description": self.description,
                **({"reference": self.reference} if self.reference else {})}


#: A recipe's name: it names its run dir.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def recipe_path(name_or_path: str) -> Path:
    """A recipe file path, or the bundled recipe ``zoo/recipes/<name>.toml``."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    bundled = Path(__file__).resolve().parent / "recipes" / f"{name_or_path}.toml"
    if bundled.is_file():
        return bundled
    raise MissingFileError(f"no recipe file {name_or_path!r} and no bundled recipe of that name")


#: What a run writes into its run dir: ``zoo train --restart`` removes exactly these, and their presence makes a
#: plain ``zoo train`` refuse (it would have replaced a finished or resumable run's log and checkpoints).
RUN_PRODUCTS = ("checkpoint", "checkpoint.old", "checkpoint.tmp", "best", "release", "eval.json", "log.jsonl",
                "tensorboard")
#: What may change between a run and its ``--resume``: the budget (``--epochs`` extends a sweep prefix,
#: ``--max-minutes``) and how often it checkpoints; anything else would mix two recipes in one run.
RESUMABLE_CHANGES = ("epochs", "max_minutes", "checkpoint_minutes")


def run_products(run_dir: str | os.PathLike) -> list[str]:
    """The products of an earlier run in ``run_dir`` (empty for a new or empty folder)."""
    return [n for n in RUN_PRODUCTS if (Path(run_dir) / n).exists()]


def clear_run(run_dir: str | os.PathLike) -> None:
    """Remove an earlier run's products (and nothing else) so a restart cannot mix with them: a crash before the new
    run's first checkpoint would otherwise leave the old checkpoint beside the new log. Under the run dir's lock:
    a run still training there is refused, never cleared from under it."""
    with run_lock(Path(run_dir)):
        for name in run_products(run_dir):
            path = Path(run_dir) / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


class run_lock:  # noqa: N801  (a context manager, used as one)
    """The exclusive lock on ``RUN_DIR/.lock`` that one training process holds for its run (``flock``: released
    when the file is closed, also when the process dies); refused in one line when another process holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self.file: Any = None

    def __enter__(self) -> run_lock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a+")  # noqa: SIM115 (closed by __exit__)
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise UsageError(f"{self.path.parent} is being trained by another process") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.file.close()


def first_selectable_epoch(log: list[dict[str, Any]]) -> int:
    """The first epoch best/ can have been chosen from, given a run's ``log.jsonl`` records.

    A run carried between machines without best/'s own weights (``zoo/tools/ferry.py`` logs a ``ferried`` event
    with ``best_reset``) chose best/ again from the epoch the trip landed in (the next one when it landed mid-epoch):
    the final choice, and a card saying so, are made among epochs whose weights existed.
    """
    return max((r["epoch"] + (1 if r.get("pos") else 0) for r in log
                if r.get("event") == "ferried" and "best_reset" in r), default=1)


def nonmonotone_trigger(history: list[float], val_loss: float, nonmono: int) -> bool:
    """AWD-LSTM's NT-ASGD condition: the validation loss is worse than the best one from more than
    ``nonmono`` epochs ago (``history`` holds the earlier epochs' validation losses)."""
    return len(history) > nonmono and val_loss > min(history[:-nonmono] if nonmono else history)


# -- distributed -----------------------------------------------------------------------------------------
# Under ``torchrun`` every process is one rank. Decisions, in one place:
# * device: a CUDA run uses ``cuda:LOCAL_RANK`` (``set_device`` before the process group, ``device_ids`` for DDP);
# * seeds: the model is built from the recipe seed on every rank (and DDP broadcasts rank 0's weights anyway);
#   the random streams every rank must agree on (variable BPTT lengths, sentence order) are numpy generators
#   seeded by the recipe seed alone; dropout must differ between ranks (a single process draws independent masks
#   for every row of the batch, and each rank holds different rows), so rank r > 0 reseeds torch from
#   (seed, rank) after building the model, and from (seed, rank, step) after a resume (a checkpoint carries
#   rank 0's generator state). Rank 0 keeps the single-process stream, so one process trains as before;
# * teardown: the trainer destroys the process group it created when its run ends, also on error;
# * at the end of training the ranks compare a checksum of their weights and the run fails if they differ.
def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _parse_device(name: str | None) -> torch.device:
    """``--device``: cpu or cuda[:N] (default: cuda when there is one), refused in one line by
    :func:`zoo.device.resolve_device` when it is not a device or not one this machine has. An index is kept only
    when given (``_local_device`` picks ``cuda:LOCAL_RANK`` under torchrun)."""
    device = resolve_device("auto" if name is None else name, "--device")
    return device if device.type == "cpu" or ":" in (name or "") else torch.device("cuda")


def _local_device(device: torch.device) -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` under torchrun when no index was given."""
    if device.type == "cuda":
        if device.index is None and "LOCAL_RANK" in os.environ:
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        if device.index is None:   # torch 2.11 refuses set_device("cuda") without an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def _maybe_init_distributed(device: torch.device) -> bool:
    """Join the process group torchrun describes; True when this call created it (so the trainer tears it down)."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return True
    return False


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The torch seed of rank ``rank`` > 0 (see the decisions above): distinct per rank, per resume point."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


# -- optimiser state as tensors + JSON (no pickle) ------------------------------------------------------
def _flatten_optimizer(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors, scalars = {}, {"param_groups": sd["param_groups"], "state": {}}
    for pid, st in sd["state"].items():
        scalars["state"][str(pid)] = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars["state"][str(pid)][k] = v
    return tensors, scalars


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(pid): dict(st) for pid, st in scalars["state"].items()}
    for key, v in tensors.items():
        if key.startswith("optim."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = v
    return {"state": state, "param_groups": scalars["param_groups"]}


def _set_capturable(opt: torch.optim.Optimizer, on: bool, fused: bool = False) -> None:
    """Make a loaded Adam match this run: a checkpoint carries its writer's ``capturable`` and ``fused`` flags and
    step counters (on the device when captured, on the CPU when not), and either run may resume the other's
    checkpoint (a checkpoint written before Adam was fused on the CPU resumes fused)."""
    if not any("capturable" in g for g in opt.param_groups):
        return
    for g in opt.param_groups:
        g["capturable"] = on
        if "fused" in g:
            g["fused"] = fused or None
        for p in g["params"]:
            st = opt.state.get(p, {})
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].to(p.device if on else "cpu", torch.float32)


class Trainer:
    """Trains one recipe into ``run_dir``; see the module docstring."""

    def __init__(self, recipe: Recipe, run_dir: str | os.PathLike, data_dir: str | None = None,
                 device: str | None = None, progress: bool = True, crash_after_steps: int = 0,
                 checkpoint_every_steps: int = 0, crash_signal: int = signal.SIGKILL,
                 log_to: tuple[str, ...] = (), log_every_steps: int = 50, cuda_graphs: bool = False,
                 pause_after_minutes: float = 0.0):
        self.recipe, self.cfg = recipe, recipe.train
        # a piece of a longer run (a lent GPU's ten-minute call): stop at the first epoch end past this many minutes
        # of this process, checkpointed and unfinished (no test evaluation), for a later --resume to continue
        if not (math.isfinite(pause_after_minutes) and pause_after_minutes >= 0):
            raise ConfigError(f"pause_after_minutes must be a number >= 0, got {pause_after_minutes!r}")
        self.pause_after_minutes = pause_after_minutes
        self.run_dir = Path(run_dir)
        self.device = _parse_device(device)
        # Carried recurrent states drift into denormal floats, which made CPU training ~15x slower
        # (measured: 7.6k vs 0.4k tokens/s for the 2x200 LSTM); flushing them changes no metric.
        torch.set_flush_denormal(True)
        self.device = _local_device(self.device)
        self._owns_process_group = _maybe_init_distributed(self.device)
        self.rank, self.world = _dist_info()
        if self.cfg.batch_size % self.world:
            raise ConfigError(f"batch_size {self.cfg.batch_size} is not divisible by {self.world} processes")
        self.progress = progress and self.rank == 0
        self.crash_after_steps = crash_after_steps  # test hook: signal ourselves after this many steps
        self.crash_signal = crash_signal            # (SIGKILL: a crash; SIGTERM / SIGINT: a polite stop)
        self._stop_signal = 0                       # set by the SIGTERM / SIGINT handler of run()
        self.checkpoint_every_steps = checkpoint_every_steps
        unknown = set(log_to) - set(LOG_TARGETS)
        if unknown:
            raise ConfigError(f"unknown log target(s) {sorted(unknown)}; known: {', '.join(LOG_TARGETS)}")
        if log_every_steps < 1:
            raise ConfigError("log_every_steps must be >= 1")
        self.log_to, self.log_every_steps = tuple(log_to), log_every_steps
        self._tb: Any = None          # the TensorBoard writer, opened by run() on rank 0
        self._tb_loss = [0.0, 0]      # loss sum and steps since the last step-level record
        self.corpus: Corpus = load_corpus(recipe.dataset, data_dir)
        self.tokenizer = Tokenizer(self.corpus.vocab, get_dataset(recipe.dataset).normalization)
        torch.manual_seed(recipe.seed)
        model_args = dict(recipe.model)
        model_args["vocab_size"] = len(self.corpus.vocab)
        try:
            self.model = LanguageModel(**model_args).to(self.device)
        except TypeError as e:  # an unknown or missing [model] key
            raise ConfigError(f"{recipe.source or recipe.name}: [model]: {e}") from None
        self.train_module: torch.nn.Module = _TrainForward(self.model)
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_module = torch.nn.parallel.DistributedDataParallel(self.train_module, device_ids=ids)
        if self.rank > 0:
            torch.manual_seed(rank_seed(recipe.seed, self.rank))
        self.cuda_graphs = cuda_graphs
        self._fused_adam = self.device.type == "cpu" and self.cfg.optimizer == "adam"
        self._params = list(self.model.parameters())
        self.optimizer = self._make_optimizer(self.cfg.optimizer)
        self.sentence_mode = self.cfg.mode == "sentences"
        if self.sentence_mode:
            if self.world > 1:
                raise ConfigError("mode = 'sentences' trains in one process (no torchrun)")
            eos = self.tokenizer.eos_id
            self.sentences = {
                "train": sentences(self.corpus.train, eos, self.cfg.max_len, self.cfg.train_sentences),
                "valid": sentences(self.corpus.valid, eos, self.cfg.max_len),
                "test": sentences(self.corpus.test, eos, self.cfg.max_len)}
            self.train_data = self.corpus.train[:0]
        else:
            global_train = batchify(self.corpus.train, self.cfg.batch_size)
            per = self.cfg.batch_size // self.world
            self.train_data = global_train[:, self.rank * per:(self.rank + 1) * per].contiguous().to(self.device)
        # everything below is what a checkpoint restores
        self.epoch, self.pos, self.step, self.lr = 1, 0, 0, self.cfg.lr
        self.best_val, self.history, self.elapsed = math.inf, [], 0.0
        self.state = None
        self.bptt_rng = np.random.default_rng(recipe.seed)
        self.epoch_loss, self.epoch_tokens, self.epoch_seconds = 0.0, 0, 0.0
        self.asgd = False  # set when NT-ASGD switches to averaged SGD
        self._graphs: Any = None
        if cuda_graphs:
            from zoo.captured_step import CapturedSteps
            self._graphs = CapturedSteps(self)

    # -- setup ---------------------------------------------------------------------------------------
    def _make_optimizer(self, kind: str) -> torch.optim.Optimizer:
        params = self.model.parameters()
        if kind == "adam":
            # capturable: its step count lives on the device, so a CUDA graph can replay the update.
            # fused on the CPU: one pass over each parameter instead of one per term of the update (the
            # WikiText-2 models' step: 9 ms against 91 ms, ~10% of a training step; same formula).
            return torch.optim.Adam(params, lr=self.cfg.lr, betas=tuple(self.cfg.adam_betas),
                                    eps=self.cfg.adam_eps, weight_decay=self.cfg.weight_decay,
                                    capturable=self.cuda_graphs, fused=self._fused_adam or None)
        if kind in ("sgd", "ntasgd"):
            return torch.optim.SGD(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        if kind == "asgd":
            return torch.optim.ASGD(params, lr=self.lr, t0=0, lambd=0.0, weight_decay=self.cfg.weight_decay,
                                    capturable=self.cuda_graphs)
        raise ConfigError(f"unknown optimizer {kind!r} (sgd, adam, ntasgd)")

    # -- checkpoints ------------------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoint"

    def save_training_checkpoint(self) -> None:
        self._check_finite()  # a diverged run keeps its last good checkpoint
        carry = self._gather_carry()  # (collective under torchrun: before rank 0 alone goes on)
        if self.rank != 0:
            return
        tmp = self.run_dir / "checkpoint.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()
                   if k not in self.model.tied_keys()}
        opt_t, opt_s = _flatten_optimizer(self.optimizer)
        tensors.update(opt_t)
        tensors["rng.torch"] = torch.get_rng_state()
        if self.device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self.device)
        for r, state in enumerate(carry or []):  # rank 0's as carry.I (the single-process layout), rank r's as
            for i, s in enumerate(state):        # carry.rankR.I
                tensors[f"carry.{i}" if r == 0 else f"carry.rank{r}.{i}"] = s.cpu()
        save_file(tensors, str(tmp / "state.safetensors"))
        meta = {
            "epoch": self.epoch, "pos": self.pos, "step": self.step, "lr": self.lr, "best_val": self.best_val,
            "history": self.history, "elapsed": self.elapsed, "optimizer": "asgd" if self.asgd else
            self.cfg.optimizer, "optim_scalars": opt_s, "bptt_rng": self.bptt_rng.bit_generator.state,
            "python_rng": list(random.getstate()[1]), "epoch_loss": self.epoch_loss,
            "epoch_tokens": self.epoch_tokens, "epoch_seconds": self.epoch_seconds,
            "has_carry": self.state is not None, "recipe": self.recipe.to_dict(), "world_size": self.world,
            # the log as far as this checkpoint: a resume drops the epoch lines written after it (a crash between
            # an epoch's log line and its checkpoint would otherwise log that epoch twice)
            "log_bytes": self._log_size(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        for f in tmp.iterdir():  # flush file contents before the directory swap
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = self.run_dir / "checkpoint.old"
        if old.exists() and (self.ckpt_dir / "meta.json").is_file():
            shutil.rmtree(old)  # left by a crash while it was being removed: it would block the rename below
        if self.ckpt_dir.exists():
            os.replace(self.ckpt_dir, old)
        os.replace(tmp, self.ckpt_dir)
        if old.exists():
            shutil.rmtree(old)

    def _log_size(self) -> int:
        path = self.run_dir / "log.jsonl"
        return path.stat().st_size if path.exists() else 0

    def _check_finite(self) -> None:
        """Stop a run whose training loss or weights have become NaN or infinite (they stay so: every later step
        and checkpoint would be garbage), logging where, and keeping the last good checkpoint and best model. The
        weights are checked too because an exploding step's loss is still finite while the update it makes is not:
        checking the loss alone would write that update as the "last good" checkpoint. Under torchrun each rank
        sees only its own columns' loss: the ranks agree, so all stop (and rank 0 logs)."""
        finite = math.isfinite(self.epoch_loss) and bool(
            torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all())
        if self.world > 1:
            flag = torch.tensor([int(finite)], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = bool(flag[0])
        if finite:
            return
        self._log_line({"event": "diverged", "epoch": self.epoch, "pos": self.pos, "step": self.step,
                        "lr": self.lr})
        raise TrainingDiverged(f"training diverged at epoch {self.epoch}, step {self.step} (the training loss or "
                               f"the weights are not finite); the last good checkpoint and best model in "
                               f"{self.run_dir} are kept: lower the lr (or clip) and train again with --restart")

    def load_training_checkpoint(self) -> bool:
        ckpt = self.ckpt_dir
        if not (ckpt / "meta.json").is_file():
            old = self.run_dir / "checkpoint.old"  # a crash between the two renames
            if (old / "meta.json").is_file():
                ckpt = old
            else:
                return False
        meta = json.loads((ckpt / "meta.json").read_text())
        self._check_same_recipe(meta.get("recipe"))
        saved_world = meta.get("world_size")  # (not recorded before per-rank carried states were saved)
        if saved_world is not None and saved_world != self.world and meta["epoch"] <= self.cfg.epochs:
            how = f"torchrun --nproc-per-node {saved_world}" if saved_world > 1 else "one process, no torchrun"
            raise ConfigError(f"{ckpt} was written by {saved_world} process(es) and this run has {self.world}: "
                              f"each process trains its own columns of the batch with its own carried state, so "
                              f"resume with the same number ({how})")
        tensors = load_file(str(ckpt / "state.safetensors"))
        model_sd = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
        self.model.load_state_dict(model_sd, strict=False)
        if meta["optimizer"] == "asgd":
            self.asgd = True
            self.optimizer = self._make_optimizer("asgd")
        self.optimizer.load_state_dict(_unflatten_optimizer(tensors, meta["optim_scalars"]))
        _set_capturable(self.optimizer, self.cuda_graphs, self._fused_adam)
        torch.set_rng_state(tensors["rng.torch"])
        if "rng.cuda" in tensors and self.device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng.cuda"], self.device)
        self.bptt_rng.bit_generator.state = meta["bptt_rng"]
        if self.rank > 0:  # the checkpoint holds rank 0's generator: give this rank its own stream again
            torch.manual_seed(rank_seed(self.recipe.seed, self.rank, int(meta["step"])))
        random.setstate((3, tuple(meta["python_rng"]), None))
        for k in ("epoch", "pos", "step", "lr", "best_val", "history", "elapsed", "epoch_loss",
                  "epoch_tokens", "epoch_seconds"):
            setattr(self, k, meta[k])
        self.state = None
        if meta["has_carry"]:
            prefix = "carry." if self.rank == 0 else f"carry.rank{self.rank}."
            if not any(k.startswith(prefix) for k in tensors):  # older multi-process checkpoints kept rank 0's only
                prefix = "carry."
            n = len([k for k in tensors if k.startswith(prefix) and k[len(prefix):].isdigit()])
            self.state = tuple(tensors[f"{prefix}{i}"].to(self.device) for i in range(n))
        if "log_bytes" in meta and self.rank == 0:
            self._trim_log(meta["log_bytes"])
        return True

    def _check_same_recipe(self, saved: dict[str, Any] | None) -> None:
        """Refuse to resume under a recipe that differs from the one the checkpoint was trained with (a new lr,
        batch size or dropout would silently mix two runs in one log and model), except the budget."""
        if saved is None:
            return
        now = self.recipe.to_dict()
        diff = [k for k in ("dataset", "seed") if saved.get(k) != now.get(k)]
        defaults = {"model": {}, "train": asdict(TrainConfig())}  # a field added since: its default is no change
        for table in ("model", "train"):
            old, new = saved.get(table, {}), now[table]
            diff += [f"{table}.{k}" for k in sorted(set(old) | set(new))
                     if not (table == "train" and k in RESUMABLE_CHANGES)
                     and old.get(k, defaults[table].get(k)) != new.get(k, defaults[table].get(k))]
        if diff:
            raise ConfigError(f"the recipe changed since {self.run_dir} was trained ({', '.join(diff)}): resume it "
                              f"with the recipe it started with, or start over with --restart")

    def _trim_log(self, size: int) -> None:
        """Drop what the log gained after the checkpoint that the run resumes from: epoch records (the resumed
        run writes them again) and a line cut short by a crash; event lines (an interruption) stay."""
        path = self.run_dir / "log.jsonl"
        if not path.exists() or path.stat().st_size <= size:
            return
        data = path.read_bytes()
        kept = [data[:size]]
        for line in data[size:].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a partial line
            if isinstance(rec, dict) and "epoch" in rec and "valid_ppl" in rec:
                continue
            kept.append(line + b"\n")
        write_atomic(path, b"".join(kept))

    # -- evaluation -------------------------------------------------------------------------------------------
    def _averaged(self) -> dict[str, torch.Tensor] | None:
        """With ASGD, swap in the averaged weights (``ax``) and return the originals to restore."""
        if not self.asgd:
            return None
        backup = {}
        for p in self.model.parameters():
            st = self.optimizer.state.get(p, {})
            if "ax" in st:
                backup[p] = p.detach().clone()
                with torch.no_grad():   # (not .data: an in-place change the compiled loops' weight cache sees)
                    p.copy_(st["ax"])
        return backup

    def _restore(self, backup) -> None:
        with torch.no_grad():
            for p, v in (backup or {}).items():
                p.copy_(v)

    def evaluate(self, split: str, batch_size: int) -> dict[str, Any]:
        self.model.eval()
        res = self._evaluate_with(self.model, split, batch_size, split)
        self.model.train()
        return res

    def _evaluate_with(self, model: LanguageModel, split: str, batch_size: int, desc: str) -> dict[str, Any]:
        """A split's metrics in the run's mode: one carried stream, or every line on its own."""
        runner = _DeviceRunner(model, self.device)
        if self.sentence_mode:
            return evaluate_sentences(runner, self.sentences[split], batch_size=batch_size,
                                      pad_id=self.tokenizer.eos_id, progress=self.progress, desc=desc)
        return evaluate_stream(runner, self.corpus.split(split), batch_size=batch_size, bptt=self.cfg.eval_bptt,
                               progress=self.progress, desc=desc)

    def _sentence_batches(self) -> list[list[int]]:
        """This epoch's batches of training-sentence indices: a permutation drawn from (seed, epoch), so a resumed
        run sees the same order without storing it."""
        n, bsz = len(self.sentences["train"]), self.cfg.batch_size
        perm = np.random.default_rng([self.recipe.seed, self.epoch]).permutation(n).tolist()
        return [perm[i:i + bsz] for i in range(0, n, bsz)]

    # -- training ------------------------------------------------------------------------------------------
    def _seq_len(self) -> int:
        bptt = self.cfg.bptt
        if not self.cfg.variable_bptt:
            return bptt
        base = bptt if self.bptt_rng.random() < 0.95 else bptt / 2
        return max(5, int(self.bptt_rng.normal(base, 5)))

    def _next_batch(self, order: list[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """The epoch's next training batch from ``self.pos``: ``(x, y, seq_len, next pos)``, or ``None`` at its end.

        Stream mode: ``pos`` is a row of the batchified stream and ``seq_len`` the (variable) BPTT length drawn here.
        Sentence mode: ``pos`` indexes this epoch's batches (``order``); ``seq_len`` is ``bptt`` (no lr scaling).
        """
        if order is not None:
            if self.pos >= len(order):
                return None
            x, y = pad_batch([self.sentences["train"][i] for i in order[self.pos]], self.tokenizer.eos_id)
            return x.to(self.device), y.to(self.device), self.cfg.bptt, self.pos + 1
        n_rows = self.train_data.shape[0]
        if self.pos >= n_rows - 1:
            return None
        seq_len = min(self._seq_len(), n_rows - 1 - self.pos)
        x = self.train_data[self.pos:self.pos + seq_len].t()
        y = self.train_data[self.pos + 1:self.pos + 1 + seq_len].t()
        return x, y, seq_len, self.pos + seq_len

    def _lr_for_epoch(self) -> None:
        """Apply the per-epoch schedule at the start of ``self.epoch``."""
        if self.cfg.optimizer == "sgd" and self.cfg.lr_decay != 1.0 and self.cfg.lr_decay_start:
            self.lr = self.cfg.lr * self.cfg.lr_decay ** max(0, self.epoch - self.cfg.lr_decay_start + 1)
        elif self.cfg.cut_steps:
            self.lr = self.cfg.lr / self.cfg.cut_rate ** sum(1 for e in self.cfg.cut_steps if self.epoch > e)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, seq_len: int) -> float:
        """One update on ``x -> y`` (``[B, T]``); returns the mean loss over the predicted targets. Targets equal
        to ``PAD_TARGET`` (sentence mode's padding) are not predicted: they count in neither the loss nor AR/TAR.
        With ``cuda_graphs`` the same update is replayed from a CUDA graph (:mod:`zoo.captured_step`)."""
        if self._graphs is not None:
            return self._graphs.step(x, y, seq_len)
        if self.state is not None:
            self.state = tuple(s.detach() for s in self.state)
        loss, self.state = self.update(x, y, seq_len, self.state)
        return float(loss)

    def update(self, x: torch.Tensor, y: torch.Tensor, seq_len: int, state: Any,
               capturing: bool = False) -> tuple[torch.Tensor, Any]:
        """The arithmetic of one update: ``(mean loss, new state)`` as tensors, with no host synchronisation, so
        that :mod:`zoo.captured_step` can capture exactly this code as a CUDA graph (``capturing``: autocast's
        weight cache off, as graphs require)."""
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr * seq_len / self.cfg.bptt
        with autocast(self.cfg.precision, self.device, cache=not capturing):
            # logits, softmax and loss in float32 (on the CPU the decoder is fused with the loss: zoo.lm)
            loss, raw, dropped, state = self.train_module(x, y, state)
        total = loss * seq_len if self.cfg.time_summed_loss else loss
        keep = (y != PAD_TARGET).unsqueeze(-1).to(raw.dtype) if self.sentence_mode else None
        if self.cfg.alpha:
            ar = dropped.pow(2)
            total = total + self.cfg.alpha * (ar.mean() if keep is None else
                                              (ar * keep).sum() / (keep.sum() * ar.shape[-1]))
        if self.cfg.beta:
            tar = (raw[:, 1:] - raw[:, :-1]).pow(2)
            if keep is None:
                total = total + self.cfg.beta * tar.mean()
            else:
                k = keep[:, 1:]
                total = total + self.cfg.beta * (tar * k).sum() / (k.sum().clamp_min(1) * tar.shape[-1])
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
            if self.epoch > self.cfg.epochs and (done := self._finished_result()) is not None:
                return done  # nothing left to train: its results stand (the test split is not scored again)
            self._log_line({"event": "resumed", "epoch": self.epoch, "pos": self.pos, "step": self.step})
            if (self.run_dir / "eval.json").exists() and self.rank == 0:  # a sweep prefix continued: not finished
                (self.run_dir / "eval.json").unlink()  # until it is (bundle and tiers would take its old numbers)
                self._log_line({"event": "continued", "epochs": self.cfg.epochs})
        else:
            if resume and self.rank == 0:
                if any((self.run_dir / n).exists() for n in ("best", "release", "eval.json")):
                    raise UsageError(f"nothing to resume in {self.run_dir} (no checkpoint), but it holds an earlier "
                                     f"run's results: start over with --restart")
                print(f"zoo train: nothing to resume in {self.run_dir} (no checkpoint): training from the start",
                      file=sys.stderr, flush=True)
            if (self.run_dir / "log.jsonl").exists() and self.rank == 0:
                (self.run_dir / "log.jsonl").unlink()
        if "tensorboard" in self.log_to and self.rank == 0:
            self._tb = _tensorboard_writer(self.run_dir / "tensorboard", self.step)
        try:
            with _stop_on_signals(self):
                return self._run()
        finally:
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            if self._owns_process_group and dist.is_initialized():
                dist.destroy_process_group()

    def _finished_result(self) -> dict[str, Any] | None:
        """The ``eval.json`` of a run that has trained every epoch asked for, if it was written after the last
        checkpoint's epochs (a resumed finished run reports it instead of evaluating the test split again)."""
        path = self.run_dir / "eval.json"
        if not path.is_file():
            return None
        try:
            result = json.loads(path.read_text())
        except ValueError:
            return None
        return result if isinstance(result, dict) and result.get("epochs_trained") == self.epoch - 1 else None

    def _run(self) -> dict[str, Any]:
        self.model.train()
        cfg = self.cfg
        start_wall = self._start_wall = time.time() - self.elapsed
        piece_start = time.time()
        last_ckpt = time.time()
        steps_since_start = 0
        while self.epoch <= cfg.epochs:
            if self.pos == 0:
                self._lr_for_epoch()
                self.state = None
                self.epoch_loss, self.epoch_tokens, self.epoch_seconds = 0.0, 0, 0.0
            order = self._sentence_batches() if self.sentence_mode else None
            total = len(order) if order is not None else self.train_data.shape[0] - 1
            bar = tqdm(total=total, initial=self.pos, desc=f"epoch {self.epoch}/{cfg.epochs}",
                       unit="batch" if order is not None else "row", disable=not self.progress, leave=False)
            t0 = time.time()
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
                    steps_since_start += 1
                    if self._tb is not None:
                        self._tb_step(loss)
                    if self.progress and self.step % 20 == 0:
                        bar.set_postfix(loss=f"{self.epoch_loss / self.epoch_tokens:.3f}", lr=f"{self.lr:.3g}")
                    now = time.time()
                    due = (self.checkpoint_every_steps and self.step % self.checkpoint_every_steps == 0) or \
                        now - last_ckpt > cfg.checkpoint_minutes * 60
                    # test hook (before the decisions below, so a signal it sends is acted on at this step; under
                    # torchrun only the last rank signals itself: the others learn of the stop from the agreement)
                    if self.crash_after_steps and steps_since_start == self.crash_after_steps and \
                            self.rank == self.world - 1:
                        os.kill(os.getpid(), self.crash_signal)
                    # the decisions every rank must share; the handler's flag is only read here, never overwritten (a
                    # signal arriving after this point is acted on at the next step)
                    due, stop = self._agree(bool(due) and self.pos < total, self._stop_signal)
                    if due and not stop:  # (a stop writes its own checkpoint just below)
                        self.epoch_seconds += now - t0
                        t0 = now
                        self.elapsed = now - start_wall
                        self.save_training_checkpoint()
                        last_ckpt = now
                    if stop:
                        self.epoch_seconds += time.time() - t0
                        self.elapsed = time.time() - start_wall
                        self.save_training_checkpoint()
                        self._log_line({"event": "interrupted", "signal": signal.Signals(stop).name,
                                        "epoch": self.epoch, "pos": self.pos, "step": self.step})
                        bar.close()
                        if self.world > 1:  # no rank exits before rank 0 has written: torchrun answers a rank's exit
                            dist.barrier()  # by sending SIGTERM to the others
                        raise Interrupted(stop, self.ckpt_dir)
            except BaseException:  # (a divergence, a crash): the error line starts on a line of its own
                bar.close()
                raise
            bar.close()
            self.epoch_seconds += time.time() - t0
            self._end_epoch()
            self.elapsed = time.time() - start_wall
            self.save_training_checkpoint()
            last_ckpt = time.time()
            over, _ = self._agree(bool(cfg.max_minutes) and self.elapsed > cfg.max_minutes * 60, 0)  # (own clocks)
            if over and self.epoch <= cfg.epochs:
                self._log_line({"event": "budget_stop", "epoch": self.epoch - 1, "elapsed": self.elapsed})
                break
            pause, _ = self._agree(bool(self.pause_after_minutes) and
                                   time.time() - piece_start > self.pause_after_minutes * 60, 0)
            if pause and self.epoch <= cfg.epochs:
                self._log_line({"event": "paused", "epoch": self.epoch - 1, "step": self.step, "elapsed": self.elapsed})
                return {"paused": True, "epochs_trained": self.epoch - 1, "epochs": cfg.epochs,
                        "valid_ppl": math.exp(self.history[-1]) if self.history else None}
        self._check_ranks_in_sync()
        return self.finish()

    def _agree(self, due: bool, stop_signal: int) -> tuple[bool, int]:
        """Under torchrun, make every rank take the same decision: checkpoint now (the wall-clock trigger fires
        on each rank's own clock), stop now (a signal reaches the ranks at different steps), stop for the time
        budget. Saving gathers every rank's carried state, so a rank that saved or stopped alone would wait
        forever on the others. One small all-reduce (max over ranks); a single process decides alone."""
        if self.world < 2:
            return due, stop_signal
        flags = torch.tensor([int(due), int(stop_signal)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), int(flags[1])

    def _gather_carry(self) -> list[tuple[torch.Tensor, ...]] | None:
        """Every rank's carried state, by rank (rank r trains on its own columns of the batch, so its state is its
        own): collective, so every rank calls it at the same point. None when no state is carried."""
        if self.state is None:
            return None
        mine = tuple(s.detach().contiguous() for s in self.state)
        if self.world < 2:
            return [mine]
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for s in mine:
            bufs = [torch.empty_like(s) for _ in range(self.world)]
            dist.all_gather(bufs, s)
            for r, b in enumerate(bufs):
                per_rank[r].append(b)
        return [tuple(x) for x in per_rank]

    def _check_ranks_in_sync(self) -> None:
        """DDP keeps the replicas equal; a checksum per rank proves it before rank 0 evaluates and writes."""
        if self.world < 2:
            return
        mine = torch.tensor([sum(float(p.detach().double().sum()) for p in self.model.parameters())],
                            dtype=torch.float64, device=self.device)
        sums = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(sums, mine)
        values = [float(t) for t in sums]
        if max(values) - min(values) > 1e-6 * max(1.0, abs(values[0])):
            raise RuntimeError(f"DDP replicas diverged: weight checksums per rank {values}")
        self.ranks_in_sync = True

    def _end_epoch(self) -> None:
        backup = self._averaged()
        self._check_finite()
        val = self.evaluate("valid", self.cfg.eval_batch_size)
        if not math.isfinite(val["avg_nll"]):
            self._restore(backup)
            self.epoch_loss = math.nan  # the weights give non-finite logits: diverged as well
            self._check_finite()
        train_loss = self.epoch_loss / max(1, self.epoch_tokens)
        improved = val["avg_nll"] < self.best_val
        if improved:
            self.best_val = val["avg_nll"]
            if self.rank == 0:
                self._save_best()
        self._restore(backup)
        rec = {"epoch": self.epoch, "train_loss": train_loss,
               "train_ppl": math.exp(train_loss) if train_loss < 709 else None,  # (None, not logged: past float64)
               "valid_loss": val["avg_nll"], "valid_ppl": val["ppl"], "lr": self.lr,
               "seconds": self.epoch_seconds, "tokens_per_s": self.epoch_tokens * self.world /
               max(1e-9, self.epoch_seconds), "optimizer": "asgd" if self.asgd else self.cfg.optimizer,
               "best": improved, "wall_seconds": time.time() - self._start_wall,
               "device": _device_name(self.device)}  # per epoch: a run trained in pieces may change machines
        self._log_line(rec)
        if self._tb is not None:
            for key in ("train_ppl", "valid_ppl", "valid_loss", "tokens_per_s"):
                if rec[key] is not None:
                    self._tb.add_scalar(f"epoch/{key}", rec[key], self.epoch)
            self._tb.add_scalar("valid/ppl", rec["valid_ppl"], self.step)
            self._tb.flush()
        if self.cfg.optimizer == "ntasgd" and not self.asgd:
            if nonmonotone_trigger(self.history, val["avg_nll"], self.cfg.nonmono):
                self.asgd = True
                self.optimizer = self._make_optimizer("asgd")
                self._log_line({"event": "switch_to_asgd", "epoch": self.epoch})
        self.history.append(val["avg_nll"])
        self.epoch += 1
        self.pos = 0

    def _save_best(self) -> None:
        save_checkpoint(self.run_dir / "best", self.model, self.tokenizer,
                        {"name": self.recipe.name, "dataset": self.recipe.dataset, "recipe": self.recipe.to_dict()})

    def finish(self) -> dict[str, Any]:
        """Evaluate the best checkpoint on valid and (once) on test; write ``eval.json``."""
        if self.rank != 0:
            return {}
        if not (self.run_dir / "best" / "config.json").is_file():
            raise TrainingDiverged(f"{self.run_dir} has no best model: no epoch ended with a finite validation loss")
        # an earlier eval.json (a sweep prefix now continued) no longer describes release/: it goes before
        # release/ changes, so a crash in between never leaves the new weights beside the old numbers
        (self.run_dir / "eval.json").unlink(missing_ok=True)
        best_model, _, _ = load_checkpoint(self.run_dir / "best")
        best_model.to(self.device)
        valid = self._evaluate_with(best_model, "valid", self.cfg.eval_batch_size, "valid(best)")
        test = self._evaluate_with(best_model, "test", self.cfg.test_batch_size, "test(best)")
        release = self._write_release(valid, test)
        log = [json.loads(line) for line in (self.run_dir / "log.jsonl").read_text().splitlines()]
        epochs = [r for r in log if "epoch" in r and "valid_ppl" in r]
        first = first_selectable_epoch(log)
        chosen = [r for r in epochs if r["epoch"] >= first] or epochs
        result = {
            "name": self.recipe.name, "dataset": self.recipe.dataset, "architecture": self.model.architecture,
            "num_parameters": self.model.num_parameters(), "valid": valid, "test": test,
            "epochs_trained": len(epochs), "best_epoch": min(chosen, key=lambda r: r["valid_loss"])["epoch"],
            "train_seconds": sum(r["seconds"] for r in epochs), "device": _device_name(self.device),
            "world_size": self.world, "recipe": self.recipe.to_dict(), "release": release,
            "mode": self.cfg.mode,
        }
        if self.world > 1:
            result["ranks_in_sync"] = getattr(self, "ranks_in_sync", False)
        write_atomic(self.run_dir / "eval.json", json.dumps(result, indent=2) + "\n")
        self._log_line({"event": "finished", "best_valid_ppl": valid["ppl"], "best_test_ppl": test["ppl"]})
        return result

    def _write_release(self, valid: dict[str, Any], test: dict[str, Any]) -> dict[str, Any]:
        """Write ``release/``, the checkpoint to bundle, in ``save_dtype``; measure what the cast costs.

        Half precision halves the zoo's size; the valid/test perplexity of the cast weights (computed
        back in float32) is recorded next to the float32 numbers so the change is reported, not assumed.
        """
        dtype = getattr(torch, self.cfg.save_dtype)
        model, tok, config = load_checkpoint(self.run_dir / "best")
        release_dir = self.run_dir / "release"
        extra = {k: config[k] for k in ("name", "dataset", "recipe") if k in config}
        save_checkpoint(release_dir, model, tok, extra, dtype=None if dtype == torch.float32 else dtype)
        if dtype == torch.float32:
            return {"dtype": "float32", "valid": valid, "test": test}
        cast, _, _ = load_checkpoint(release_dir)
        cast.to(self.device)
        rv = self._evaluate_with(cast, "valid", self.cfg.eval_batch_size, "valid(release)")
        rt = self._evaluate_with(cast, "test", self.cfg.test_batch_size, "test(release)")
        return {"dtype": self.cfg.save_dtype, "valid": rv, "test": rt,
                "valid_ppl_change": rv["ppl"] / valid["ppl"] - 1, "test_ppl_change": rt["ppl"] / test["ppl"] - 1}

    def _tb_step(self, loss: float) -> None:
        """Step-level TensorBoard scalars: the mean training loss of the last ``log_every_steps`` steps, the lr."""
        self._tb_loss[0] += loss
        self._tb_loss[1] += 1
        if self.step % self.log_every_steps == 0:
            self._tb.add_scalar("train/loss", self._tb_loss[0] / self._tb_loss[1], self.step)
            self._tb.add_scalar("train/lr", self.lr, self.step)
            self._tb_loss = [0.0, 0]

    def _log_line(self, rec: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        rec = {k: v for k, v in rec.items() if v is not None}
        rec["time"] = time.time()
        with open(self.run_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.progress and "valid_ppl" in rec:
            tqdm.write(f"epoch {rec['epoch']}: train ppl {rec.get('train_ppl', math.inf):.2f}  "
                       f"valid ppl {rec['valid_ppl']:.2f}  "
                       f"lr {rec['lr']:.3g}  {rec['tokens_per_s']:.0f} tok/s")


#: Where ``zoo train --log-to`` can send metrics besides ``log.jsonl`` (always written: the source of record).
LOG_TARGETS = ("tensorboard",)


def _tensorboard_writer(logdir: Path, step: int) -> Any:
    """A TensorBoard ``SummaryWriter`` in ``logdir``. On a resume, events past ``step`` (written after the
    checkpoint the run resumes from) are purged, so the curves never show a step twice."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        raise ConfigError("--log-to tensorboard needs the tensorboard package: pip install 'alstm-zoo[train]' "
                         f"({e})") from None
    return SummaryWriter(str(logdir), purge_step=step or None)


class TrainingDiverged(ZooError):
    """The training loss became NaN or infinite: the run stops, keeping its last good checkpoint (exit 2)."""


class Interrupted(Exception):
    """Training stopped by SIGTERM / SIGINT after writing a checkpoint (``zoo train`` exits 128 + the signal)."""

    def __init__(self, signum: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} with a checkpoint in {checkpoint}; continue with "
                         f"--resume")
        self.signum = signum


class _stop_on_signals:  # noqa: N801  (a context manager, used as one)
    """While training, SIGTERM and SIGINT ask the trainer to stop after its current step (it then checkpoints);
    a second signal of either kind kills the process at once. Handlers are restored on exit. Only in the main
    thread (Python delivers signals there; elsewhere the default handling stays)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.previous = trainer, {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.trainer._stop_signal:   # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.trainer._stop_signal = signum

    def __enter__(self) -> _stop_on_signals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class _TrainForward(torch.nn.Module):
    """The module DDP wraps: its forward is the LM's ``training_loss`` (the loss inside the forward, so DDP sees
    every parameter used; the hidden outputs come back for AR/TAR)."""

    def __init__(self, model: LanguageModel):
        super().__init__()
        self.model = model

    def forward(self, x, y, state=None):
        return self.model.training_loss(x, y, state, ignore_index=PAD_TARGET)


class _DeviceRunner:
    """Runs an LM on a device for evaluation, returning logits on that device."""

    def __init__(self, model: LanguageModel, device: torch.device):
        self.model, self.device = model, device

    def init_state(self, batch_size: int):
        return self.model.init_state(batch_size, self.device)

    def forward(self, tokens, state):
        return self.model(tokens.to(self.device), state)

    def target_logprobs(self, tokens, targets, state):
        return self.model.target_logprobs(tokens.to(self.device), targets.to(self.device), state)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
