"""Every bundled model's card, reproduced: the test number a card publishes, scored again by the command the card
says reproduces it, in a fresh process on this machine.

A card ends its evaluation section with "Reproduce with `zoo eval NAME --dataset D --split test --batch-size B`"
(its protocol: one stream at batch 1, or single sentences for the sentence-mode models). This script takes that
command from the bundled ``README.md`` itself (so a card and this check cannot disagree on the protocol), runs it
with ``--json`` in a subprocess and compares the result with the catalogue's test metric (perplexity, or bits per
character for character-level data): the long-budget tier issue asks for 0.01%.

Results are merged per model into ``benchmarks/results/card_reproduction.json`` (a model re-bundled since its entry
was written is stale: ``tests/test_cards_bundle.py`` asks for a fresh entry for every bundled model, with the
catalogue's current number), with ``card_reproduction.md`` for the README.

    python benchmarks/card_reproduction.py                 # the models with no up-to-date entry
    python benchmarks/card_reproduction.py --all           # every bundled model (the 17M aLSTM: ~10 min at batch 1)
    python benchmarks/card_reproduction.py --models alstm-ptb-5m-long-medium
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from zoo.files import write_atomic

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
TOLERANCE = 1e-4  # 0.01%, relative
REPRODUCE_RE = re.compile(r"Reproduce with `zoo (eval [^`]+)`")


def card_command(card: str, name: str) -> list[str]:
    """The ``zoo eval ...`` arguments a card gives to reproduce its test number (ValueError if it has none)."""
    found = [m.split() for m in REPRODUCE_RE.findall(card)]
    found = [args for args in found if len(args) > 1 and args[1] == name and "--split" in args
             and args[args.index("--split") + 1] == "test"]
    if len(found) != 1:
        raise ValueError(f"{name}: its card has {len(found)} 'Reproduce with `zoo eval {name} ... --split test`' "
                         "lines (expected one)")
    return found[0]


def measured_metric(res: dict, metric: str) -> float:
    """The card's metric from ``zoo eval --json``: perplexity, or bits per predicted symbol (= bits per char)."""
    return res["ppl"] if metric == "perplexity" else res["bits_per_token"]


def others_running() -> list[str]:
    """What else ran on the machine (the long training runs share the cores; timings are only context here)."""
    proc = subprocess.run(["pgrep", "-af", "zoo train"], capture_output=True, text=True)
    return [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if " " in line and "pgrep" not in line]


def reproduce(name: str, entry: dict, pretrained: Path) -> dict:
    card = (pretrained / name / "README.md").read_text(encoding="utf-8")
    args = card_command(card, name)
    cmd = [sys.executable, "-m", "zoo.cli", *args, "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{name}: `zoo {' '.join(args)}` failed:\n{proc.stderr[-2000:]}")
    res = json.loads(proc.stdout)
    metric = entry["metrics"]["metric"]
    card_value = entry["metrics"]["test"]
    value = measured_metric(res, metric)
    rel = value / card_value - 1
    return {"command": "zoo " + " ".join(args), "metric": metric, "card_test": card_value, "measured_test": value,
            "relative_difference": rel, "within_tolerance": abs(rel) <= TOLERANCE, "tolerance": TOLERANCE,
            "num_tokens": res["num_tokens"], "seconds": round(seconds, 1), "threads": int(env["OMP_NUM_THREADS"]),
            "also_running": others_running(), "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def up_to_date(entry: dict, result: dict | None) -> bool:
    """An entry counts only for the catalogue number it was measured against (re-bundling makes it stale)."""
    return result is not None and result["card_test"] == entry["metrics"]["test"]


def markdown(results: dict[str, dict], catalog: dict) -> str:
    lines = ["Each bundled model's test number, scored again by the command its card gives (a fresh process, "
             f"this CPU; tolerance {100 * TOLERANCE:.2f}% relative). The seconds are context, not a speed benchmark: "
             "the check shares the two cores with the long training runs (counted in the last column).", "",
             "| model | command | card | measured | difference | within 0.01% | seconds (1 thread) | training runs "
             "beside it |", "|---|---|---:|---:|---:|---|---:|---:|"]
    for name in sorted(results):
        r = results[name]
        if name not in catalog["models"]:
            continue  # retired since: its record stays in the JSON, the table shows the zoo as it is
        digits = 4 if r["metric"] == "bits_per_char" else 3
        lines.append(f"| {name} | `{r['command']}` | {r['card_test']:.{digits}f} | {r['measured_test']:.{digits}f} "
                     f"| {100 * r['relative_difference']:+.5f}% | {'yes' if r['within_tolerance'] else '**no**'} | "
                     f"{r['seconds']:.0f} | {len(r['also_running'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", help="these bundled models (default: those without an up-to-date entry)")
    ap.add_argument("--all", action="store_true", help="every bundled model")
    ap.add_argument("--out", default=str(RESULTS / "card_reproduction.json"))
    args = ap.parse_args(argv)
    catalog = json.loads((REPO / "zoo" / "catalog.json").read_text())
    pretrained = REPO / "zoo" / "pretrained"
    out = Path(args.out)
    results = json.loads(out.read_text())["models"] if out.is_file() else {}
    bundled = [n for n in catalog["models"] if (pretrained / n / "config.json").is_file()]
    unknown = sorted(set(args.models or []) - set(bundled))
    if unknown:
        print(f"error: not bundled here: {', '.join(unknown)} (bundled: {', '.join(sorted(bundled))})",
              file=sys.stderr)
        return 2
    todo = args.models or [n for n in bundled if args.all or not up_to_date(catalog["models"][n], results.get(n))]
    for name in todo:
        print(f"{name}: scoring the test split as its card says ...", flush=True)
        results[name] = reproduce(name, catalog["models"][name], pretrained)
        r = results[name]
        print(f"  {r['command']}: {r['measured_test']:.6f} vs card {r['card_test']:.6f} "
              f"({100 * r['relative_difference']:+.5f}%) in {r['seconds']:.0f} s", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)  # after each model: an interrupted run keeps what it measured
        report = {"tolerance": TOLERANCE, "models": dict(sorted(results.items()))}
        write_atomic(out, json.dumps(report, indent=2) + "\n")
        write_atomic(out.with_suffix(".md"), markdown(results, catalog))
    if not todo:
        print("every bundled model has an up-to-date entry (use --all or --models to measure again)")
    if results:  # the table follows the catalogue (a retired model leaves it) even when nothing was measured
        write_atomic(out.with_suffix(".md"), markdown(results, catalog))
    from zoo.tools.readme import main as regenerate_readme

    regenerate_readme([])
    failed = [n for n in todo if not results[n]["within_tolerance"]]
    if failed:
        print(f"outside {100 * TOLERANCE:.2f}%: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
