"""Training throughput of recipes on the current device: tokens/s and the projected seconds per epoch.

Used to choose an epoch budget that every model of a tier can finish in the same wall-clock window.
    python benchmarks/train_speed.py zoo/recipes/*.toml --out benchmarks/results/train_speed.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from zoo.training import Recipe, Trainer


def measure(path: str, steps: int, data_dir: str | None, device: str | None) -> dict:
    recipe = Recipe.load(path)
    trainer = Trainer(recipe, "/tmp/train_speed_unused", data_dir=data_dir, device=device, progress=False)
    bptt, data = recipe.train.bptt, trainer.train_data
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    for i in range(2):  # warm-up (kernel selection, allocator)
        trainer.train_step(data[i * bptt:(i + 1) * bptt].t(), data[i * bptt + 1:(i + 1) * bptt + 1].t(), bptt)
    sync()
    t0 = time.perf_counter()
    for i in range(2, 2 + steps):
        trainer.train_step(data[i * bptt:(i + 1) * bptt].t(), data[i * bptt + 1:(i + 1) * bptt + 1].t(), bptt)
    sync()
    secs = time.perf_counter() - t0
    tok_s = steps * bptt * recipe.train.batch_size / secs
    return {"recipe": recipe.name, "architecture": recipe.model["architecture"],
            "num_parameters": trainer.model.num_parameters(), "device": str(trainer.device),
            "tokens_per_s": tok_s, "epoch_seconds": trainer.corpus.train.numel() / tok_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--data-dir")
    ap.add_argument("--device")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for path in args.recipes:
        row = measure(path, args.steps, args.data_dir, args.device)
        print(f"{row['recipe']:32s} {row['num_parameters']:>10,} params {row['tokens_per_s']:>10.0f} tok/s "
              f"{row['epoch_seconds']:>8.1f} s/epoch", flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
