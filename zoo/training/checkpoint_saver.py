"""A run's products on disk: the run dir's lock, the training checkpoint (written atomically, read back) and the
optimiser state as tensors + JSON.

Why in one place: a crash must lose nothing and corrupt nothing. The checkpoint (model, optimiser, every RNG, data
position, carried state) is written into ``checkpoint.tmp`` and swapped in by ``os.replace``, so a reader only ever
sees a whole one (``checkpoint.old`` covers a crash between the two renames); it is safetensors + JSON, so nothing is
unpickled on resume; and one process at a time trains a run dir (``flock``), so a restart never clears a live run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from zoo.errors import ConfigError, UsageError
from zoo.training.recipe import Recipe, check_same_recipe

#: What a run writes into its run dir: ``zoo train --restart`` removes exactly these, and their presence makes a
#: plain ``zoo train`` refuse (it would have replaced a finished or resumable run's log and checkpoints).
RUN_PRODUCTS = ("checkpoint", "checkpoint.old", "checkpoint.tmp", "best", "release", "eval.json", "log.jsonl",
                "tensorboard")


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


# -- optimiser state as tensors + JSON (no pickle) ------------------------------------------------------
def flatten_optimizer(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimiser's state dict as ``optim.PID.NAME`` tensors and the JSON-able rest."""
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


def unflatten_optimizer(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
    """The state dict :func:`flatten_optimizer` took apart."""
    state: dict[int, dict[str, Any]] = {int(pid): dict(st) for pid, st in scalars["state"].items()}
    for key, v in tensors.items():
        if key.startswith("optim."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = v
    return {"state": state, "param_groups": scalars["param_groups"]}


def set_capturable(opt: torch.optim.Optimizer, on: bool, fused: bool = False) -> None:
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


# -- random generators and carried states ----------------------------------------------------------------
def rng_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's generator states (the CPU's, and the device's on CUDA)."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    return tensors


def restore_rngs(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng.cuda"], device)


def carry_tensors(carry: list[tuple[torch.Tensor, ...]] | None) -> dict[str, torch.Tensor]:
    """Every rank's carried state: rank 0's as ``carry.I`` (the single-process layout), rank r's as
    ``carry.rankR.I``."""
    return {f"carry.{i}" if r == 0 else f"carry.rank{r}.{i}": s.cpu()
            for r, state in enumerate(carry or []) for i, s in enumerate(state)}


def carry_of_rank(tensors: dict[str, torch.Tensor], rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's carried state from :func:`carry_tensors`' layout."""
    prefix = "carry." if rank == 0 else f"carry.rank{rank}."
    if not any(k.startswith(prefix) for k in tensors):  # older multi-process checkpoints kept rank 0's only
        prefix = "carry."
    n = len([k for k in tensors if k.startswith(prefix) and k[len(prefix):].isdigit()])
    return tuple(tensors[f"{prefix}{i}"].to(device) for i in range(n))


# -- the checkpoint on disk ----------------------------------------------------------------------------------
def write_training_checkpoint(run_dir: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write ``RUN_DIR/checkpoint`` atomically: into ``checkpoint.tmp``, flushed, then swapped in by renames."""
    tmp, ckpt, old = run_dir / "checkpoint.tmp", run_dir / "checkpoint", run_dir / "checkpoint.old"
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(meta))
    for f in tmp.iterdir():  # flush file contents before the directory swap
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if old.exists() and (ckpt / "meta.json").is_file():
        shutil.rmtree(old)  # left by a crash while it was being removed: it would block the rename below
    if ckpt.exists():
        os.replace(ckpt, old)
    os.replace(tmp, ckpt)
    if old.exists():
        shutil.rmtree(old)


def find_training_checkpoint(run_dir: Path) -> Path | None:
    """The run's whole checkpoint: ``checkpoint/``, else ``checkpoint.old`` (a crash between the two renames)."""
    for ckpt in (run_dir / "checkpoint", run_dir / "checkpoint.old"):
        if (ckpt / "meta.json").is_file():
            return ckpt
    return None


def read_training_checkpoint(ckpt: Path, recipe: Recipe, world: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint's tensors and meta, refused when its recipe differs (:func:`check_same_recipe`) or it was written
    by another number of processes (each trains its own columns of the batch with its own carried state) and has
    epochs left to train."""
    meta = json.loads((ckpt / "meta.json").read_text())
    check_same_recipe(meta.get("recipe"), recipe, ckpt.parent)
    epochs = recipe.train.epochs
    saved_world = meta.get("world_size")  # (not recorded before per-rank carried states were saved)
    if saved_world is not None and saved_world != world and meta["epoch"] <= epochs:
        how = f"torchrun --nproc-per-node {saved_world}" if saved_world > 1 else "one process, no torchrun"
        raise ConfigError(f"{ckpt} was written by {saved_world} process(es) and this run has {world}: "
                          f"each process trains its own columns of the batch with its own carried state, so "
                          f"resume with the same number ({how})")
    return load_file(str(ckpt / "state.safetensors")), meta
