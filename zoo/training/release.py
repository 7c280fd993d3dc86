"""A run's end: the best model scored on validation and (once) on test, ``release/`` written in ``save_dtype`` with
what the cast costs, and ``eval.json``, the run's result that bundling, cards and tiers read.

Why apart from the loop: model selection must stay honest (the test split is scored once, on the model chosen on
validation, among the epochs whose weights exist) and a half-precision release must report its cost, not assume it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint import load_checkpoint, save_checkpoint
from zoo.files import write_atomic
from zoo.lm import LanguageModel
from zoo.training.divergence import TrainingDiverged

#: ``evaluate(model, split, desc)``: a split's metrics for ``model`` at the run's batch size for that split.
Evaluate = Callable[[LanguageModel, str, str], dict[str, Any]]


def first_selectable_epoch(log: list[dict[str, Any]]) -> int:
    """The first epoch best/ can have been chosen from, given a run's ``log.jsonl`` records.

    A run carried between machines without best/'s own weights (``zoo/tools/gpu/ferry.py`` logs a ``ferried`` event
    with ``best_reset``) chose best/ again from the epoch the trip landed in (the next one when it landed mid-epoch):
    the final choice, and a card saying so, are made among epochs whose weights existed.
    """
    return max((r["epoch"] + (1 if r.get("pos") else 0) for r in log
                if r.get("event") == "ferried" and "best_reset" in r), default=1)


def write_release(run_dir: Path, save_dtype: str, device: torch.device, evaluate: Evaluate,
                  valid: dict[str, Any], test: dict[str, Any]) -> dict[str, Any]:
    """Write ``release/``, the checkpoint to bundle, in ``save_dtype``; measure what the cast costs.

    Half precision halves the zoo's size; the valid/test perplexity of the cast weights (computed
    back in float32) is recorded next to the float32 numbers so the change is reported, not assumed.
    """
    dtype = getattr(torch, save_dtype)
    model, tok, config = load_checkpoint(run_dir / "best")
    release_dir = run_dir / "release"
    extra = {k: config[k] for k in ("name", "dataset", "recipe") if k in config}
    save_checkpoint(release_dir, model, tok, extra, dtype=None if dtype == torch.float32 else dtype)
    if dtype == torch.float32:
        return {"dtype": "float32", "valid": valid, "test": test}
    cast, _, _ = load_checkpoint(release_dir)
    cast.to(device)
    rv = evaluate(cast, "valid", "valid(release)")
    rt = evaluate(cast, "test", "test(release)")
    return {"dtype": save_dtype, "valid": rv, "test": rt,
            "valid_ppl_change": rv["ppl"] / valid["ppl"] - 1, "test_ppl_change": rt["ppl"] / test["ppl"] - 1}


def finish_run(run_dir: Path, save_dtype: str, device: torch.device, evaluate: Evaluate,
               info: dict[str, Any]) -> dict[str, Any]:
    """Evaluate ``best/`` on valid and (once) on test, write ``release/`` and ``eval.json``; return the result.

    ``info``: what the result says of the run besides its numbers (name, dataset, architecture, num_parameters,
    device, world_size, recipe, mode, and ranks_in_sync under torchrun).
    """
    if not (run_dir / "best" / "config.json").is_file():
        raise TrainingDiverged(f"{run_dir} has no best model: no epoch ended with a finite validation loss")
    # an earlier eval.json (a sweep prefix now continued) no longer describes release/: it goes before
    # release/ changes, so a crash in between never leaves the new weights beside the old numbers
    (run_dir / "eval.json").unlink(missing_ok=True)
    best_model, _, _ = load_checkpoint(run_dir / "best")
    best_model.to(device)
    valid = evaluate(best_model, "valid", "valid(best)")
    test = evaluate(best_model, "test", "test(best)")
    release = write_release(run_dir, save_dtype, device, evaluate, valid, test)
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    epochs = [r for r in log if "epoch" in r and "valid_ppl" in r]
    first = first_selectable_epoch(log)
    chosen = [r for r in epochs if r["epoch"] >= first] or epochs
    result = {**{k: info[k] for k in ("name", "dataset", "architecture", "num_parameters")},
              "valid": valid, "test": test, "epochs_trained": len(epochs),
              "best_epoch": min(chosen, key=lambda r: r["valid_loss"])["epoch"],
              "train_seconds": sum(r["seconds"] for r in epochs),
              **{k: info[k] for k in ("device", "world_size", "recipe")}, "release": release, "mode": info["mode"],
              **({"ranks_in_sync": info["ranks_in_sync"]} if "ranks_in_sync" in info else {})}
    write_atomic(run_dir / "eval.json", json.dumps(result, indent=2) + "\n")
    return result


def finished_result(run_dir: Path, epochs_trained: int) -> dict[str, Any] | None:
    """The ``eval.json`` of a run that has trained every epoch asked for, if it was written after the last
    checkpoint's epochs (a resumed finished run reports it instead of evaluating the test split again)."""
    path = run_dir / "eval.json"
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
    except ValueError:
        return None
    return result if isinstance(result, dict) and result.get("epochs_trained") == epochs_trained else None
