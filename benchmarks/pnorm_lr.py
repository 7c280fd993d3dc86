"""The p = 1 GRU's first training steps at the PTB tier's lr (3e-3) against the 1e-3 its recipe uses.

Why the p-norm GRU recipes of the ptb-5m tier deviate from the tier's optimiser: at lr 3e-3 the p = 1 GRU does not
learn. Each lr trains a fresh model of the recipe from its seed for the same ``--steps`` updates (the same data
order, variable-BPTT lengths and carried state as training draws them), and the mean training loss over windows
of those steps and the validation loss after the last are written out.

    python benchmarks/pnorm_lr.py --out benchmarks/results/pnorm_lr.json

CPU (one thread by default, as the tier trained); a few minutes, ~15 for `--steps 0` (one epoch per lr).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from zoo.tools.readme import write_result
from zoo.training import Recipe, Trainer, recipe_path

#: (first step, last step) windows whose mean training loss is reported, 1-based and inclusive
WINDOWS = ((1, 20), (101, 120), (221, 240))


def run_lr(recipe_name: str, lr: float, steps: int, data_dir: str | None) -> dict:
    recipe = Recipe.load(recipe_path(recipe_name))
    recipe.train.lr = lr
    with tempfile.TemporaryDirectory() as run_dir:
        t = Trainer(recipe, run_dir, data_dir=data_dir, device="cpu", progress=False)
        t._lr_for_epoch()
        losses = []
        t0 = time.perf_counter()
        while len(losses) < steps or not steps:  # steps 0: one whole epoch
            batch = t._next_batch(None)
            if batch is None:
                break
            x, y, seq_len, t.pos = batch
            losses.append(t.train_step(x, y, seq_len))
        steps = len(losses)
        seconds = time.perf_counter() - t0
        valid = t.evaluate("valid", recipe.train.eval_batch_size)
    windows = {f"{a}-{b}": sum(losses[a - 1:b]) / (b - a + 1) for a, b in WINDOWS if b <= steps}
    return {"recipe": recipe_name, "lr": lr, "steps": steps, "precision": recipe.train.precision,
            "train_loss_windows": windows, "train_loss_mean": sum(losses) / steps, "train_loss_last": losses[-1],
            "valid_loss": valid["avg_nll"],
            "valid_ppl": valid["ppl"], "seconds": round(seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="pnorm-gru-ptb-5m-p1")
    ap.add_argument("--lrs", default="0.003,0.001")
    ap.add_argument("--steps", type=int, default=240, help="updates per lr (0: one whole epoch)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-dir")
    ap.add_argument("--out", default="benchmarks/results/pnorm_lr.json")
    args = ap.parse_args()
    if args.steps < 0 or args.threads < 1:
        raise SystemExit("pnorm_lr: --steps must be >= 0 (0: one epoch) and --threads >= 1")
    torch.set_num_threads(args.threads)
    records = []
    for lr in (float(v) for v in args.lrs.split(",")):
        rec = run_lr(args.recipe, lr, args.steps, args.data_dir)
        records.append(rec)
        print(f"lr {lr:g}: train loss {rec['train_loss_windows']}, valid loss {rec['valid_loss']:.3f} "
              f"({rec['seconds']} s)", flush=True)
    heads = list(records[0]["train_loss_windows"])
    lines = ["| recipe | lr | " + " | ".join(f"train loss, steps {w}" for w in heads)
             + " | train loss, mean | valid loss after |", "|---|---:|" + "---:|" * len(heads) + "---:|---:|"]
    for r in records:
        lines.append(f"| {r['recipe']} | {r['lr']:g} | "
                     + " | ".join(f"{r['train_loss_windows'][w]:.3f}" for w in heads)
                     + f" | {r['train_loss_mean']:.3f} | {r['valid_loss']:.3f} (after {r['steps']} steps) |")
    write_result(args.out, records, f"CPU, {args.threads} thread(s), {records[0]['precision']}; each lr a fresh "
                 "model of the recipe from its seed, the same data order.\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
