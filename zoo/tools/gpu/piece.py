"""One piece of several long runs at once, on the device tool's lent GPU (or the CPU, for the tests).

Why: a lent GPU gives a session 15 minutes (start-up included) and ten minutes a command, and one 17M model at
batch 20 leaves an H100 mostly idle; so each piece trains several recipes at once, each in its own ``zoo train``
process (CUDA graphs on CUDA), and stops each cleanly before the command's limit: SIGTERM makes ``zoo train``
write its checkpoint atomically after the current step (a second signal, or SIGKILL at the hard deadline, leaves
the last periodic checkpoint). Every run is then packed (:mod:`zoo.tools.gpu.ferry`) beside its run dir, and the packs
that fit the device tool's return (8 files, 64 MiB) are copied into ``--out`` with ``piece.json`` (what each run
did); a pack that does not fit waits on the warm machine for ``collect`` in the next call.

A run starts from the latest of: a pack in ``--ferry/<name>/`` (carried out by ``zoo/tools/gpu/trip.sh out``) and
its run dir under ``--runs-root`` (a warm machine's earlier piece, or a ``stage`` call's); else from the committed
pack in ``model_cards/runs/<name>/`` (:mod:`zoo.tools.gpu.runpack`, when it travelled in the tree); else epoch 1.

    python -m zoo.tools.gpu.piece train alstm-ptb-17m-ref lstm-ptb-17m-ref --budget-s 500 --out $OUT
    python -m zoo.tools.gpu.piece collect lstm-ptb-17m-ref --out $OUT   # the next call, same warm machine
    python -m zoo.tools.gpu.piece stage NAME     # a call that only carries a pack out (see trip.sh)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoo.tools.gpu import ferry, runpack
from zoo.training import Recipe, recipe_path

#: The device tool's return (``$OUT``): 8 files, 64 MiB in all; one file is piece.json.
RETURN_FILES, RETURN_BYTES = 8, 64 * ferry.MiB


@contextlib.contextmanager
def mps_daemon(on: bool) -> Iterator[None]:
    """With ``on``, a CUDA MPS control daemon for the processes started inside (they inherit its pipe folder from
    the environment), stopped on the way out; without, nothing. MPS lets kernels of several processes share the
    GPU at once instead of taking turns; it changes no setting of the device."""
    if not on:
        yield
        return
    if shutil.which("nvidia-cuda-mps-control") is None:
        raise SystemExit("--mps: nvidia-cuda-mps-control is not on this machine")
    root = Path(tempfile.mkdtemp(prefix="mps-"))
    keep = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
    os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"] = str(root), str(root)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
    try:
        yield
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, check=False)
        for k, v in keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Piece:
    """One recipe's process in this piece."""

    recipe: str
    name: str
    run_dir: Path
    started_from: str = "epoch 1"
    step_before: int = 0
    proc: subprocess.Popen | None = None
    stopped: str = ""
    seconds: float = 0.0
    record: dict[str, Any] = field(default_factory=dict)


def _step(run_dir: Path) -> int:
    meta = run_dir / "checkpoint" / "meta.json"
    return json.loads(meta.read_text())["step"] if meta.is_file() else 0


def stage(recipe: str, runs_root: Path, ferry_root: Path, repo: Path) -> Piece:
    """The run dir for ``recipe``, made resumable from the best source there is (see the module docstring)."""
    name = Recipe.load(recipe_path(recipe)).name
    piece = Piece(recipe, name, runs_root / name)
    mine = (piece.run_dir / "checkpoint" / "meta.json").is_file()
    if (ferry_root / name / ferry.MANIFEST).is_file():
        try:   # (refused when this machine's run dir is not behind the carried pack: then that one goes on)
            ferry.unpack(ferry_root / name, piece.run_dir)
            piece.started_from = f"the carried pack {ferry_root / name}"
        except ferry.FerryError:
            if not mine:
                raise
    if piece.started_from == "epoch 1" and mine:
        piece.started_from = "this machine's run dir"
    elif piece.started_from == "epoch 1" and runpack.restore(repo, name, piece.run_dir) is not None:
        piece.started_from = f"the committed pack {runpack.PACKS / name}"
    piece.step_before = _step(piece.run_dir)
    return piece


def launch(piece: Piece, device: str, data_dir: str | None, extra: list[str], graphs: bool = True) -> None:
    """``zoo train --resume`` for one recipe, its output in its run dir (the environment is inherited)."""
    cmd = [sys.executable, "-m", "zoo.cli", "train", piece.recipe, "--device", device, "--run-dir",
           str(piece.run_dir), "--resume", *extra]
    if device.startswith("cuda") and graphs:
        cmd.append("--cuda-graphs")
    if data_dir:
        cmd += ["--data-dir", data_dir]
    piece.run_dir.mkdir(parents=True, exist_ok=True)
    log = open(piece.run_dir / "piece.out", "ab")  # noqa: SIM115 (kept open for the child's lifetime)
    piece.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    log.close()


def supervise(pieces: list[Piece], stop_at: float, kill_after_s: float) -> None:
    """Wait for every process; at ``stop_at`` (a ``time.monotonic`` instant) SIGTERM the ones still running, and
    SIGKILL whichever has not written its checkpoint and exited ``kill_after_s`` later."""
    t0 = time.monotonic()
    while any(p.proc.poll() is None for p in pieces) and time.monotonic() < stop_at:
        time.sleep(0.2)
    for p in pieces:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
            p.stopped = "SIGTERM at the budget"
    hard = time.monotonic() + kill_after_s
    for p in pieces:
        try:
            p.proc.wait(timeout=max(0.0, hard - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()
            p.stopped = "SIGKILL (no checkpoint within the grace time: the last periodic one travels)"
        p.seconds = round(time.monotonic() - t0, 1)


def _exit_reason(p: Piece) -> str:
    rc = p.proc.returncode
    if p.stopped:
        return p.stopped
    return "finished or paused at an epoch end" if rc == 0 else f"failed (exit {rc})"


def pack_all(pieces: list[Piece], packs_root: Path) -> None:
    """Pack every run that has a checkpoint into ``packs_root/<name>`` (an earlier pack of it replaced)."""
    for p in pieces:
        rec = {"recipe": p.recipe, "started_from": p.started_from, "step_before": p.step_before,
               "exit": _exit_reason(p), "returncode": p.proc.returncode, "seconds": p.seconds}
        tail = (p.run_dir / "piece.out").read_bytes()[-1500:].decode("utf-8", "replace")
        rec["output_tail"] = tail
        target = packs_root / p.name
        shutil.rmtree(target, ignore_errors=True)
        try:
            manifest = ferry.pack(p.run_dir, target)
        except ferry.FerryError as e:
            rec["pack"] = f"not packed: {e}"
        else:
            rec.update(step_after=manifest["step"], epoch=manifest["epoch"], pos=manifest["pos"],
                       pack_bytes=manifest["bytes"], pack_files=1 + len(manifest["parts"]))
            log = [json.loads(x) for x in (p.run_dir / "log.jsonl").read_text().splitlines() if x.strip()]
            rec["valid_ppl"] = [[r["epoch"], r["valid_ppl"]] for r in log if "valid_ppl" in r][-3:]
        p.record = rec


def deliver(names: list[str], packs_root: Path, out: Path, files_used: int = 1) -> dict[str, str]:
    """Copy the packs of ``names`` into ``out/<name>/`` while they fit the return; says where each one went."""
    used_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    where = {}
    for name in names:
        src = packs_root / name
        if not (src / ferry.MANIFEST).is_file():
            where[name] = "no pack"
            continue
        files = sorted(f for f in src.iterdir() if f.is_file())
        size = sum(f.stat().st_size for f in files)
        if files_used + len(files) > RETURN_FILES or used_bytes + size > RETURN_BYTES:
            where[name] = f"kept on this machine in {src}: collect it with the next call"
            continue
        shutil.copytree(src, out / name, dirs_exist_ok=True)
        files_used += len(files)
        used_bytes += size
        where[name] = f"{out / name}"
    return where


def run_piece(args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    runs_root, packs_root = Path(args.runs_root), Path(args.runs_root).with_name("packs")
    pieces = [stage(r, runs_root, Path(args.ferry), Path(args.repo)) for r in args.recipes]
    fresh = [p.name for p in pieces if p.started_from == "epoch 1"]
    if args.must_resume and fresh:  # (a machine that went cold since the stage call: nothing to resume here)
        print(f"gpu_piece: --must-resume, but {', '.join(fresh)} would start from epoch 1", file=sys.stderr)
        raise SystemExit(3)
    extra = ["--pause-after-minutes", str(args.pause_after_minutes)] if args.pause_after_minutes else []
    with mps_daemon(args.mps):
        for p in pieces:
            launch(p, args.device, args.data_dir, extra, graphs=p.name not in args.eager)
        stop_at = start + args.budget_s - args.stop_margin_s
        supervise(pieces, stop_at, kill_after_s=args.stop_margin_s * 2 / 3)
    pack_all(pieces, packs_root)
    summary: dict[str, Any] = {"device": args.device, "budget_s": args.budget_s, "mps": args.mps,
                               "runs": {p.name: p.record for p in pieces}}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        returned = args.return_ or [p.name for p in pieces]
        summary["returned"] = deliver(returned, packs_root, out)
        summary["seconds"] = round(time.monotonic() - start, 1)
        (out / "piece.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["seconds"] = round(time.monotonic() - start, 1)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zoo.tools.gpu.piece", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train several recipes at once until the budget, then pack them")
    t.add_argument("recipes", nargs="+", help="recipe names or paths; the run dir is <runs-root>/<recipe name>")
    t.add_argument("--budget-s", type=float, default=540.0, help="wall seconds for the whole piece, packing "
                   "included (the device tool kills a command at 600)")
    t.add_argument("--stop-margin-s", type=float, default=75.0, help="SIGTERM this long before the budget ends "
                   "(the checkpoints and packs need it); SIGKILL two thirds of it later")
    t.add_argument("--device", default="cuda")
    t.add_argument("--runs-root", default="/tmp/runs")
    t.add_argument("--ferry", default=".devrun/ferry", help="carried packs, <ferry>/<name>/ferry.json")
    t.add_argument("--repo", default=str(runpack.REPO), help="the checkout whose model_cards/runs/ holds packs")
    t.add_argument("--data-dir", default=None)
    t.add_argument("--pause-after-minutes", type=float, default=0.0, help="also stop a run at its first epoch "
                   "end past this (passed to zoo train)")
    t.add_argument("--eager", nargs="*", default=[], help="recipe names trained without CUDA graphs (a model whose "
                   "captured step has not passed its parity test on this GPU)")
    t.add_argument("--must-resume", action="store_true", help="refuse to start any recipe from epoch 1 (after "
                   "stage calls: a machine that went cold lost what they staged)")
    t.add_argument("--mps", action="store_true", help="run the processes under a CUDA MPS daemon (use it when "
                   "benchmarks/concurrent_runs.py measured it faster)")
    t.add_argument("--out", default=os.environ.get("OUT"), help="the device tool's return folder (default $OUT)")
    t.add_argument("--return", dest="return_", nargs="*", default=None,
                   help="which packs go into --out, in this order while they fit (default: all, in recipe order)")
    s = sub.add_parser("stage", help="unpack carried packs on the (warm) machine, for a later train call")
    s.add_argument("recipes", nargs="+")
    s.add_argument("--runs-root", default="/tmp/runs")
    s.add_argument("--ferry", default=".devrun/ferry")
    s.add_argument("--repo", default=str(runpack.REPO))
    c = sub.add_parser("collect", help="copy packs left on a warm machine into --out")
    c.add_argument("names", nargs="+")
    c.add_argument("--runs-root", default="/tmp/runs")
    c.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if args.cmd == "train":
        if not 0 < args.stop_margin_s < args.budget_s:
            ap.error("--stop-margin-s must be between 0 and --budget-s")
        summary = run_piece(args)
    elif args.cmd == "stage":
        staged = [stage(r, Path(args.runs_root), Path(args.ferry), Path(args.repo)) for r in args.recipes]
        summary = {p.name: {"started_from": p.started_from, "step": p.step_before} for p in staged}
    else:
        if not args.out:
            ap.error("collect needs --out (or $OUT)")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        summary = {"returned": deliver(args.names, Path(args.runs_root).with_name("packs"), Path(args.out), 0)}
    print(json.dumps(summary, indent=1))
    return 0 if all(r.get("pack_bytes") for r in summary.get("runs", {}).values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
