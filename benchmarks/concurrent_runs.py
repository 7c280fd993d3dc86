"""Total training tokens/s of one, two and three runs sharing one device, each in its own process.

Why: a 17M model at batch 20 leaves an H100 mostly idle (one run with CUDA graphs: 36k tokens/s), so a lent GPU's
few minutes may train several of the campaign's runs at once (``zoo/tools/gpu/piece.py``); whether two or three
processes add throughput or only split it is measured here, on the lent GPU, before choosing the layout.

Each worker is a fresh trainer of its recipe (``--cuda-graphs`` on CUDA, as the pieces train) taking the
recipe's own steps (variable BPTT, carried state, a host sync per step as in training). It warms up first
(``--warmup-steps``: the eager warm-up and the captures of the common lengths), says it is ready, and the timed
window (``--seconds``) starts for every worker at once, so the windows overlap. Lengths first drawn inside the
window are captured there, as in a real piece. With ``--mps`` the workers run under a CUDA MPS daemon started
for the measurement (kernels of different processes may then run concurrently instead of time-sliced).

    python benchmarks/concurrent_runs.py --recipes alstm-ptb-17m-ref --counts 1 2 3 --seconds 60
    python benchmarks/concurrent_runs.py --recipes alstm-ptb-17m-ref --counts 1 2 3 --seconds 60 --mps \\
        --out benchmarks/results/concurrent_runs_mps.json

On the CPU (``--device cpu``, the test's tiny mode) it runs the same code with whatever recipe it is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from zoo.tools.gpu.piece import mps_daemon
from zoo.training import Recipe, Trainer, recipe_path


def worker(args: argparse.Namespace) -> None:
    """One process: warm up, say ready, wait for the common start, train for ``--seconds``, report."""
    recipe = Recipe.load(recipe_path(args.worker))
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(recipe, tmp, data_dir=args.data_dir, device=args.device, progress=False, cuda_graphs=cuda)

        def step() -> int:
            batch = t._next_batch(None)
            if batch is None:                      # the epoch's end: start it again (the measure is the step)
                t.pos, t.state = 0, None
                batch = t._next_batch(None)
            x, y, seq_len, t.pos = batch
            t.train_step(x, y, seq_len)            # returns a float: the step has ended on the device
            return y.numel()

        for _ in range(args.warmup_steps):
            step()
        Path(args.ready).write_text("ready")
        while not Path(args.go).exists():
            time.sleep(0.01)
        tokens, steps, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            tokens += step()
            steps += 1
        seconds = time.perf_counter() - t0
        captures = t._graphs.captures if t._graphs is not None else 0
        print(json.dumps({"recipe": recipe.name, "tokens": tokens, "steps": steps, "seconds": seconds,
                          "tokens_per_s": tokens / seconds, "captures_total": captures}), flush=True)


def measure(recipes: list[str], n: int, args: argparse.Namespace) -> dict:
    """``n`` workers at once (recipes taken in turn); their overlapping windows' tokens/s, summed."""
    with tempfile.TemporaryDirectory() as tmp:
        go = Path(tmp) / "go"
        procs = []
        for i in range(n):
            cmd = [sys.executable, __file__, "--worker", recipes[i % len(recipes)], "--device", args.device,
                   "--seconds", str(args.seconds), "--warmup-steps", str(args.warmup_steps),
                   "--ready", str(Path(tmp) / f"ready{i}"), "--go", str(go)]
            if args.data_dir:
                cmd += ["--data-dir", args.data_dir]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=os.environ.copy()))
        deadline = time.monotonic() + args.ready_timeout
        while not all((Path(tmp) / f"ready{i}").exists() for i in range(n)):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit(f"concurrent_runs: {n} workers not ready within {args.ready_timeout} s")
            time.sleep(0.05)
        go.write_text("go")
        runs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return {"runs": n, "total_tokens_per_s": sum(r["tokens_per_s"] for r in runs), "per_run": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["alstm-ptb-17m-ref"], help="taken in turn by the workers")
    ap.add_argument("--counts", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--data-dir")
    ap.add_argument("--mps", action="store_true", help="run the workers under a CUDA MPS daemon started here")
    ap.add_argument("--out", default="benchmarks/results/concurrent_runs.json")
    ap.add_argument("--no-readme", action="store_true", help="write the JSON only (the test's tiny mode)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ready", help=argparse.SUPPRESS)
    ap.add_argument("--go", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    with mps_daemon(args.mps):
        records = [measure(args.recipes, n, args) for n in args.counts]
    base = records[0]["total_tokens_per_s"]
    for r in records:
        r["vs_first"] = r["total_tokens_per_s"] / base
        print(f"{r['runs']} run(s): {r['total_tokens_per_s']:.0f} tokens/s in all ({r['vs_first']:.2f}x)", flush=True)
    result = {"device": device, "mps": args.mps, "recipes": args.recipes, "seconds": args.seconds,
              "warmup_steps": args.warmup_steps, "cuda_graphs": args.device.startswith("cuda"), "records": records}
    lines = [f"Device: {device}; recipes {', '.join(args.recipes)}; {args.seconds:g} s windows after "
             f"{args.warmup_steps} warm-up steps; CUDA graphs {'on' if result['cuda_graphs'] else 'off'}; "
             f"MPS {'on' if args.mps else 'off'}.", "", "| runs at once | tokens/s in all | per run | vs one |",
             "|---:|---:|---|---:|"]
    for r in records:
        per = ", ".join(f"{x['tokens_per_s']:.0f}" for x in r["per_run"])
        lines.append(f"| {r['runs']} | {r['total_tokens_per_s']:.0f} | {per} | {r['vs_first']:.2f}x |")
    if args.no_readme:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    else:
        from zoo.tools.readme import write_result
        write_result(args.out, result, "\n".join(lines))


if __name__ == "__main__":
    main()
