"""A recipe: the TOML file holding every hyper-parameter of a run, and the checks it passes before anything trains.

Why here, apart from the trainer: ``zoo train A B --jobs 2``, the checkout tooling (``zoo.tools.gpu.piece``,
``cards``) and the tests read recipes without training; and a value out of its type or range must fail at load in
one line, not after the last epoch (a ``save_dtype`` typo) or silently (a negative clip turns the gradient around).
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from zoo.errors import ConfigError, MissingFileError
from zoo.lm import LanguageModel
from zoo.precision import check as check_precision

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
    """A whole recipe: what trains (``[model]``), on what (``dataset``, ``seed``) and how (``[train]``)."""

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

    def build_model(self, vocab_size: int) -> LanguageModel:
        """The ``[model]`` table's model for a vocabulary of ``vocab_size`` (a bad key is a one-line ConfigError)."""
        model_args = dict(self.model)
        model_args["vocab_size"] = vocab_size
        try:
            return LanguageModel(**model_args)
        except TypeError as e:  # an unknown or missing [model] key
            raise ConfigError(f"{self.source or self.name}: [model]: {e}") from None

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
    bundled = Path(__file__).resolve().parents[1] / "recipes" / f"{name_or_path}.toml"
    if bundled.is_file():
        return bundled
    raise MissingFileError(f"no recipe file {name_or_path!r} and no bundled recipe of that name")


#: What may change between a run and its ``--resume``: the budget (``--epochs`` extends a sweep prefix,
#: ``--max-minutes``) and how often it checkpoints; anything else would mix two recipes in one run.
RESUMABLE_CHANGES = ("epochs", "max_minutes", "checkpoint_minutes")


def check_same_recipe(saved: dict[str, Any] | None, recipe: Recipe, run_dir: Path) -> None:
    """Refuse to resume under a recipe that differs from the one the checkpoint was trained with (a new lr,
    batch size or dropout would silently mix two runs in one log and model), except the budget."""
    if saved is None:
        return
    now = recipe.to_dict()
    diff = [k for k in ("dataset", "seed") if saved.get(k) != now.get(k)]
    defaults = {"model": {}, "train": asdict(TrainConfig())}  # a field added since: its default is no change
    for table in ("model", "train"):
        old, new = saved.get(table, {}), now[table]
        diff += [f"{table}.{k}" for k in sorted(set(old) | set(new))
                 if not (table == "train" and k in RESUMABLE_CHANGES)
                 and old.get(k, defaults[table].get(k)) != new.get(k, defaults[table].get(k))]
    if diff:
        raise ConfigError(f"the recipe changed since {run_dir} was trained ({', '.join(diff)}): resume it "
                          f"with the recipe it started with, or start over with --restart")
