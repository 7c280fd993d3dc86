"""Equal quality of bf16 training: recipes trained for 2 epochs from the same seed in fp32 and in bf16, and their
validation metric compared (the training-compute issue asks for within 1%): by default the PTB tier's aLSTM and
LSTM (perplexity); ``--recipes`` checks others, e.g. the character-level cells before a char tier trains in bf16
(bits per character, the corpus's metric from zoo.datasets).

Each run is a real ``zoo train`` of the recipe (copied as ``RECIPE-P`` with ``precision = "P"``) for 2 epochs into
``runs/precision-quality/RECIPE-P``, two at a time (``--jobs 2``: one thread each), resumable: an interrupted check
continues where it stopped when rerun. Validation is
scored in float32 for both precisions (as the trainer always does), so only the training arithmetic differs.
The lr schedule of the recipes cuts after epoch 6, so epochs 1-2 run at the recipes' full lr here as in the tier.

    python benchmarks/precision_quality.py        # ~1 core-hour on an AMD EPYC, about twice that where bf16 is slow
    python benchmarks/precision_quality.py --recipes hyperlstm-ln-ptbchar-1.5m alstm-ptbchar-1.5m --epochs 1 \
        --out benchmarks/results/precision_quality_char.json

Writes ``benchmarks/results/precision_quality.{json,md}`` and regenerates the README.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from zoo.datasets import get_dataset
from zoo.training import recipe_path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
RECIPES = ["alstm-ptb-5m-light", "lstm-ptb-5m-light"]
PRECISIONS = ["fp32", "bf16"]
TOLERANCE = 0.01


def run_dir(root: Path, recipe: str, precision: str) -> Path:
    return root / f"{recipe}-{precision}"


def train_all(root: Path, epochs: int, jobs: int, recipes: list[str]) -> None:
    """Every (recipe, precision) run to completion through ``zoo train ... --jobs``: each recipe copied under a name
    that says its precision, with ``precision`` set (bf16 first: the longest runs start first)."""
    todo = []
    for prec in reversed(PRECISIONS):
        for recipe in recipes:
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


def collect(root: Path, recipes: list[str]) -> list[dict]:
    rows = []
    for recipe in recipes:
        for prec in PRECISIONS:
            d = run_dir(root, recipe, prec)
            log = [json.loads(x) for x in (d / "log.jsonl").read_text().splitlines()]
            epochs = [r for r in log if "valid_ppl" in r]
            ev = json.loads((d / "eval.json").read_text())
            metric = get_dataset(ev["recipe"]["dataset"]).metric
            # bits per character: every symbol of a character corpus is one token
            valid = ev["valid"]["ppl"] if metric == "perplexity" else ev["valid"]["bits_per_token"]
            rows.append({"recipe": recipe, "precision": prec, "valid_ppl_by_epoch": [r["valid_ppl"] for r in epochs],
                         "train_ppl_by_epoch": [r["train_ppl"] for r in epochs], "metric": metric,
                         "valid": valid, "epochs": len(epochs),
                         "valid_ppl": ev["valid"]["ppl"], "train_seconds": ev["train_seconds"],
                         "device": ev["device"], "seed": ev["recipe"]["seed"],
                         "tokens_per_s": [r["tokens_per_s"] for r in epochs]})
    return rows


def markdown(rows: list[dict], cpu: str, context: str = "two runs sharing the two cores") -> str:
    """``context``: what shared the machine while the runs trained (their tok/s depend on it)."""
    by = {(r["recipe"], r["precision"]): r for r in rows}
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    epochs = sorted({r.get("epochs", 2) for r in rows})
    lines = [f"Equal quality ({cpu}; {'/'.join(map(str, epochs))} epoch(s) from the same seed, validation metric of "
             f"the best epoch, scored in fp32; train tok/s of the last epoch, {context}):", "",
             "| recipe | metric | fp32 valid | bf16 valid | relative difference | within 1% | "
             "fp32 train tok/s | bf16 train tok/s |", "|---|---|---:|---:|---:|---|---:|---:|"]
    for recipe in recipes:
        a, b = by[(recipe, "fp32")], by[(recipe, "bf16")]
        va, vb = a.get("valid", a["valid_ppl"]), b.get("valid", b["valid_ppl"])
        diff = vb / va - 1
        metric = "bits/char" if a.get("metric") == "bits_per_char" else "perplexity"
        lines.append(f"| {recipe} | {metric} | {va:.{3 if metric == 'bits/char' else 2}f} | "
                     f"{vb:.{3 if metric == 'bits/char' else 2}f} | {diff:+.2%} | "
                     f"{'yes' if abs(diff) <= TOLERANCE else '**no**'} | {a['tokens_per_s'][-1]:,.0f} | "
                     f"{b['tokens_per_s'][-1]:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(REPO / "runs" / "precision-quality"))
    ap.add_argument("--recipes", nargs="+", default=RECIPES, help="recipes to check (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "precision_quality.json"))
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile (printed with the table)")
    args = ap.parse_args()
    root = Path(args.root)
    train_all(root, args.epochs, args.jobs, args.recipes)
    rows = collect(root, args.recipes)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from precision import cpu_name

    cpu = cpu_name()
    context = (f"{args.jobs} check run(s) at a time, one thread each"
               + (f"; {args.note}" if args.note else ""))
    for r in rows:
        r["cpu"], r["context"] = cpu, context
    table = markdown(rows, cpu, context)
    print(table)
    from zoo.tools.readme import write_result

    write_result(args.out, rows, table)


if __name__ == "__main__":
    main()
