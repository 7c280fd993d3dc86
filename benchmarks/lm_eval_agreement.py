"""The harness and the zoo agree: the stock ``lm_eval --model zoo`` on a whole test split against ``zoo eval``.

What the README's lm-evaluation-harness section shows, measured here rather than typed:

1. ``zoo eval MODEL --split test --batch-size 1 --json``: the card's protocol (one stream, state carried).
2. The harness's own ``lm_eval`` script of this environment (it finds ``--model zoo`` through the start-up hook,
   as a user's does) on the model's whole-split test task (``zoo_ptb_test`` / ``zoo_wikitext2_test``), batch 1:
   its printed table is kept verbatim. Its ``word_perplexity`` counts one token more than ``zoo eval``: the
   harness scores the split's first word too (given ``<eos>``), which the stream only takes as its first input.
   The difference in total log-likelihood, ``ln(word_perplexity) x tokens - zoo eval's NLL``, is reported.
3. The line task (``*_test_lines``: one document per line, each from a zero state) at ``--batch_size 1`` and 32:
   the same ``word_perplexity`` (batching never changes a score) and the wall time of each (measured once,
   context only: the cores are shared with the training runs, listed in the JSON).

Writes ``benchmarks/results/lm_eval_agreement.json`` and ``.md`` (the README's ``lm-eval-agreement`` section).

    python benchmarks/lm_eval_agreement.py                      # the catalogue's default model
    python benchmarks/lm_eval_agreement.py --model lstm-wt2-11m-long
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from precision import other_processes  # noqa: E402  (the benchmarks' one account of what else ran)

from zoo.files import write_atomic  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
#: The whole-split and per-line test tasks of each word-level corpus (zoo/lm_eval_tasks/).
TASKS = {"ptb": ("zoo_ptb_test", "zoo_ptb_test_lines"),
         "wikitext-2": ("zoo_wikitext2_test", "zoo_wikitext2_test_lines")}
LINE_BATCHES = (1, 32)


def _env() -> dict[str, str]:
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def harness(model: str, task: str, batch_size: int) -> dict:
    """One run of the stock ``lm_eval`` CLI: its results for ``task``, its printed table and its wall time."""
    tasks_dir = subprocess.run([sys.executable, "-m", "zoo.lm_eval_plugin", "--tasks-dir"], capture_output=True,
                               text=True, env=_env(), check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="zoo-lm-eval-") as out:
        cmd = [str(Path(sys.executable).parent / "lm_eval"), "--model", "zoo", "--model_args", f"pretrained={model}",
               "--tasks", task, "--device", "cpu", "--batch_size", str(batch_size), "--include_path", tasks_dir,
               "--output_path", out]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
        seconds = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"lm_eval failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
        files = sorted(glob.glob(str(Path(out) / "**" / "results_*.json"), recursive=True))
        results = json.loads(Path(files[-1]).read_text())["results"][task]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    shown = (f"lm_eval --model zoo --model_args pretrained={model} --tasks {task} --device cpu"
             + (f" --batch_size {batch_size}" if batch_size != 1 else "")
             + ' --include_path "$(zoo-lm-eval --tasks-dir)"')
    return {"command": shown, "batch_size": batch_size, "seconds": round(seconds, 1), "table": table,
            "word_perplexity": results["word_perplexity,none"], "byte_perplexity": results["byte_perplexity,none"],
            "bits_per_byte": results["bits_per_byte,none"]}


def zoo_eval(model: str, dataset: str) -> dict:
    cmd = [sys.executable, "-m", "zoo.cli", "eval", model, "--dataset", dataset, "--split", "test", "--batch-size",
           "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"zoo eval failed:\n{proc.stderr[-2000:]}")
    res = json.loads(proc.stdout)
    return {"command": f"zoo eval {model} --dataset {dataset} --split test --batch-size 1", "ppl": res["ppl"],
            "nll": res["nll"], "num_tokens": res["num_tokens"]}


def markdown(r: dict) -> str:
    w, z = r["whole"], r["zoo_eval"]
    lines = [f"`{w['command']}` (`{r['model']}`, {r['measured_at']}):", "", "```", *w["table"], "```", "",
             f"`{z['command']}` gives {z['ppl']:.4f} over {z['num_tokens']:,} predicted tokens; the harness's "
             f"{w['word_perplexity']:.4f} is over {r['harness_tokens']:,}, the split's first word too "
             f"({r['relative_difference']:+.1e} relative; the total log-likelihood differs by "
             f"{r['nll_difference_nats']:.2f} nats out of {z['nll']:,.0f}).", "",
             "The line task (one document per line, each from a zero state) at two batch sizes: the same word "
             "perplexity, in different times (one run each, the cores shared with "
             f"{len(r['also_running'])} other process(es), so only a rough guide):", "",
             "| `--batch_size` | word_perplexity | seconds |", "|---:|---:|---:|"]
    for run in r["lines"]:
        lines.append(f"| {run['batch_size']} | {run['word_perplexity']:.4f} | {run['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a bundled word-level model (default: the catalogue's default)")
    ap.add_argument("--out", default=str(RESULTS / "lm_eval_agreement.json"))
    args = ap.parse_args(argv)
    catalog = json.loads((REPO / "zoo" / "catalog.json").read_text())
    model = args.model or catalog["default"]
    entry = catalog["models"].get(model)
    if entry is None or entry["dataset"] not in TASKS:
        ap.error(f"{model!r}: not a bundled word-level model (one of: "
                 f"{', '.join(sorted(n for n, e in catalog['models'].items() if e['dataset'] in TASKS))})")
    from zoo.data import load_corpus

    whole_task, line_task = TASKS[entry["dataset"]]
    print(f"zoo eval {model} ...", flush=True)
    z = zoo_eval(model, entry["dataset"])
    print(f"lm_eval {whole_task} ...", flush=True)
    w = harness(model, whole_task, 1)
    tokens = load_corpus(entry["dataset"]).split("test").numel()
    lines = []
    for bs in LINE_BATCHES:
        print(f"lm_eval {line_task} --batch_size {bs} ...", flush=True)
        lines.append(harness(model, line_task, bs))
    res = {"model": model, "dataset": entry["dataset"], "card_test": entry["metrics"]["test"], "zoo_eval": z,
           "whole": w, "harness_tokens": tokens, "relative_difference": w["word_perplexity"] / z["ppl"] - 1,
           "nll_difference_nats": math.log(w["word_perplexity"]) * tokens - z["nll"], "lines": lines,
           "threads": int(_env()["OMP_NUM_THREADS"]), "also_running": other_processes(),
           "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(res, indent=2) + "\n")
    write_atomic(out.with_suffix(".md"), markdown(res))
    print(markdown(res))
    if out.resolve().parent == RESULTS.resolve():
        from zoo.tools.readme import main as regenerate_readme

        regenerate_readme([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
