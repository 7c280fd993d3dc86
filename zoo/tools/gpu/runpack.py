"""A long GPU run's latest ferry pack, committed to the repository, so that no machine holds the only copy.

Why: lent GPUs are not kept, and neither is this checkout's ignored ``runs/`` folder across a change of side: the
paper-scale aLSTM's first 72 epochs were lost with the one machine that held their checkpoint. After every GPU
piece the run's packed state (:mod:`zoo.tools.gpu.ferry`: float16 weights, Adam's second moment as an 8-bit log code,
its first moment as float16 when ``beta1 > 0``, every counter and RNG state exact, the log) is committed in one
place, ``model_cards/runs/<name>/`` (the manifest ``ferry.json`` and its parts), *replacing* the previous pack: the
tree holds only the latest pack, so a checkout grows by one pack's size per run, and the history by one pack per
piece (git keeps the old blobs; float16 weights do not delta-compress). ``zoo/tools/gpu/trip.sh out`` takes the
pack from there when ``runs/<name>`` is missing (a fresh clone, another machine).

    python -m zoo.tools.gpu.runpack commit NAME PARTS_DIR   # a returned pack (the device call's files) -> the repo
    python -m zoo.tools.gpu.runpack commit NAME runs/NAME   # or pack a local run dir and commit that
    python -m zoo.tools.gpu.runpack restore NAME runs/NAME  # the committed pack -> a resumable run dir, if missing
    python -m zoo.tools.gpu.runpack carry NAME... --to .devrun/ferry   # (trip.sh out) the latest state of each
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from zoo.errors import ZooError
from zoo.tools.gpu import ferry

REPO = Path(__file__).resolve().parents[3]
PACKS = Path("model_cards") / "runs"


def pack_dir(repo: Path, name: str) -> Path:
    """Where run ``name``'s committed pack lives in checkout ``repo``."""
    return repo / PACKS / name


def committed(repo: Path, name: str) -> dict[str, Any] | None:
    """The committed pack's manifest (epoch, pos, step, parts), or None when there is none."""
    path = pack_dir(repo, name) / ferry.MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def commit_pack(repo: Path, name: str, source: Path, message: str = "") -> dict[str, Any]:
    """Put ``source``'s pack (a parts folder, or a run dir packed here first) into ``model_cards/runs/<name>/``,
    replacing the previous pack, and commit that folder alone (nothing else staged goes in). Refuses a pack that
    is behind the committed one, so a stale return never overwrites a later piece."""
    with tempfile.TemporaryDirectory() as tmp:
        if (source / "checkpoint" / "meta.json").is_file():
            ferry.pack(source, Path(tmp) / "p")
            source = Path(tmp) / "p"
        manifest = ferry.check_parts(source)
        have = committed(repo, name)
        if have is not None and (have["epoch"], have["pos"]) > (manifest["epoch"], manifest["pos"]):
            raise ferry.FerryError(f"{pack_dir(repo, name)} holds epoch {have['epoch']} (pos {have['pos']}), ahead "
                                   f"of this pack's epoch {manifest['epoch']} (pos {manifest['pos']})")
        target = pack_dir(repo, name)
        staged = target.with_name(f".{name}.new")
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        for f in [ferry.MANIFEST] + [p["name"] for p in manifest["parts"]]:
            shutil.copyfile(source / f, staged / f)
    ferry._swap_in(staged, target)
    rel = str(PACKS / name)
    _git(repo, "add", "-A", "--", rel)
    if _git(repo, "status", "--porcelain", "--", rel).strip():
        where = f" and {manifest['pos']} rows of the next" if manifest["pos"] else ""
        msg = message or (f"{name}: ferry pack after a GPU piece, {manifest['epoch'] - 1} epochs{where} done, step "
                          f"{manifest['step']} ({manifest['bytes'] / 1e6:.1f} MB, from {manifest['from']}): "
                          f"replaces the previous pack")
        _git(repo, "commit", "-q", "-m", msg, "--", rel)
    return manifest


def restore(repo: Path, name: str, run_dir: Path) -> dict[str, Any] | None:
    """Make ``run_dir`` resumable from the committed pack when it holds no checkpoint of its own; None when there
    is nothing to do (a checkpoint already there, or no pack committed: the run starts from epoch 1)."""
    if (run_dir / "checkpoint" / "meta.json").is_file() or committed(repo, name) is None:
        return None
    return ferry.unpack(pack_dir(repo, name), run_dir)


def carry_out(repo: Path, names: list[str], dest: Path, limit: int = ferry.TOTAL_LIMIT) -> dict[str, str]:
    """Put each run's latest state into ``dest/<name>/`` for the device call: ``runs/<name>`` packed when its
    checkpoint is not behind the committed pack, else the committed pack itself (a fresh clone, another machine);
    a run with neither starts from epoch 1. Refuses packs that together exceed what one call carries."""
    where: dict[str, str] = {}
    total = 0
    for name in names:
        local, have = repo / "runs" / name, committed(repo, name)
        target = dest / name
        shutil.rmtree(target, ignore_errors=True)
        meta = local / "checkpoint" / "meta.json"
        mine = json.loads(meta.read_text()) if meta.is_file() else None
        if mine is not None and (have is None or (mine["epoch"], mine["pos"]) >= (have["epoch"], have["pos"])):
            ferry.pack(local, target)
            where[name] = f"{local} packed"
        elif have is not None:
            shutil.copytree(pack_dir(repo, name), target)
            where[name] = f"the committed pack {PACKS / name} (epoch {have['epoch']}, pos {have['pos']})"
        else:
            where[name] = "nothing to carry: starts from epoch 1"
            continue
        total += sum(f.stat().st_size for f in target.iterdir())
    if total > limit:
        raise ferry.FerryError(f"the packs of {', '.join(names)} take {total / ferry.MiB:.1f} MiB, over the "
                               f"{limit / ferry.MiB:.0f} MiB one device call carries beside the tree and the data: "
                               f"carry them in separate calls (trip.sh out NAME, then piece.sh stage NAME)")
    return where


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zoo.tools.gpu.runpack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout (default: this one)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("commit", help="a returned pack or a run dir -> model_cards/runs/NAME/, committed")
    c.add_argument("name")
    c.add_argument("source", type=Path)
    c.add_argument("-m", "--message", default="")
    r = sub.add_parser("restore", help="model_cards/runs/NAME/ -> RUN_DIR, when RUN_DIR has no checkpoint")
    r.add_argument("name")
    r.add_argument("run_dir", type=Path)
    o = sub.add_parser("carry", help="each NAME's latest state (runs/NAME or its committed pack) -> DEST/NAME/")
    o.add_argument("names", nargs="+")
    o.add_argument("--to", type=Path, required=True, dest="dest")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "commit":
            result = commit_pack(args.repo, args.name, args.source, args.message)
        elif args.cmd == "carry":
            result = carry_out(args.repo, args.names, args.dest)
        else:
            result = restore(args.repo, args.name, args.run_dir) or {"restored": False}
    except (ferry.FerryError, ZooError, OSError, KeyError, ValueError) as e:
        print(f"runpack: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"runpack: git {' '.join(e.cmd[3:])} failed: {(e.stderr or '').strip()}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
