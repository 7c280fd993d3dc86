"""What the bf16 decoder + loss and the fused CPU Adam buy: the training step before and after, in one run.

The decoder fused with the loss (``zoo.models._fused_loss``) used to run both backward GEMMs per block of 128
rows under bf16: the block's float32 gradient cast to bf16 twice (once transposed), and a ``[vocab, E]`` float32
product added into ``dW`` per block (eleven 34 MB products per WikiText-2 step). It now writes each block's
gradient once into a bf16 ``[rows, vocab]`` buffer and runs ``dh`` and ``dW`` as two whole-batch GEMMs; and Adam
runs fused on the CPU (one pass per parameter). This script times, interleaved in rounds on one thread (process
CPU time, median of the per-round ratios):

1. **decoder + loss** alone, forward and backward, at the PTB and WikiText-2 tiers' shape (1,400 rows of 256, tied
   to a 10,000 / 33,278-word vocabulary), bf16: the per-block version (kept below as ``per_block_loss``, the
   code this replaced) against the library's;
2. **the whole training step** of the WikiText-2 long tier's LSTM and aLSTM recipes on real batches (forward,
   backward, clipping, Adam), before (per-block loss, unfused Adam) and after (the trainer as it is).

The projected epoch time is the step time times the epoch's steps at the recipe's BPTT. Writes
``benchmarks/results/fused_loss.json`` and ``.md`` (and regenerates the README). Pause other work first
(``kill -STOP``): the script records what else ran.

    python benchmarks/fused_loss.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from precision import cpu_name, other_processes  # noqa: E402

from zoo.models import _fused_loss  # noqa: E402
from zoo.models import _gemm as gemm  # noqa: E402
from zoo.precision import autocast  # noqa: E402
from zoo.training import Recipe, Trainer, recipe_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [("PTB tier", 1400, 256, 10000), ("WikiText-2 tier", 1400, 256, 33278)]
STEP_RECIPES = ("lstm-wt2-11m-long", "alstm-wt2-11m-long")


class _PerBlock(torch.autograd.Function):
    """The fused loss as it was before the whole-batch bf16 backward (commit b306a5f): both backward GEMMs per
    block, ``dW`` accumulated from a float32 ``[vocab, E]`` product per block. The baseline of this benchmark."""

    @staticmethod
    def forward(ctx: Any, h, w, b, y, ignore_index, dtype):  # type: ignore[override]
        with gemm.compute(dtype, h.device.type):
            keep = y != ignore_index
            n = int(keep.sum())
            gh, gw, gb = torch.zeros_like(h), torch.zeros_like(w), torch.zeros_like(b)
            total = torch.zeros((), dtype=torch.float64)
            wl = gemm.lowp(w)
            for s in range(0, h.shape[0], _fused_loss.CHUNK):
                hc, yc, kc = h[s:s + _fused_loss.CHUNK], y[s:s + _fused_loss.CHUNK], keep[s:s + _fused_loss.CHUNK]
                yc = yc.masked_fill(~kc, 0)
                z = gemm.addmm(b, hc, wl.t())
                lse = torch.logsumexp(z, 1)
                total += ((lse - z.gather(1, yc[:, None]).squeeze(1)) * kc).sum(dtype=torch.float64)
                z.sub_(lse[:, None]).exp_()
                z[torch.arange(z.shape[0]), yc] -= 1.0
                z.mul_((kc.to(z.dtype) / n)[:, None])
                gemm.mm(z, wl, out=gh[s:s + _fused_loss.CHUNK])
                gw.add_(gemm.mm(z.t(), hc))
                gb.add_(z.sum(0))
        ctx.save_for_backward(gh, gw, gb)
        return (total / max(n, 1)).to(h.dtype)

    @staticmethod
    def backward(ctx: Any, g):  # type: ignore[override]
        gh, gw, gb = ctx.saved_tensors
        return gh * g, gw * g, gb * g, None, None, None


def per_block_loss(h, w, b, y, ignore_index=-100):
    return _PerBlock.apply(h, w, b, y, ignore_index, gemm.autocast_dtype(h))


def _cpu_time(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def loss_rounds(rounds: int) -> list[dict]:
    rows = []
    for what, n, e, v in SHAPES:
        rows.append(_loss_shape(what, n, e, v, rounds))
        print(f"{what}: per block {rows[-1]['per_block_ms']:.0f} ms, whole batch {rows[-1]['whole_batch_ms']:.0f} "
              f"ms, ratio {rows[-1]['time_ratio']:.3f}", flush=True)
    return rows


def _loss_shape(what: str, n: int, e: int, v: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, e, generator=g)
    w = (torch.randn(v, e, generator=g) * 0.1).requires_grad_()
    b = torch.zeros(v, requires_grad=True)
    y = torch.randint(0, v, (n,), generator=g)
    impls = {"per_block": per_block_loss, "whole_batch": _fused_loss.linear_cross_entropy}

    def run(impl: str) -> float:
        hh = h.clone().requires_grad_()
        with autocast("bf16", "cpu"):
            loss = impls[impl](hh, w, b, y)
        loss.backward()
        return float(loss.detach())

    losses = {k: run(k) for k in impls}   # warm-up, and the two losses agree
    times: dict[str, list[float]] = {k: [] for k in impls}
    for r in range(rounds):
        for k in (list(impls) if r % 2 else list(impls)[::-1]):
            times[k].append(_cpu_time(lambda k=k: run(k)))
    ratio = statistics.median(a / b for a, b in zip(times["whole_batch"], times["per_block"], strict=True))
    return {"what": what, "rows": n, "emb": e, "vocab": v, "precision": "bf16",
            "per_block_ms": 1000 * statistics.median(times["per_block"]),
            "whole_batch_ms": 1000 * statistics.median(times["whole_batch"]),
            "time_ratio": ratio, "loss_rel_diff": abs(losses["whole_batch"] / losses["per_block"] - 1)}


def _trainer(name: str, before: bool, run_dir: str) -> Trainer:
    t = Trainer(Recipe.load(recipe_path(name)), run_dir, progress=False, device="cpu")
    if before:
        t._fused_adam = False
        t.optimizer = t._make_optimizer(t.cfg.optimizer)
    return t


def step_rounds(rounds: int, steps: int) -> list[dict]:
    rows = []
    for name in STEP_RECIPES:
        row = _step_recipe(name, rounds, steps)
        rows.append(row)
        print(f"{name}: step {row['before_step_ms']:.0f} -> {row['after_step_ms']:.0f} ms (ratio "
              f"{row['time_ratio']:.3f}); epoch {row['before_epoch_min']:.1f} -> {row['after_epoch_min']:.1f} min",
              flush=True)
    return rows


def _step_recipe(name: str, rounds: int, steps: int) -> dict:
    original = _fused_loss._LinearCrossEntropy.apply
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {"before": _trainer(name, True, tmp + "/a"), "after": _trainer(name, False, tmp + "/b")}
    bptt, data = trainers["after"].cfg.bptt, trainers["after"].train_data

    def run(which: str, i0: int) -> None:
        _fused_loss._LinearCrossEntropy.apply = _PerBlock.apply if which == "before" else original
        try:
            for i in range(i0, i0 + steps):
                x, y = data[i * bptt:(i + 1) * bptt].t(), data[i * bptt + 1:(i + 1) * bptt + 1].t()
                trainers[which].train_step(x, y, bptt)
        finally:
            _fused_loss._LinearCrossEntropy.apply = original

    for which in trainers:
        run(which, 0)                                   # warm-up
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for r in range(rounds):
        for k in (("before", "after") if r % 2 else ("after", "before")):
            times[k].append(_cpu_time(lambda k=k, r=r: run(k, 1 + r * steps)) / steps)
    t = trainers["after"]
    epoch_steps = t.train_data.shape[0] / bptt
    ratio = statistics.median(a / b for a, b in zip(times["after"], times["before"], strict=True))
    return {"recipe": name, "architecture": t.model.architecture, "num_parameters": t.model.num_parameters(),
            "batch": t.cfg.batch_size, "bptt": bptt, "precision": t.cfg.precision,
            "before_step_ms": 1000 * statistics.median(times["before"]),
            "after_step_ms": 1000 * statistics.median(times["after"]), "time_ratio": ratio,
            "before_epoch_min": statistics.median(times["before"]) * epoch_steps / 60,
            "after_epoch_min": statistics.median(times["after"]) * epoch_steps / 60}


def table(result: dict) -> str:
    lines = [f"Measured on {result['cpu']}, one thread, process CPU time, {result['rounds']} interleaved rounds "
             f"(median of per-round ratios); other busy processes at the start (state T: paused during the run): "
             f"{'; '.join(result['other_processes']) or 'none'}.", "",
             "**Decoder + loss**, forward and backward, bf16 GEMMs (1,400 rows of 256):", "",
             "| shape | vocabulary | per block (ms) | whole-batch backward (ms) | time ratio | loss difference |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["loss"]:
        lines.append(f"| {r['what']} | {r['vocab']:,} | {r['per_block_ms']:.0f} | {r['whole_batch_ms']:.0f} | "
                     f"{r['time_ratio']:.3f}x | {r['loss_rel_diff']:.1e} |")
    lines += ["", f"**Training step** (forward, backward, clipping, Adam; {result['steps']} steps a round), before "
              "(per-block loss, unfused Adam) and after:", "",
              "| recipe | params | step before (ms) | step after (ms) | time ratio | epoch before (min) | "
              "epoch after (min) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["step"]:
        lines.append(f"| `{r['recipe']}` | {r['num_parameters']:,} | {r['before_step_ms']:.0f} | "
                     f"{r['after_step_ms']:.0f} | {r['time_ratio']:.3f}x | {r['before_epoch_min']:.1f} | "
                     f"{r['after_epoch_min']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="training steps per round and variant")
    ap.add_argument("--out", default=str(RESULTS / "fused_loss.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    result = {"cpu": cpu_name(), "threads": 1, "rounds": args.rounds, "steps": args.steps,
              "other_processes": other_processes(), "load_avg_1min": os.getloadavg()[0]}
    result["loss"] = loss_rounds(args.rounds)
    result["step"] = step_rounds(args.rounds, args.steps)
    from zoo.tools.readme import write_result
    write_result(args.out, result, table(result))


if __name__ == "__main__":
    main()
