"""Captured (CUDA graphs) against eager CUDA training steps, in one run on one GPU.

Both modes take the same steps: a fresh trainer of the recipe from its seed, its variable-BPTT lengths drawn as
training draws them, its carried state. The captured mode's first ``--warmup`` steps run eagerly and each new
length is captured once (``zoo/training/captured_step.py``); the figure compared is the steady state (replays of lengths
already captured) against the eager steps after the same warm-up, and the capture cost is reported beside it.

    python benchmarks/cuda_step.py --recipe alstm-ptb-17m --out benchmarks/results/cuda_step.json

Needs a CUDA GPU (the `device` tool's machines); writes a list of records and a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from zoo.tools.readme import write_result
from zoo.training import Recipe, Trainer, recipe_path


def run_mode(recipe: Recipe, data_dir: str | None, graphs: bool, steps: int, warmup: int) -> dict:
    t = Trainer(recipe, "/tmp/cuda_step_unused", data_dir=data_dir, device="cuda", progress=False, cuda_graphs=graphs)
    B = recipe.train.batch_size
    tokens = seconds = 0.0
    timed = 0
    for i in range(steps):
        x, y, seq_len, t.pos = t._next_batch(None)
        before = t._graphs.captures if graphs else 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        t.train_step(x, y, seq_len)            # returns a float: the step has ended on the GPU
        dt = time.perf_counter() - t0
        if graphs and t._graphs.captures > before:
            continue                             # a capture step: its cost is reported as capture_seconds
        if i >= warmup:
            tokens += B * seq_len
            seconds += dt
            timed += 1
    rec = {"model": recipe.name, "num_parameters": t.model.num_parameters(), "precision": recipe.train.precision,
           "mode": "captured" if graphs else "eager", "steps_timed": timed,
           "train_tokens_per_s": tokens / seconds, "device": torch.cuda.get_device_name()}
    if graphs:
        rec.update(captures=t._graphs.captures, capture_seconds=round(t._graphs.capture_seconds, 2))
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="alstm-ptb-17m")
    ap.add_argument("--data-dir")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--out", default="benchmarks/results/cuda_step.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_step: no CUDA GPU here (run it on a GPU machine)")
    records = []
    for precision in args.precisions.split(","):
        recipe = Recipe.load(recipe_path(args.recipe))
        recipe.train.precision = precision
        eager = run_mode(recipe, args.data_dir, False, args.steps, args.warmup)
        captured = run_mode(recipe, args.data_dir, True, args.steps, args.warmup)
        captured["speedup_vs_eager"] = captured["train_tokens_per_s"] / eager["train_tokens_per_s"]
        records += [eager, captured]
        print(f"{precision}: eager {eager['train_tokens_per_s']:.0f} tok/s, captured "
              f"{captured['train_tokens_per_s']:.0f} tok/s ({captured['speedup_vs_eager']:.2f}x; "
              f"{captured['captures']} captures, {captured['capture_seconds']} s)", flush=True)
    lines = ["| model | precision | mode | tokens/s | vs eager | captures (s) |", "|---|---|---|---:|---:|---:|"]
    for r in records:
        caps = "" if r["mode"] == "eager" else f"{r['captures']} ({r['capture_seconds']})"
        lines.append(f"| {r['model']} | {r['precision']} | {r['mode']} | {r['train_tokens_per_s']:.0f} | "
                     f"{r.get('speedup_vs_eager', 1.0):.2f}x | {caps} |")
    write_result(args.out, records, f"Device: {records[0]['device']}; one process, nothing else on the GPU.\n\n"
                 + "\n".join(lines))


if __name__ == "__main__":
    main()
