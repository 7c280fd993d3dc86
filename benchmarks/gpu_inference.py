"""Inference on a GPU against the CPU, in one run on one machine: equal numbers first, then the speed.

Equality (fp32, TF32 off): each model's test-split number on the device against the CPU's (``1e-5`` relative): a
prefix of the split scored on both here, and the whole split on the device against the CPU number ``zoo eval``
wrote to ``benchmarks/results/card_reproduction.json``; greedy generation token for token; dynamic evaluation of
the default model (``1e-4``) on a prefix scored on both here, and of the LSTM baseline (:data:`DYNAMIC_EQUALITY`:
cuDNN's kernel, with CUDA graphs and eager). Speed (the default model; the CPU with ``--threads``
threads, one by default, as the cards' numbers were measured): scoring tokens/s at batch 1 (CUDA graphs and eager)
and batch 64 (fp32 and bf16), generation ms/token at batch 1 with and without graphs, one dynamic-evaluation pass
of the PTB test split on the device (the CPU's speed from a prefix of it).

    python benchmarks/gpu_inference.py --out $OUT/gpu_inference.json          # a lent GPU, ~5 minutes
    python benchmarks/gpu_inference.py --device cpu --quick --out /tmp/q.json  # the whole script, tiny, no GPU

The bundled weights (167 MB) do not fit one device call (64 MiB): ``benchmarks/gpu_inference_trip.sh`` ships one
group of models (:data:`GROUPS`) per call, and ``--merge`` adds a later group's equality rows to the first call's
JSON. Writes JSON and a markdown table (``zoo.tools.readme`` puts it in the README).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import zoo
from zoo.catalog import catalog
from zoo.data import load_corpus, sentences
from zoo.device import resolve_device
from zoo.dynamic import dynamic_logprobs
from zoo.scoring import evaluate_sentences, evaluate_stream
from zoo.tools.readme import write_result

REPO = Path(__file__).resolve().parent.parent
CARDS = REPO / "benchmarks" / "results" / "card_reproduction.json"
#: the bundled models in groups whose weights and data fit one device call (64 MiB with the tree, ~5 MB);
#: the first holds the default model, which the speed and dynamic-evaluation parts use
GROUPS = [
    ["alstm-ptb-5m-long-medium", "alstm-ptb-5m", "alstm-ptb-5m-light", "hyperlstm-ptb-5m-long-medium",
     "lstm-ptb-5m-long-light"],
    ["pnorm-gru-ptb-5m-p1", "alstm-ptbchar-1.5m-long", "hyperlstm-ptbchar-1.5m-long",
     "hyperlstm-ln-ptbchar-1.5m-long", "lstm-ptbchar-1.5m-long", "pnorm-gru-ptbchar-sent-p1",
     "pnorm-gru-ptbchar-sent-p2"],
    ["alstm-ptb-17m", "lstm-ptb-zaremba-small"],
    ["alstm-wt2-11m-long-light", "lstm-wt2-11m-long"],
]
#: relative tolerances of the issue: static scores, dynamic evaluation
STATIC_TOL, DYNAMIC_TOL = 1e-5, 1e-4
#: models (of GROUPS[0]) whose dynamic evaluation is also checked against the CPU on a prefix, graphs and eager: the
#: LSTM baseline runs cuDNN's RNN kernel, whose backward needs it run in training mode (issue 51)
DYNAMIC_EQUALITY = ["lstm-ptb-5m-long-light"]
PROMPT = "the company said it expects"


class Clock:
    """Wall time of a call that ends when the device has finished (CUDA runs asynchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Any) -> tuple[Any, float]:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


_BUILDS: list[subprocess.Popen] = []


def load(name: str, models_dir: str | None, device: str, cuda_graphs: bool = True) -> zoo.ZooModel:
    """A model from ``models_dir/NAME`` (what a device call carries) or the bundle, on ``device``; a CPU model only
    once the C++ loops are built (:func:`build_extensions`)."""
    if device == "cpu":
        while _BUILDS:
            _BUILDS.pop().wait()
    path = Path(models_dir) / name if models_dir else None
    model = zoo.load(str(path) if path and path.is_dir() else name)
    model.name = name
    return model.to(device, cuda_graphs=cuda_graphs)


def ppl(logprobs: torch.Tensor) -> float:
    return math.exp(-float(logprobs.mean()))


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def metric(model: zoo.ZooModel, res: dict[str, Any]) -> tuple[str, float]:
    """The card's metric of an evaluation: perplexity, or bits per character for a character model."""
    return ("bits_per_char", res["bits_per_token"]) if model.tokenizer.is_char else ("perplexity", res["ppl"])


def prefix_eval(model: zoo.ZooModel, tokens: int) -> dict[str, Any]:
    """The model's own test protocol on the first ``tokens`` of the test split (or the sentences they hold)."""
    proto = model.eval_protocol("test")
    stream = load_corpus(model.config["dataset"]).test[:tokens]
    if proto["mode"] == "sentences":
        seqs = sentences(stream, model.tokenizer.eos_id, proto["max_len"])
        return evaluate_sentences(model.runner, seqs, batch_size=proto["batch_size"], pad_id=model.tokenizer.eos_id,
                                  progress=False)
    return evaluate_stream(model.runner, stream, batch_size=proto["batch_size"], bptt=proto["bptt"], progress=False,
                           vocab_size=len(model.tokenizer))


def equality(name: str, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """One model: a test prefix on the CPU and the device, greedy generation on both, the whole test split on
    the device against the CPU's recorded number (skipped past the time budget)."""
    cpu, dev = load(name, args.models_dir, "cpu"), load(name, args.models_dir, args.device)
    kind, cpu_prefix = metric(cpu, prefix_eval(cpu, args.prefix_tokens))
    _, dev_prefix = metric(dev, prefix_eval(dev, args.prefix_tokens))
    n = args.greedy_tokens
    cpu_ids = cpu.generate_ids(PROMPT, max_new_tokens=n, temperature=0)
    dev_ids = dev.generate_ids(PROMPT, max_new_tokens=n, temperature=0)
    rec: dict[str, Any] = {
        "metric": kind, "prefix_tokens": args.prefix_tokens, "prefix_cpu": cpu_prefix, "prefix_device": dev_prefix,
        "prefix_rel_diff": rel(dev_prefix, cpu_prefix), "greedy_tokens": n, "greedy_identical": cpu_ids == dev_ids}
    cards = json.loads(CARDS.read_text())["models"] if CARDS.is_file() else {}
    if args.quick or name not in cards:
        rec["test"] = "not run (--quick)" if args.quick else "not run: no CPU number in card_reproduction.json"
    elif time.monotonic() > deadline:
        rec["test"] = "not run: past --budget-s"
    else:
        res, secs = Clock(dev.device)(lambda: dev.evaluate(split="test", progress=False))
        cpu_test = cards[name]["measured_test"]
        rec.update(test_cpu=cpu_test, test_cpu_source=f"{CARDS.relative_to(REPO)} ({cards[name]['command']})",
                   test_device=metric(dev, res)[1], test_tokens=res["num_tokens"], test_device_s=round(secs, 2))
        rec["test_rel_diff"] = rel(rec["test_device"], cpu_test)
    rec["ok"] = (rec["prefix_rel_diff"] <= STATIC_TOL and rec["greedy_identical"]
                 and rec.get("test_rel_diff", 0.0) <= STATIC_TOL)
    print(f"{name}: prefix {dev_prefix:.6g} vs {cpu_prefix:.6g} (rel {rec['prefix_rel_diff']:.1e}), greedy "
          f"{'identical' if rec['greedy_identical'] else 'DIFFERENT'}, test "
          f"{rec.get('test_rel_diff', rec.get('test'))}", flush=True)
    return rec


def scoring_speed(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of stream scoring at batch 1 (bptt 70) and batch 64, CPU against the device."""
    test = load_corpus("ptb").test
    q = args.quick
    b1_cpu, b1_dev = test[:300 if q else 3000], test[:1000 if q else 20000]
    b64_cpu, b64_dev = test[:64 * 71 * (1 if q else 4)], test[:64 * 71] if q else test

    def rate(model: zoo.ZooModel, stream: torch.Tensor, batch: int) -> dict[str, Any]:
        warm = stream[:batch * 71 * (3 if batch == 1 else 1)]   # (batch 1: the second chunk is captured)
        evaluate_stream(model.runner, warm, batch_size=batch, bptt=70, progress=False)
        res, secs = Clock(model.device)(lambda: evaluate_stream(model.runner, stream, batch_size=batch, bptt=70,
                                                                progress=False))
        return {"tokens": res["num_tokens"], "seconds": round(secs, 3), "tokens_per_s": res["num_tokens"] / secs,
                "ppl": res["ppl"]}

    cpu = load(name, args.models_dir, "cpu")
    out = {"batch1": {"cpu": rate(cpu, b1_cpu, 1)}, "batch64": {"cpu": rate(cpu, b64_cpu, 64)}}
    dev = load(name, args.models_dir, args.device)
    out["batch1"]["device_graphs"] = rate(dev, b1_dev, 1)
    out["batch64"]["device_fp32"] = rate(dev, b64_dev, 64)
    dev.set_precision("bf16")
    out["batch64"]["device_bf16"] = rate(dev, b64_dev, 64)
    b64 = out["batch64"]
    b64["bf16_ppl_rel_diff"] = rel(b64["device_bf16"]["ppl"], b64["device_fp32"]["ppl"])
    eager = load(name, args.models_dir, args.device, cuda_graphs=False)
    out["batch1"]["device_eager"] = rate(eager, b1_dev, 1)
    for key, base in (("batch1", "device_graphs"), ("batch64", "device_fp32"), ("batch64", "device_bf16")):
        out[key][f"{base}_vs_cpu"] = out[key][base]["tokens_per_s"] / out[key]["cpu"]["tokens_per_s"]
    return out


def generation_speed(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Milliseconds per generated token at batch 1 (greedy, after a short warm-up): CPU, device eager, graphs."""
    n = 20 if args.quick else 200

    def ms(model: zoo.ZooModel) -> float:
        model.generate_ids(PROMPT, max_new_tokens=8, temperature=0)   # warm-up (and the graphs' capture)
        _, secs = Clock(model.device)(lambda: model.generate_ids(PROMPT, max_new_tokens=n, temperature=0))
        return 1000 * secs / n

    out = {"tokens": n, "cpu_ms": ms(load(name, args.models_dir, "cpu")),
           "device_eager_ms": ms(load(name, args.models_dir, args.device, cuda_graphs=False)),
           "device_graphs_ms": ms(load(name, args.models_dir, args.device))}
    out["graphs_vs_eager"] = out["device_eager_ms"] / out["device_graphs_ms"]
    out["graphs_vs_cpu"] = out["cpu_ms"] / out["device_graphs_ms"]
    return out


def dynamic_speed(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One dynamic-evaluation pass of the PTB test split on the device (``--quick``: its first 400 tokens); the
    CPU on a prefix of it, compared token for token (same gradient statistics, collected on the device)."""
    dev = load(name, args.models_dir, args.device)
    params = dev.dynamic_defaults
    if args.quick:  # (the statistics of 100k training tokens take minutes of a CPU core)
        params = params.with_changes({"stats_tokens": 2 * params.stats_batch * (params.stats_bptt + 1)})
    stats, stats_s = Clock(dev.device)(lambda: dev.dynamic_stats(params, progress=False, cache=False))
    test = load_corpus("ptb").test
    stream = test[:401] if args.quick else test
    lp, secs = Clock(dev.device)(lambda: dynamic_logprobs(dev.lm, stream[:-1], stream[1:], params, stats=stats))
    m = args.dynamic_cpu_tokens
    eager, eager_s = Clock(dev.device)(lambda: dynamic_logprobs(dev.lm, stream[:2 * m], stream[1:2 * m + 1], params,
                                                                 stats=stats, cuda_graphs=False))
    cpu = load(name, args.models_dir, "cpu")
    cpu_stats = type(stats)(tuple(r.cpu() for r in stats.rms), stats.num_tokens, stats.key) if stats else None
    cpu_lp, cpu_s = Clock(torch.device("cpu"))(
        lambda: dynamic_logprobs(cpu.lm, stream[:m], stream[1:m + 1], params, stats=cpu_stats))
    out = {"params": params.to_dict(), "stats_seconds": round(stats_s, 2), "tokens": lp.numel(),
           "device_seconds": round(secs, 2), "device_tokens_per_s": lp.numel() / secs, "device_ppl": ppl(lp),
           "device_eager_tokens": eager.numel(), "device_eager_tokens_per_s": eager.numel() / eager_s,
           "cpu_tokens": m, "cpu_seconds": round(cpu_s, 2), "cpu_tokens_per_s": m / cpu_s,
           "prefix_ppl_cpu": ppl(cpu_lp), "prefix_ppl_device": ppl(lp[:m])}
    out["prefix_rel_diff"] = rel(out["prefix_ppl_device"], out["prefix_ppl_cpu"])
    out["ok"] = out["prefix_rel_diff"] <= DYNAMIC_TOL
    out["speedup_vs_cpu"] = out["device_tokens_per_s"] / out["cpu_tokens_per_s"]
    out["cpu_full_pass_s_estimate"] = round(lp.numel() / out["cpu_tokens_per_s"], 1)
    return out


def dynamic_equality(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Dynamic evaluation of ``name`` on the first ``--dynamic-cpu-tokens`` / 2 PTB test tokens: the device with CUDA
    graphs and eager against the CPU (the same gradient statistics, collected on the device from a tenth of the
    default training tokens: the check is the update, not the statistics)."""
    dev, cpu = load(name, args.models_dir, args.device), load(name, args.models_dir, "cpu")
    params = dev.dynamic_defaults
    params = params.with_changes({"stats_tokens": max(2 * params.stats_batch * (params.stats_bptt + 1),
                                                      params.stats_tokens // (100 if args.quick else 10))})
    stats = dev.dynamic_stats(params, progress=False, cache=False)
    cpu_stats = type(stats)(tuple(r.cpu() for r in stats.rms), stats.num_tokens, stats.key) if stats else None
    m = args.dynamic_cpu_tokens // 2
    stream = load_corpus(dev.config["dataset"]).test[:m + 1]
    x, y = stream[:-1], stream[1:]
    graphs, graphs_s = Clock(dev.device)(lambda: dynamic_logprobs(dev.lm, x, y, params, stats=stats))
    eager = dynamic_logprobs(dev.lm, x, y, params, stats=stats, cuda_graphs=False)
    ref = dynamic_logprobs(cpu.lm, x, y, params, stats=cpu_stats)
    out = {"tokens": m, "stats_tokens": params.stats_tokens, "ppl_cpu": ppl(ref), "ppl_device_graphs": ppl(graphs),
           "ppl_device_eager": ppl(eager), "device_graphs_s": round(graphs_s, 2),
           "max_token_abs_diff": float((graphs - ref).abs().max())}
    out["rel_diff"] = max(rel(out["ppl_device_graphs"], out["ppl_cpu"]), rel(out["ppl_device_eager"], out["ppl_cpu"]))
    out["ok"] = out["rel_diff"] <= DYNAMIC_TOL
    print(f"{name} (dynamic): {out['ppl_device_graphs']:.6g} / eager {out['ppl_device_eager']:.6g} vs CPU "
          f"{out['ppl_cpu']:.6g} (rel {out['rel_diff']:.1e})", flush=True)
    return out


def build_extensions() -> None:
    """Build the CPU's C++ loops (a fresh machine compiles them, under a minute each) in the background, one
    process each, while the device works: the CPU's timings must use them, as the CPU's published timings do."""
    from zoo.models._compiled import SOURCES

    code = "import sys; from zoo.models._compiled import load; load(sys.argv[1])"
    _BUILDS.extend(subprocess.Popen([sys.executable, "-c", code, name], env=dict(os.environ)) for name in SOURCES)


def machine(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "cpu_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "quick": args.quick, "tf32": torch.backends.cuda.matmul.allow_tf32
            or torch.backends.cudnn.allow_tf32, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line)
    except (OSError, StopIteration):
        pass
    return info


def targets(data: dict[str, Any]) -> dict[str, Any]:
    """The issue's speed targets, met or not (only what was measured)."""
    out = {}
    if "dynamic" in data:
        out["dynamic_eval_10x_cpu"] = data["dynamic"]["speedup_vs_cpu"] >= 10
    if "scoring" in data:
        out["batch64_scoring_20x_cpu"] = data["scoring"]["batch64"]["device_fp32_vs_cpu"] >= 20
    if "generation" in data:
        out["graph_generation_3x_eager"] = data["generation"]["graphs_vs_eager"] >= 3
    return out


def table(data: dict[str, Any]) -> str:
    m = data["meta"]
    lines = [f"Device: {m['device']} (torch {m['torch']}, CUDA {m['cuda']}); CPU: {m.get('cpu', '?')}, "
             f"{m['cpu_threads']} thread(s), C++ loops "
             f"{'built' if all(m.get('cpu_loops', {}).values()) else 'NOT built (Python loops)'}; "
             f"fp32 with TF32 off unless marked bf16; {m['measured_at']}."
             + (" **--quick**: tiny sizes, the script's own check, not a measurement." if m["quick"] else "")
             + ("" if m.get("complete", True) else " **Partial**: the run stopped before its end."), ""]
    if "scoring" in data:
        s, g, d = data["scoring"], data.get("generation"), data.get("dynamic")
        lines += [f"Speed of `{data['speed_model']}` (device vs CPU):", "",
                  "| what | CPU | device | device / CPU |", "|---|---:|---:|---:|",
                  f"| scoring tokens/s, batch 1, CUDA graphs | {s['batch1']['cpu']['tokens_per_s']:.0f} | "
                  f"{s['batch1']['device_graphs']['tokens_per_s']:.0f} | {s['batch1']['device_graphs_vs_cpu']:.1f}x |",
                  f"| scoring tokens/s, batch 1, eager | | {s['batch1']['device_eager']['tokens_per_s']:.0f} | |",
                  f"| scoring tokens/s, batch 64, fp32 | {s['batch64']['cpu']['tokens_per_s']:.0f} | "
                  f"{s['batch64']['device_fp32']['tokens_per_s']:.0f} | {s['batch64']['device_fp32_vs_cpu']:.1f}x |",
                  f"| scoring tokens/s, batch 64, bf16 (ppl {s['batch64']['bf16_ppl_rel_diff']:.1e} rel. off) | | "
                  f"{s['batch64']['device_bf16']['tokens_per_s']:.0f} | {s['batch64']['device_bf16_vs_cpu']:.1f}x |"]
        if g:
            lines += [f"| generation ms/token, batch 1, eager | {g['cpu_ms']:.2f} | {g['device_eager_ms']:.2f} | |",
                      f"| generation ms/token, batch 1, CUDA graphs ({g['graphs_vs_eager']:.1f}x eager) | | "
                      f"{g['device_graphs_ms']:.2f} | {g['graphs_vs_cpu']:.1f}x |"]
        if d:
            lines.append(f"| dynamic evaluation, {d['tokens']:,} test tokens: seconds (CPU: from {d['cpu_tokens']:,} "
                         f"tokens) | {d['cpu_full_pass_s_estimate']:.0f} | {d['device_seconds']:.1f} | "
                         f"{d['speedup_vs_cpu']:.1f}x |")
            lines.append(f"| dynamic evaluation tokens/s (eager: the first {d['device_eager_tokens']:,} tokens) | "
                         f"{d['cpu_tokens_per_s']:.0f} | graphs {d['device_tokens_per_s']:.0f}, eager "
                         f"{d['device_eager_tokens_per_s']:.0f} | |")
        lines += ["", "Targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in targets(data).items()),
                  ""]
    lines += ["Equal numbers (device vs CPU, relative difference; tolerance 1e-5, dynamic evaluation 1e-4):", "",
              "| model | metric | test prefix | whole test split (CPU: card_reproduction.json) | greedy | ok |",
              "|---|---|---:|---:|---|---|"]
    for name, r in sorted(data.get("equality", {}).items()):
        test = f"{r['test_device']:.6g} vs {r['test_cpu']:.6g} ({r['test_rel_diff']:.1e})" if "test_rel_diff" in r \
            else r["test"]
        lines.append(f"| {name} | {r['metric']} | {r['prefix_rel_diff']:.1e} ({r['prefix_tokens']:,} tokens) | {test} "
                     f"| {'identical' if r['greedy_identical'] else 'different'} ({r['greedy_tokens']}) | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    if "dynamic" in data:
        d = data["dynamic"]
        lines.append(f"| {data['speed_model']} (dynamic) | perplexity | {d['prefix_rel_diff']:.1e} "
                     f"({d['cpu_tokens']:,} tokens) | device {d['device_ppl']:.4f} | | {'yes' if d['ok'] else 'NO'} |")
    for name, d in sorted(data.get("dynamic_equality", {}).items()):
        lines.append(f"| {name} (dynamic, graphs and eager) | perplexity | {d['rel_diff']:.1e} ({d['tokens']:,} "
                     f"tokens) | | | {'yes' if d['ok'] else 'NO'} |")
    return "\n".join(lines)


def save(data: dict[str, Any], args: argparse.Namespace, start: float, final: bool = False) -> None:
    """Write the JSON and its table: after each part (a device call killed at its limit still returns what was
    measured) and at the end, when a result in ``benchmarks/results`` also regenerates the READMEs."""
    from zoo.models._compiled import status

    data["targets"] = targets(data)
    data["meta"]["seconds"] = round(time.monotonic() - start, 1)
    data["meta"]["complete"] = final
    data["meta"]["cpu_loops"] = {k: bool(v.get("available")) for k, v in status().items()}
    out = Path(args.out)
    if final and out.resolve().parent == (REPO / "benchmarks" / "results").resolve():
        write_result(out, data, table(data))
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(table(data) + "\n", encoding="utf-8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="the device measured against the CPU (default cuda)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script end to end (any device)")
    ap.add_argument("--parts", default="speed,dynamic,equality", help="comma-separated: speed, dynamic, equality")
    ap.add_argument("--group", type=int, help="the models of GROUPS[N] only (what one device call carries)")
    ap.add_argument("--models", help="comma-separated model names (default: every bundled model, or --group's)")
    ap.add_argument("--models-dir", help="load NAME from DIR/NAME when there (the trip script's .devrun/models)")
    ap.add_argument("--merge", help="a previous result JSON whose parts this run adds to")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the cards' CPU numbers)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="no new whole-test-split evaluation starts past this many seconds (default 420)")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/gpu_inference.json; --quick: a temp file)")
    args = ap.parse_args(argv)
    args.prefix_tokens = 400 if args.quick else 3000
    args.greedy_tokens = 10 if args.quick else 50
    if args.group is not None and not 0 <= args.group < len(GROUPS):
        ap.error(f"--group must be 0 to {len(GROUPS) - 1}")
    args.dynamic_cpu_tokens = 100 if args.quick else 2000
    if args.out is None:
        args.out = "/tmp/gpu_inference-quick.json" if args.quick else "benchmarks/results/gpu_inference.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    device = resolve_device(args.device, "--device")
    torch.set_num_threads(args.threads)
    build_extensions()
    names = (args.models.split(",") if args.models else GROUPS[args.group] if args.group is not None
             else sorted(catalog()["models"]))
    if args.quick and not args.models:   # a stream model and a sentence-level one
        names = [catalog()["default"], "pnorm-gru-ptbchar-sent-p1"]
    parts = set(args.parts.split(","))
    data = json.loads(Path(args.merge).read_text()) if args.merge else {}
    data["meta"] = machine(args, device)
    default = catalog()["default"]
    if parts & {"speed", "dynamic"}:
        data["speed_model"] = default
    if "dynamic" in parts:   # (first: its device pass runs while the CPU's loops are still compiling)
        data["dynamic"] = dynamic_speed(default, args)
        print("dynamic", json.dumps(data["dynamic"]), flush=True)
        save(data, args, start)
        for name in DYNAMIC_EQUALITY:
            data.setdefault("dynamic_equality", {})[name] = dynamic_equality(name, args)
            save(data, args, start)
    if "speed" in parts:
        data["scoring"] = scoring_speed(default, args)
        data["generation"] = generation_speed(default, args)
        print("scoring", json.dumps(data["scoring"]), "\ngeneration", json.dumps(data["generation"]), flush=True)
        save(data, args, start)
    if "equality" in parts:
        eq = data.setdefault("equality", {})
        for name in names:
            eq[name] = equality(name, args, start + args.budget_s)
            save(data, args, start)
    save(data, args, start, final=True)
    print(f"done in {data['meta']['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
