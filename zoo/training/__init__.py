"""Resumable training of a recipe (``zoo train``): the loop in :mod:`.trainer`, each other concern in a module of its
own (recipe, checkpoint_saver, distributed, evaluation, loggers, signals, release, optimizers, divergence, callbacks).

The names callers use are re-exported here, so ``from zoo.training import Recipe, Trainer`` is the import.
"""

from zoo.training.callbacks import Callback, StepEnd
from zoo.training.checkpoint_saver import RUN_PRODUCTS, clear_run, run_lock, run_products
from zoo.training.distributed import rank_seed
from zoo.training.divergence import TrainingDiverged
from zoo.training.loggers import LOG_TARGETS
from zoo.training.optimizers import nonmonotone_trigger
from zoo.training.recipe import SAVE_DTYPES, STREAM_ONLY, Recipe, TrainConfig, recipe_path
from zoo.training.release import first_selectable_epoch
from zoo.training.signals import Interrupted
from zoo.training.trainer import Trainer

__all__ = ["LOG_TARGETS", "RUN_PRODUCTS", "SAVE_DTYPES", "STREAM_ONLY", "Callback", "Interrupted", "Recipe",
           "StepEnd", "TrainConfig", "Trainer", "TrainingDiverged", "clear_run", "first_selectable_epoch",
           "nonmonotone_trigger", "rank_seed", "recipe_path", "run_lock", "run_products"]
