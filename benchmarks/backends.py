"""Inference speed of the backends: eager PyTorch vs TorchScript vs ONNX Runtime vs ONNX Runtime int8.

Per model and backend, through the same runner protocol the library uses:

* scoring throughput (tokens/s): one ``forward`` of a ``[B, 512]`` token batch from a zero state, B = 1 and 8;
* generation latency (ms/token) at B = 1: ``ZooModel.generate_ids`` greedy, without stopping at ``<eos>``
  (the prompt goes through ``forward`` once, then one ``step`` per token, as ``zoo generate`` does).

Repeats are interleaved across backends (round-robin) and the median is reported, so a load spike on
the shared machine hits every backend alike; the speed-ups are ratios from this one run.

Models: every bundled model (``zoo/pretrained/*``), ``--model`` checkpoints, and ``--recipe`` models:
an *untrained* model of a recipe's exact size (timing does not depend on the weights' values; marked
``untrained`` in the results). Exports are written to a temporary folder with the parity check on.

    python benchmarks/backends.py                                   # the bundled models
    python benchmarks/backends.py --model runs/x/best --recipe hyperlstm-ptb-5m-medium

Writes benchmarks/results/backends.json and the markdown table next to it (backends.md), prints the table,
then regenerates the READMEs (``python -m zoo.tools.readme``: the ``backends-table`` section of exports/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from zoo.backends import backend_names, get_backend, make_runner
from zoo.catalog import bundled_dir
from zoo.export import export_model
from zoo.export.onnx_runtime import cpu_cores
from zoo.tools.readme import write_result
from zoo.zoo_model import ZooModel

RESULTS = Path(__file__).resolve().parent / "results"
BACKENDS = tuple(backend_names())
#: Rows of the table: the backends, plus eager PyTorch limited to one thread. Why the extra row: on a
#: small machine shared with other work, torch's intra-op threads wait for a free core at every parallel
#: op, which dominates small per-token ops; one thread shows eager without that cost.
ROWS = ("eager", "eager-1thread", "torchscript", "onnx", "onnx-int8")


def recipe_model(name: str) -> ZooModel:
    """An untrained model with a recipe's architecture and sizes, and the PTB-sized vocabulary."""
    from zoo.data import load_corpus
    from zoo.datasets import get_dataset
    from zoo.lm import LanguageModel
    from zoo.tokenizer import Tokenizer
    from zoo.training import Recipe, recipe_path

    recipe = Recipe.load(recipe_path(name))
    vocab = load_corpus(recipe.dataset).vocab
    torch.manual_seed(recipe.seed)
    lm = LanguageModel(**{**recipe.model, "vocab_size": len(vocab)}).eval()
    model = ZooModel(lm, Tokenizer(vocab, get_dataset(recipe.dataset).normalization), {"name": f"{recipe.name}"},
                     name=f"{recipe.name} (untrained)")
    return model


def load_models(args: argparse.Namespace) -> list[tuple[ZooModel, str]]:
    models: list[tuple[ZooModel, str]] = []
    if not args.no_bundled and bundled_dir().is_dir():
        for d in sorted(p for p in bundled_dir().iterdir() if (p / "config.json").is_file()):
            models.append((ZooModel.from_pretrained(d, source="bundled", name=d.name), "bundled"))
    for path in args.model:
        model = ZooModel.from_pretrained(path)
        models.append((model, f"checkpoint {path}"))
    for name in args.recipe:
        models.append((recipe_model(name), "recipe size, untrained"))
    return models


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with ``n`` torch intra-op threads (``None``: leave the default)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def time_scoring(runner: Any, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    runner.forward(tokens, runner.init_state(tokens.shape[0]))
    return time.perf_counter() - t0


def time_generation(model: ZooModel, n: int) -> float:
    t0 = time.perf_counter()
    ids = model.generate_ids("the", max_new_tokens=n, temperature=0, stop_at_eos=False)
    elapsed = time.perf_counter() - t0
    assert len(ids) == n
    return elapsed / n


def bench_model(model: ZooModel, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """All backends of one model, repeats interleaved; returns medians and speed-ups over eager."""
    t0 = time.perf_counter()
    manifests = export_model(model, workdir, quantize="int8", verify=True)
    export_s = time.perf_counter() - t0
    runners = {b: make_runner(model, b, workdir / get_backend(b).format if get_backend(b).format else None)
               for b in BACKENDS}
    runners["eager-1thread"] = runners["eager"]
    views = {b: ZooModel(model.lm, model.tokenizer, model.config, name=model.name, runner=r, backend=b)
             for b, r in runners.items()}
    gen = torch.Generator().manual_seed(0)
    batches = {bsz: torch.randint(0, model.lm.vocab_size, (bsz, args.tokens), generator=gen) for bsz in args.batch}
    samples: dict[str, dict[str, list[float]]] = {b: {} for b in ROWS}
    for b in ROWS:  # warm-up: first-call allocations, ORT's lazy initialisation, TorchScript's profiling runs
        with torch_threads(1 if b == "eager-1thread" else None):
            for tokens in batches.values():
                time_scoring(runners[b], tokens[:, :32])
            time_generation(views[b], 4)
    for _ in range(args.repeats):
        for b in ROWS:
            with torch_threads(1 if b == "eager-1thread" else None):
                for bsz, tokens in batches.items():
                    samples[b].setdefault(f"score_b{bsz}_s", []).append(time_scoring(runners[b], tokens))
                samples[b].setdefault("gen_s_per_token", []).append(time_generation(views[b], args.gen_tokens))
    results: dict[str, dict[str, float]] = {}
    for b in ROWS:
        row = {f"score_tokens_per_s_b{bsz}": bsz * args.tokens / statistics.median(samples[b][f"score_b{bsz}_s"])
               for bsz in args.batch}
        row["gen_ms_per_token_b1"] = 1000 * statistics.median(samples[b]["gen_s_per_token"])
        results[b] = row
    speedup = {b: {k: (results[b][k] / results["eager"][k] if k.startswith("score")
                       else results["eager"][k] / results[b][k]) for k in results[b]} for b in ROWS}
    return {
        "model": model.name, "architecture": model.lm.architecture, "num_parameters": model.num_parameters,
        "vocab_size": model.lm.vocab_size, "export_seconds": export_s,
        "parity": {fmt: {k: m["parity"][k] for k in ("max_abs_logit_diff", "ppl_rel_diff", "passed")}
                   for fmt, m in manifests.items()},
        "int8_vs_eager_random_tokens": manifests["onnx"]["parity"].get("int8"),
        "results": results, "speedup_vs_eager": speedup,
        "raw_seconds": samples,
    }


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"Measured {meta['date']} on {meta['cpu_cores']} CPU cores ({meta['machine']}; load average "
             f"{meta['load_average_before'][0]:.1f} before the run), torch {meta['torch']} with "
             f"{meta['torch_threads']} threads, onnxruntime {meta['onnxruntime']} with {meta['ort_threads']} intra-op "
             f"threads (eager-1thread: eager with torch.set_num_threads(1)); {meta['tokens']} tokens per scored "
             f"sequence, {meta['gen_tokens']} generated tokens, median of {meta['repeats']} interleaved repeats; "
             f"load average {meta['load_average_after'][0]:.1f} after. Speed-up over eager in brackets.", "",
             "| model | backend | score tok/s B=1 | score tok/s B=8 | generate ms/token B=1 |",
             "|---|---|---:|---:|---:|"]
    for m in report["models"]:
        for b in ROWS:
            r, s = m["results"][b], m["speedup_vs_eager"][b]
            cells = [f"{r[f'score_tokens_per_s_b{k}']:,.0f} ({s[f'score_tokens_per_s_b{k}']:.2f}x)"
                     for k in meta["batch"]]
            cells.append(f"{r['gen_ms_per_token_b1']:.2f} ({s['gen_ms_per_token_b1']:.2f}x)")
            lines.append(f"| {m['model']} | {b} | " + " | ".join(cells) + " |")
    if meta.get("note"):
        lines += ["", f"Note: {meta['note']}"]
    for t in report["targets"]:
        lines.append("")
        lines.append(f"Target: ONNX Runtime >= {t['target']}x eager for {t['model']} generation per token at B=1: "
                     f"measured {t['measured']:.2f}x ({'met' if t['met'] else 'NOT met'}; "
                     f"{t['measured_vs_eager_1thread']:.2f}x against eager with one thread).")
    return "\n".join(lines)


def main() -> None:
    import onnxruntime

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="checkpoint directory (repeatable)")
    ap.add_argument("--recipe", nargs="*", default=[],
                    help="recipes whose untrained, full-size model is also timed (default: none)")
    ap.add_argument("--no-bundled", action="store_true", help="skip the bundled models")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "backends.json"))
    ap.add_argument("--note", help="a remark stored with the results and printed under the table")
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    models = load_models(args)
    if not models:
        raise SystemExit("no models to benchmark (nothing bundled; pass --model or --recipe)")
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": platform.machine(),
            "cpu_cores": cpu_cores(), "load_average_before": list(os.getloadavg()), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "onnxruntime": onnxruntime.__version__,
            "ort_threads": cpu_cores(), "tokens": args.tokens, "batch": args.batch, "gen_tokens": args.gen_tokens,
            "repeats": args.repeats, "note": args.note}
    report: dict[str, Any] = {"meta": meta, "models": [], "targets": []}
    with tempfile.TemporaryDirectory(prefix="zoo-bench-") as tmp:
        for i, (model, source) in enumerate(models):
            print(f"[{i + 1}/{len(models)}] {model.name} ({source}): exporting and timing ...", flush=True)
            row = bench_model(model, args, Path(tmp) / f"m{i}")
            row["source"] = source
            report["models"].append(row)
    meta["load_average_after"] = list(os.getloadavg())
    for m in report["models"]:
        if m["architecture"] == "alstm":
            measured = m["speedup_vs_eager"]["onnx"]["gen_ms_per_token_b1"]
            r = m["results"]
            one = r["eager-1thread"]["gen_ms_per_token_b1"] / r["onnx"]["gen_ms_per_token_b1"]
            report["targets"].append({"model": m["model"], "metric": "onnx generation speed-up at B=1",
                                      "target": 2.5, "measured": measured, "met": measured >= 2.5,
                                      "measured_vs_eager_1thread": one})
    table = markdown(report)
    print(table)
    write_result(args.out, report, table)


if __name__ == "__main__":
    main()
