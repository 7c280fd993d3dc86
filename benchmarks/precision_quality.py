"""Equal quality of bf16 training: the PTB tier's aLSTM and LSTM recipes trained for 2 epochs from the same seed
in fp32 and in bf16, and their validation perplexity compared (the training-compute issue asks for within 1%).

Each run is a real ``zoo train`` of the recipe (copied as ``RECIPE-P`` with ``precision = "P"``) for 2 epochs into
``runs/precision-quality/RECIPE-P``, two at a time (``--jobs 2``: one thread each), resumable: an interrupted check
continues where it stopped when rerun. Validation is
scored in float32 for both precisions (as the trainer always does), so only the training arithmetic differs.
The lr schedule of the recipes cuts after epoch 6, so epochs 1-2 run at the recipes' full lr here as in the tier.

    python benchmarks/precision_quality.py        # ~1 core-hour on an AMD EPYC, about twice that where bf16 is slow

Writes ``benchmarks/results/precision_quality.{json,md}`` and regenerates the README.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from zoo.train import recipe_path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
RECIPES = ["alstm-ptb-5m-light", "lstm-ptb-5m-light"]
PRECISIONS = ["fp32", "bf16"]
TOLERANCE = 0.01


def run_dir(root: Path, recipe: str, precision: str) -> Path:
    return root / f"{recipe}-{precision}"


def train_all(root: Path, epochs: int, jobs: int) -> None:
    """Every (recipe, precision) run to completion through ``zoo train ... --jobs``: each recipe copied under a name
    that says its precision, with ``precision`` set (bf16 first: the longest runs start first)."""
    todo = []
    for prec in reversed(PRECISIONS):
        for recipe in RECIPES:
            if (run_dir(root, recipe, prec) / "eval.json").is_file():
                continue
            text = recipe_path(recipe).read_text(encoding="utf-8")
            text = text.replace(f'name = "{recipe}"', f'name = "{run_dir(root, recipe, prec).name}"', 1)
            text = text.replace("\n[train]\n", f'\n[train]\nprecision = "{prec}"\n', 1)
            path = root / "recipes" / f"{run_dir(root, recipe, prec).name}.toml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            todo.append(str(path))
    if todo:
        cmd = [sys.executable, "-m", "zoo.cli", "train", *todo, "--jobs", str(jobs), "--epochs", str(epochs),
               "--run-dir", str(root), "--device", "cpu", "--resume"]
        if subprocess.run(cmd, cwd=REPO).returncode:
            raise SystemExit(f"a run failed (see {root}/*/stdout.log)")


def collect(root: Path) -> list[dict]:
    rows = []
    for recipe in RECIPES:
        for prec in PRECISIONS:
            d = run_dir(root, recipe, prec)
            log = [json.loads(x) for x in (d / "log.jsonl").read_text().splitlines()]
            epochs = [r for r in log if "valid_ppl" in r]
            ev = json.loads((d / "eval.json").read_text())
            rows.append({"recipe": recipe, "precision": prec, "valid_ppl_by_epoch": [r["valid_ppl"] for r in epochs],
                         "train_ppl_by_epoch": [r["train_ppl"] for r in epochs],
                         "valid_ppl": ev["valid"]["ppl"], "train_seconds": ev["train_seconds"],
                         "device": ev["device"], "seed": ev["recipe"]["seed"],
                         "tokens_per_s": [r["tokens_per_s"] for r in epochs]})
    return rows


def markdown(rows: list[dict], cpu: str) -> str:
    by = {(r["recipe"], r["precision"]): r for r in rows}
    lines = [f"Equal quality ({cpu}; 2 epochs from the same seed, validation perplexity of the best epoch, scored "
             "in fp32; train tok/s of the last epoch, two runs sharing the two cores):", "",
             "| recipe | fp32 valid ppl | bf16 valid ppl | relative difference | within 1% | "
             "fp32 train tok/s | bf16 train tok/s |", "|---|---:|---:|---:|---|---:|---:|"]
    for recipe in RECIPES:
        a, b = by[(recipe, "fp32")], by[(recipe, "bf16")]
        diff = b["valid_ppl"] / a["valid_ppl"] - 1
        lines.append(f"| {recipe} | {a['valid_ppl']:.2f} | {b['valid_ppl']:.2f} | {diff:+.2%} | "
                     f"{'yes' if abs(diff) <= TOLERANCE else '**no**'} | {a['tokens_per_s'][-1]:,.0f} | "
                     f"{b['tokens_per_s'][-1]:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(REPO / "runs" / "precision-quality"))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "precision_quality.json"))
    args = ap.parse_args()
    root = Path(args.root)
    train_all(root, args.epochs, args.jobs)
    rows = collect(root)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from precision import cpu_name

    cpu = cpu_name()
    for r in rows:
        r["cpu"] = cpu
    table = markdown(rows, cpu)
    print(table)
    from zoo.tools.readme import write_result

    write_result(args.out, rows, table)


if __name__ == "__main__":
    main()
