"""Carry a training run between this machine and a lent GPU through the device tool's narrow return.

Why: a lent GPU gives one session at most ten minutes a command and fifteen in all, so a long GPU run (the
paper-scale aLSTM's 190 epochs) trains in pieces across sessions, and each piece's checkpoint must come back
through ``$OUT``: at most 8 files, 16 MiB each, 64 MiB together. A training checkpoint of the 17.2M aLSTM is
206 MB (float32 weights, Adam's two moments). What a resume needs fits in about 52 MB:

* **Weights as float16** (the bundles' own precision): each trip rounds every weight once, to 2^-11 of its size;
  the training steps on either side run in float32 as before.
* **Adam's second moment as an 8-bit code of its log2**, per tensor (255 levels spanning that tensor's range;
  0 codes an exact 0): each value comes back within a factor ``2 ** (step / 2)`` of itself (``step`` = the
  tensor's log2 range / 254: up to 8.5% off for a range of 2^-60..2^0), its square root (what divides the step)
  within half that (4.2%). The moment is itself a running average of noisy squared gradients, and the next steps
  pull it back. A carried run packed again comes back bit-identical (weights and codes).
* **Adam's first moment is not carried** when ``beta1 = 0`` (the reference aLSTM's): each step then overwrites it
  with the step's gradient before reading it. With ``beta1 > 0`` (the HyperLSTM's Adam) it travels as float16,
  like the weights (a 4.9M model's pack grows from 15 to 25 MB; the size check below still applies). Other
  optimisers are refused.
* Everything else exactly: the step counters, every RNG state, the carried hidden state, the data position, the
  history and the log.

A piece ends at an epoch's end (``zoo train --pause-after-minutes``), where ``best/`` usually holds the
checkpoint's own weights (the last epoch was the best so far): that travels as a flag, and unpack writes ``best/``
back from the carried weights. If the last epoch was *not* the best, ``best/``'s own weights would not fit beside
the checkpoint's: the best so far becomes the last epoch (``best_val`` set to its validation loss) and the log says
so (a ``ferried`` event with ``best_reset``), so the run's final choice is made among epochs whose weights exist.
A checkpoint from mid-epoch (a piece stopped by a signal) travels too, without ``best/``: the next epoch end sets it.

    python -m zoo.tools.gpu.ferry pack runs/alstm-ptb-17m-ref $OUT       # on the GPU machine, after a piece
    python -m zoo.tools.gpu.ferry unpack /work/.device/.../files runs/alstm-ptb-17m-ref   # here
    python -m zoo.tools.gpu.ferry pack runs/alstm-ptb-17m-ref .devrun/ferry          # here, before the next piece

Each trip appends a ``ferried`` event to the run's ``log.jsonl`` (what was rounded), so a card built from the log
can say the run crossed machines. The parts carry a manifest with every part's SHA-256; unpack checks them.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from zoo.errors import ZooError
from zoo.files import sha256_file, write_atomic
from zoo.training import run_lock

MiB = 1 << 20
#: The device tool's return: 8 files of 16 MiB, 64 MiB in all (the manifest, the parts, piece.sh's log and
#: stderr). The way out is the binding limit: the tracked tree (~4.4 MiB without zoo/pretrained) and the data
#: (PTB 5.7 MiB) travel with the parts in the same 64 MiB, so the packed run may take 53 MiB.
PART_BYTES = 15 * MiB
TOTAL_LIMIT = 53 * MiB
MANIFEST = "ferry.json"
#: The small files of a run dir that travel as they are. ``best/``'s weights are rebuilt from the carried ones;
#: ``eval.json`` and ``release/`` do not travel: a run that finished on the GPU is finished again here by
#: ``zoo train --resume`` (its test evaluation and release cast redone from the carried ``best/``).
SMALL_FILES = ("log.jsonl", "best/config.json", "best/vocab.json", "best/tokenizer.json")
LEVELS = 254  # codes 1..255 span a tensor's log2 range; 0 is an exact zero


class FerryError(Exception):
    """A run that cannot be carried (no checkpoint, not Adam, too large) or parts that do not check out."""


def encode_log8(v: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """``v >= 0`` as uint8 codes of log2(v) over the tensor's range, with that range (lo, hi)."""
    v = v.float()
    pos = v > 0
    if not bool(pos.any()):
        return torch.zeros_like(v, dtype=torch.uint8), 0.0, 0.0
    lg = torch.log2(torch.where(pos, v, torch.ones_like(v)))
    lo, hi = float(lg[pos].min()), float(lg[pos].max())
    scale = (hi - lo) / LEVELS if hi > lo else 1.0
    q = torch.round((lg - lo) / scale).clamp(0, LEVELS).to(torch.uint8) + 1
    return torch.where(pos, q, torch.zeros_like(q)), lo, hi


def decode_log8(q: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    scale = (hi - lo) / LEVELS if hi > lo else 1.0
    v = torch.exp2(lo + (q.float() - 1) * scale)
    return torch.where(q > 0, v, torch.zeros_like(v))


def _half(name: str, v: torch.Tensor) -> torch.Tensor:
    half = v.to(torch.float16)
    if not bool(torch.isfinite(half).all()):
        raise FerryError(f"{name} does not fit float16 (a value beyond 65504)")
    return half


def _weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


def pack(run_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Write ``run_dir``'s checkpoint as parts + manifest into ``out_dir``; returns the manifest. Under the run's
    lock, so that no training process swaps the checkpoint between the reads."""
    if not (run_dir / "checkpoint" / "meta.json").is_file():
        raise FerryError(f"{run_dir} has no checkpoint to carry")
    with run_lock(run_dir):
        return _pack(run_dir, out_dir)


def _pack(run_dir: Path, out_dir: Path) -> dict[str, Any]:
    ckpt = run_dir / "checkpoint"
    if not (ckpt / "meta.json").is_file():
        raise FerryError(f"{run_dir} has no checkpoint to carry")
    meta = json.loads((ckpt / "meta.json").read_text())
    groups = meta["optim_scalars"]["param_groups"]
    if meta["optimizer"] != "adam":
        raise FerryError(f"only Adam can be carried (this run's optimiser is {meta['optimizer']})")
    first_moment = any(g["betas"][0] != 0 for g in groups)  # beta1 = 0: each step overwrites exp_avg first
    tensors = load_file(str(ckpt / "state.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    ranges: dict[str, list[float]] = {}
    weights = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    for k, v in tensors.items():
        if k.startswith("model."):
            packed[k] = _half(k, v) if v.is_floating_point() else v
        elif k.startswith("optim.") and k.endswith(".exp_avg"):
            if first_moment:
                packed[k] = _half(k, v)
        elif k.startswith("optim.") and k.endswith(".exp_avg_sq"):
            if not bool(torch.isfinite(v).all()):
                raise FerryError(f"{k} is not finite: the run has diverged, nothing worth carrying")
            packed[k], lo, hi = encode_log8(v)
            ranges[k] = [lo, hi]
        else:
            packed[k] = v  # step counters, RNG states, carried hidden state: exact
    best = run_dir / "best" / "model.safetensors"
    mid_epoch = meta["pos"] != 0
    best_same = not mid_epoch and best.is_file() and _weights_equal(load_file(str(best)), weights)
    tied = "[]"
    if best.is_file():
        with safe_open(str(best), "pt") as f:
            tied = (f.metadata() or {}).get("tied", "[]")
    last_val = meta["history"][-1] if meta["history"] else None
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "run.tar"
        with tarfile.open(bundle, "w") as tar:
            def add(name: str, data: bytes) -> None:
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
            add("state.safetensors", save(packed, metadata={"log8_ranges": json.dumps(ranges)}))
            add("meta.json", json.dumps(meta).encode())
            for name in SMALL_FILES:
                if (run_dir / name).is_file() and not (mid_epoch and name.startswith("best/")):
                    add(name, (run_dir / name).read_bytes())
        size = bundle.stat().st_size
        if size > TOTAL_LIMIT:
            raise FerryError(f"the packed run is {size / MiB:.1f} MiB: over the {TOTAL_LIMIT / MiB:.0f} MiB the "
                             f"device tool can carry beside the tree and the data")
        out_dir.mkdir(parents=True, exist_ok=True)
        parts = []
        with open(bundle, "rb") as f:
            for i in range(math.ceil(size / PART_BYTES)):
                name = f"ferry.part{i:02d}"
                (out_dir / name).write_bytes(f.read(PART_BYTES))
                parts.append({"name": name, "sha256": sha256_file(out_dir / name)})
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.uname().machine})"
    manifest = {"run": run_dir.name, "from": machine, "epoch": meta["epoch"], "pos": meta["pos"], "step": meta["step"],
                "bytes": size,
                "parts": parts, "mid_epoch": mid_epoch, "best_is_checkpoint": best_same, "best_val": meta["best_val"],
                "last_val": last_val, "tied": tied}
    write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _swap_in(staged: Path, target: Path) -> None:
    """Replace folder ``target`` by ``staged`` (the checkpoint's own two-rename swap: a crash in between leaves
    ``target.old``, which the trainer's resume reads)."""
    for f in staged.iterdir():
        _fsync(f)
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        os.replace(target, old)
    os.replace(staged, target)
    if old.exists():
        shutil.rmtree(old)


def check_parts(parts_dir: Path) -> dict[str, Any]:
    """The manifest of the pack in ``parts_dir``, once every part matches its SHA-256."""
    if not (parts_dir / MANIFEST).is_file():
        raise FerryError(f"{parts_dir} holds no {MANIFEST}: not a pack")
    manifest = json.loads((parts_dir / MANIFEST).read_text())
    for p in manifest["parts"]:
        if sha256_file(parts_dir / p["name"]) != p["sha256"]:
            raise FerryError(f"{parts_dir / p['name']} does not match its SHA-256 in the manifest")
    return manifest


def unpack(parts_dir: Path, run_dir: Path, force: bool = False) -> dict[str, Any]:
    """Make ``run_dir`` resumable from :func:`pack`'s parts (refusing to go back over a later checkpoint).

    Under the run's lock, in place, in an order that a crash at any point leaves resumable and that a second
    unpack completes: the log first (a resume trims what it holds past the older checkpoint), then ``best/``,
    then the checkpoint; a finished run's stale ``release/`` and ``eval.json`` go first of all."""
    manifest = check_parts(parts_dir)
    carried = (manifest["epoch"], manifest.get("pos", 0))
    with run_lock(run_dir):
        mine = run_dir / "checkpoint" / "meta.json"
        if mine.is_file() and not force:
            have = json.loads(mine.read_text())
            if (have["epoch"], have["pos"]) >= carried:
                raise FerryError(f"{run_dir} already holds epoch {have['epoch']} (pos {have['pos']}), not behind "
                                 f"the carried epoch {carried[0]} (pos {carried[1]}): nothing to do (--force "
                                 f"replaces it)")
        stage = run_dir / "ferry.tmp"
        if stage.exists():
            shutil.rmtree(stage)  # left by an unpack that stopped midway
        stage.mkdir()
        try:
            bundle = stage / "run.tar"
            with open(bundle, "wb") as out:
                for p in manifest["parts"]:
                    out.write((parts_dir / p["name"]).read_bytes())
            with tarfile.open(bundle) as tar:
                tar.extractall(stage / "run", filter="data")
            got = stage / "run"
            with safe_open(str(got / "state.safetensors"), "pt") as f:
                ranges = json.loads((f.metadata() or {})["log8_ranges"])
            packed = load_file(str(got / "state.safetensors"))
            meta = json.loads((got / "meta.json").read_text())
            state: dict[str, torch.Tensor] = {}
            for k, v in packed.items():
                if (k.startswith("model.") or k.endswith(".exp_avg")) and v.dtype == torch.float16:
                    state[k] = v.float()
                elif k in ranges:
                    state[k] = decode_log8(v, *ranges[k])
                    if k[: -len("_sq")] not in packed:  # beta1 = 0: exp_avg is overwritten by the next step
                        state[k[: -len("_sq")]] = torch.zeros_like(state[k])
                else:
                    state[k] = v
            event: dict[str, Any] = {"event": "ferried", "from": manifest.get("from"), "epoch": meta["epoch"] - 1,
                                     "pos": meta["pos"], "step": meta["step"], "weights": "float16",
                                     "adam_exp_avg_sq": "8-bit log2 code"}
            if any(k.endswith(".exp_avg") for k in packed):
                event["adam_exp_avg"] = "float16"
            if not manifest["best_is_checkpoint"]:  # best/'s own weights did not travel: see the module docstring
                to = math.inf if manifest["mid_epoch"] else manifest["last_val"]
                event["best_reset"] = {"from": meta["best_val"], "to": to}
                meta["best_val"] = to
            # meta's log_bytes stays: it marks where the checkpoint's epochs end in the log; the event line
            # appended here is kept by a resume's trim as every event line is
            carried_log = got / "log.jsonl"  # (none before a run's first log line: a checkpoint mid-epoch 1)
            log = (carried_log.read_text(encoding="utf-8") if carried_log.is_file() else "") + json.dumps(event) + "\n"
            for stale in ("eval.json", "release"):  # a finish here rewrites them from the carried best/
                path = run_dir / stale
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
            write_atomic(run_dir / "log.jsonl", log, fsync=True)
            if (got / "best" / "config.json").is_file():
                weights = {k[6:]: v for k, v in state.items() if k.startswith("model.")}
                save_file(weights, str(got / "best" / "model.safetensors"),
                          metadata={"format": "pt", "tied": manifest["tied"]})
                _swap_in(got / "best", run_dir / "best")
            elif manifest["mid_epoch"] and (run_dir / "best").exists():
                shutil.rmtree(run_dir / "best")  # not the carried run's: its next epoch end writes best/ again
            ckpt = stage / "checkpoint"
            ckpt.mkdir()
            save_file(state, str(ckpt / "state.safetensors"))
            (ckpt / "meta.json").write_text(json.dumps(meta))
            _swap_in(ckpt, run_dir / "checkpoint")
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return {"run_dir": str(run_dir), "epoch": meta["epoch"], "pos": meta["pos"], "step": meta["step"],
            "event": event}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zoo.tools.gpu.ferry", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="a run dir's checkpoint -> parts + manifest")
    p.add_argument("run_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    u = sub.add_parser("unpack", help="parts + manifest -> a resumable run dir")
    u.add_argument("parts_dir", type=Path)
    u.add_argument("run_dir", type=Path)
    u.add_argument("--force", action="store_true", help="replace a run dir that is not behind the carried one")
    args = ap.parse_args(argv)
    try:
        result = pack(args.run_dir, args.out_dir) if args.cmd == "pack" else \
            unpack(args.parts_dir, args.run_dir, args.force)
    except (FerryError, ZooError, OSError, KeyError, ValueError) as e:
        print(f"ferry: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
