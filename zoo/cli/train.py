"""``zoo train``: train a recipe (resumable), or several recipes as separate processes, ``--jobs`` at a time."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from zoo.cli.inputs import require
from zoo.errors import UsageError
from zoo.precision import PRECISIONS


def register(subparsers) -> None:
    sp = subparsers.add_parser("train", help="train a recipe (resumable)")
    sp.add_argument("recipe", nargs="+", help="recipe .toml file(s) or bundled recipe name(s)")
    sp.add_argument("--jobs", type=int, default=1, help="with several recipes: how many train at once")
    sp.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    sp.add_argument("--restart", action="store_true", help="start over in a run dir that holds an earlier run "
                    "(removes its checkpoints, log and results; without --resume or --restart such a dir is refused)")
    sp.add_argument("--run-dir", help="output folder (default: runs/<recipe name>); with several recipes, the "
                    "folder their run dirs go in (RUN_DIR/<recipe name>)")
    sp.add_argument("--data-dir")
    sp.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    sp.add_argument("--epochs", type=int, help="override the recipe's epoch count")
    sp.add_argument("--max-minutes", type=float, help="stop cleanly at the first epoch end past this budget "
                    "(minutes of training; 0: no budget, also cancelling a recipe's own)")
    sp.add_argument("--pause-after-minutes", type=float,
                    help="train one piece of a longer run: stop at the first epoch end past this many minutes of "
                         "this process, checkpointed and not finished (no test evaluation); --resume continues")
    sp.add_argument("--precision", choices=list(PRECISIONS),
                    help="compute precision of training (default: the recipe's, else fp32); bf16 is mixed "
                         "precision with float32 weights and checkpoints (see zoo/precision.py)")
    sp.add_argument("--log-to", action="append", choices=["tensorboard"],
                    help="also log to TensorBoard (RUN_DIR/tensorboard: step-level loss and lr, epoch validation; "
                         "log.jsonl stays the source of record); view with `tensorboard --logdir runs`")
    sp.add_argument("--log-every-steps", type=int, default=50, help="steps between TensorBoard loss points")
    sp.add_argument("--cuda-graphs", action="store_true",
                    help="on a GPU: replay each update from a CUDA graph captured once per BPTT length (same "
                         "arithmetic, one launch per step; stream-mode recipes, one process; "
                         "zoo/training/captured_step.py)")
    sp.set_defaults(func=run)


def _train_parallel(args: argparse.Namespace) -> int:
    """Run several recipes as separate processes, ``--jobs`` at a time, each logging to its run dir."""
    import signal
    import subprocess
    import time

    from zoo.training import Recipe, recipe_path

    pending = [recipe_path(r) for r in args.recipe]
    names = [Recipe.load(path).name for path in pending]
    if len(set(names)) < len(names):  # two processes would share one run dir (the second is refused by its lock)
        raise UsageError(f"a recipe is named twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    for path in pending:   # refuse before starting anything: a batch never half-starts
        _check_run_dir(Path(args.run_dir or "runs") / Recipe.load(path).name, args, clear=False)
    running: list[tuple[subprocess.Popen, str]] = []
    run_dirs: dict[str, Path] = {}
    failed = []
    passthrough = [f for flag, val in (("--data-dir", args.data_dir), ("--device", args.device),
                                       ("--epochs", args.epochs), ("--max-minutes", args.max_minutes),
                                       ("--pause-after-minutes", args.pause_after_minutes),
                                       ("--precision", args.precision), ("--log-every-steps", args.log_every_steps))
                   if val is not None for f in (flag, str(val))] + (["--resume"] if args.resume else []) \
        + (["--restart"] if args.restart else []) \
        + [f for target in args.log_to or () for f in ("--log-to", target)]
    # Why: each child would otherwise start one intra-op thread per core, and N jobs on the same cores
    # then fight over them; split the cores between the jobs unless the caller chose a thread count. Two one-thread
    # runs side by side beat one two-thread run at a time in total tokens/s for the tier recipes (the recurrent
    # GEMMs are too small to use two threads well; benchmarks/precision.py --layout measures it).
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.jobs)))
    # SIGTERM / Ctrl-C: pass SIGTERM on to the running children (each checkpoints and stops), start nothing new
    stop = []

    def on_signal(signum: int, frame: object) -> None:
        stop.append(signum)
        pending.clear()
        for proc, _ in running:
            proc.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while pending or running:
        while pending and len(running) < args.jobs:
            path = pending.pop(0)
            name = Recipe.load(path).name
            run_dir = Path(args.run_dir or "runs") / name
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir / "stdout.log", "a")
            cmd = [sys.executable, "-m", "zoo.cli", "train", str(path), "--run-dir", str(run_dir), *passthrough]
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), name))
            run_dirs[name] = run_dir
            print(f"started {name} -> {run_dir}/stdout.log", flush=True)
        for proc, name in list(running):
            if proc.poll() is not None:
                running.remove((proc, name))
                how = "FAILED" if proc.returncode else "finished" if (run_dirs[name] / "eval.json").is_file() \
                    else "paused (--pause-after-minutes; continue with --resume)"
                print(f"{how} {name} (exit {proc.returncode})", flush=True)
                if proc.returncode:
                    failed.append(name)
        time.sleep(1)
    if stop:
        print(f"stopped by {signal.Signals(stop[0]).name}: continue with the same command and --resume", flush=True)
        return 128 + stop[0]
    return 1 if failed else 0


def _check_run_dir(run_dir: Path, args: argparse.Namespace, clear: bool = True) -> None:
    """A plain ``zoo train`` into a folder that holds an earlier run would replace its log and checkpoints: refuse
    unless the caller said which they meant (``--resume`` continues it, ``--restart`` removes it and starts over)."""
    from zoo.training import clear_run, run_products

    if args.resume and args.restart:
        raise UsageError("--resume and --restart exclude each other")
    found = run_products(run_dir)
    if found and not args.resume:
        if not args.restart:
            raise UsageError(f"{run_dir} already holds a run ({', '.join(found)}): continue it with --resume, or "
                             "start over with --restart (removes them)")
        if clear:
            clear_run(run_dir)


def run(args: argparse.Namespace) -> int:
    from zoo.training import Interrupted, Recipe, Trainer, recipe_path

    require(args, positive=("--jobs", "--epochs", "--log-every-steps"),
             non_negative=("--max-minutes", "--pause-after-minutes"))
    if len(args.recipe) > 1:
        return _train_parallel(args)
    recipe = Recipe.load(recipe_path(args.recipe[0]))  # a missing or malformed recipe is a ZooError: one line
    if args.epochs:
        recipe.train.epochs = args.epochs
    if args.max_minutes is not None:
        recipe.train.max_minutes = args.max_minutes
    if args.precision is not None:
        recipe.train.precision = args.precision
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / recipe.name
    _check_run_dir(run_dir, args)
    try:
        trainer = Trainer(recipe, run_dir, data_dir=args.data_dir, device=args.device, log_to=tuple(args.log_to or ()),
                          log_every_steps=args.log_every_steps, cuda_graphs=args.cuda_graphs,
                          pause_after_minutes=args.pause_after_minutes or 0.0)
    except ValueError as e:      # options this run cannot take (--cuda-graphs on a CPU, a bad log target, ...)
        raise UsageError(str(e)) from None
    try:
        result = trainer.run(resume=args.resume)
    except Interrupted as e:
        print(f"zoo train: {e}", file=sys.stderr)
        return 128 + e.signum
    if result and result.get("paused"):
        print(json.dumps({"run_dir": str(run_dir), "paused_after_epoch": result["epochs_trained"],
                          "recipe_epochs": result["epochs"], "valid_ppl": result["valid_ppl"]}))
        print("zoo train: paused at an epoch end (--pause-after-minutes); continue with --resume",
              file=sys.stderr)
    elif result:
        print(json.dumps({"run_dir": str(run_dir), "valid_ppl": result["valid"]["ppl"],
                          "test_ppl": result["test"]["ppl"], "epochs": result["epochs_trained"]}))
    return 0
