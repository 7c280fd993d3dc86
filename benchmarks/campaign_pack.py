"""What the GPU campaign's committed pack costs the repository, and how closely a run resumes from it.

Why: after every GPU piece the run's ferry pack is committed to ``model_cards/runs/<name>/`` (``zoo/tools/
runpack.py``), replacing the previous pack in the tree; git's history keeps every pack, so a fresh clone grows by
about one pack per piece. This measures, for the paper-scale model of a queue recipe (default the 17.2M aLSTM):

* the training checkpoint and its pack (bytes), after real training steps on this machine's CPU;
* a fresh clone's ``.git`` of a temporary repository holding one, then two successive packs (two pieces);
* the resume gap: the next ``--steps`` training losses from the float32 checkpoint and from the unpacked pack
  (same data, same RNG states: only the float16 weights and the 8-bit second moment differ).

    python benchmarks/campaign_pack.py --recipe alstm-ptb-17m-ref --out benchmarks/results/campaign_pack.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from zoo.tools.gpu import ferry, runpack
from zoo.training import Recipe, Trainer, recipe_path


def _steps(t: Trainer, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        x, y, seq_len, t.pos = t._next_batch(None)
        losses.append(t.train_step(x, y, seq_len))
        t.step += 1
    return losses


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def _clone_git_bytes(repo: Path, where: Path) -> int:
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", "--no-local", str(repo), str(where)], check=True)
    return _size(where / ".git")


def measure(recipe: Recipe, data_dir: str | None, steps: int, tmp: Path) -> dict:
    repo = tmp / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "bench@example.invalid")
    _git(repo, "config", "user.name", "bench")
    (repo / "README.md").write_text("a checkout\n")
    _git(repo, "add", "README.md")
    _git(repo, "commit", "-q", "-m", "start")
    empty = _clone_git_bytes(repo, tmp / "clone0")
    t = Trainer(recipe, tmp / "run", data_dir=data_dir, device="cpu", progress=False)
    clones, packs = [], []
    for _ in range(2):                       # two pieces: a step each, a checkpoint, a pack, a commit
        _steps(t, 1)
        t.save_training_checkpoint()
        packs.append(runpack.commit_pack(repo, recipe.name, t.run_dir)["bytes"])
        clones.append(_clone_git_bytes(repo, tmp / f"clone{len(clones) + 1}"))
    checkpoint = _size(t.run_dir / "checkpoint")
    ferry.unpack(runpack.pack_dir(repo, recipe.name), tmp / "carried")
    fp32 = Trainer(recipe, t.run_dir, data_dir=data_dir, device="cpu", progress=False)
    carried = Trainer(recipe, tmp / "carried", data_dir=data_dir, device="cpu", progress=False)
    assert fp32.load_training_checkpoint() and carried.load_training_checkpoint()
    a, b = _steps(fp32, steps), _steps(carried, steps)
    gaps = [abs(x - y) / x for x, y in zip(a, b, strict=True)]
    return {"recipe": recipe.name, "num_parameters": t.model.num_parameters(), "checkpoint_bytes": checkpoint,
            "pack_bytes": packs, "pack_files": len(list(runpack.pack_dir(repo, recipe.name).iterdir())),
            "tree_pack_bytes": _size(runpack.pack_dir(repo, recipe.name)),
            "clone_git_bytes": {"no pack": empty, "one pack": clones[0], "two packs": clones[1]},
            "growth_per_piece_bytes": clones[1] - clones[0],
            "resume": {"steps": steps, "loss_fp32": a, "loss_carried": b, "max_relative_gap": max(gaps)}}


def pack_size(recipe: Recipe, data_dir: str | None, tmp: Path) -> dict:
    """The checkpoint and pack of ``recipe`` after one step (at batch 2, length 5: a pack's size depends on the
    parameters and the optimiser, not on the batch)."""
    recipe.train.batch_size, recipe.train.bptt, recipe.train.variable_bptt = 2, 5, False
    t = Trainer(recipe, tmp / recipe.name, data_dir=data_dir, device="cpu", progress=False)
    _steps(t, 1)
    t.save_training_checkpoint()
    manifest = ferry.pack(t.run_dir, tmp / f"{recipe.name}.pack")
    return {"recipe": recipe.name, "num_parameters": t.model.num_parameters(),
            "checkpoint_bytes": _size(t.run_dir / "checkpoint"), "pack_bytes": manifest["bytes"],
            "pack_files": 1 + len(manifest["parts"])}


def table(r: dict) -> str:
    mb = 1e6
    c = r["clone_git_bytes"]
    return "\n".join([
        f"Recipe `{r['recipe']}` ({r['num_parameters']:,} parameters), packed after real steps on the CPU; a "
        "temporary repository, fresh clones (`git clone --no-local`).", "",
        "| what | MB |", "|---|---:|",
        f"| training checkpoint (float32 weights, Adam's two moments) | {r['checkpoint_bytes'] / mb:.1f} |",
        f"| its ferry pack, committed in `model_cards/runs/<name>/` | {r['pack_bytes'][-1] / mb:.1f} |",
        f"| a fresh clone's `.git`: no pack / one pack / two packs | {c['no pack'] / mb:.2f} / "
        f"{c['one pack'] / mb:.1f} / {c['two packs'] / mb:.1f} |",
        f"| growth of a fresh clone per piece (history keeps each pack) | {r['growth_per_piece_bytes'] / mb:.1f} |",
        "", f"Resumed from the pack instead of the float32 checkpoint, the next {r['resume']['steps']} training "
        f"losses differ by at most {r['resume']['max_relative_gap']:.1e} (relative).", "",
        "The queue's packs (`model_cards/runs/QUEUE.md`; one call returns 8 files, 64 MiB):", "",
        "| recipe | parameters | checkpoint MB | pack MB | files |", "|---|---:|---:|---:|---:|",
        *[f"| `{o['recipe']}` | {o['num_parameters']:,} | {o['checkpoint_bytes'] / mb:.1f} | "
          f"{o['pack_bytes'] / mb:.1f} | {o['pack_files']} |" for o in r.get("queue", [])]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="alstm-ptb-17m-ref")
    ap.add_argument("--data-dir")
    ap.add_argument("--steps", type=int, default=5, help="training steps compared after the resume")
    ap.add_argument("--also", nargs="*", default=["lstm-ptb-17m-ref", "hyperlstm-ln-ptbchar-4.9m-ref"],
                    help="recipes whose pack size alone is measured (after one small step)")
    ap.add_argument("--out", default="benchmarks/results/campaign_pack.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(Recipe.load(recipe_path(args.recipe)), args.data_dir, args.steps, Path(tmp))
        main_row = {k: result[k] for k in ("recipe", "num_parameters", "checkpoint_bytes")}
        main_row.update(pack_bytes=result["pack_bytes"][-1], pack_files=result["pack_files"])
        result["queue"] = [main_row] + [pack_size(Recipe.load(recipe_path(n)), args.data_dir, Path(tmp))
                                        for n in args.also]
    from zoo.tools.readme import write_result
    write_result(args.out, result, table(result))


if __name__ == "__main__":
    main()
