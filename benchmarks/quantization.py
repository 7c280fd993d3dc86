"""Perplexity cost of int8 dynamic quantisation of the ONNX graphs, on a benchmark's test split.

The model is exported (float and int8 graphs, parity-checked), then the split is evaluated with the
standard stateful protocol (``ZooModel.evaluate``: batch 10, BPTT 70) on eager PyTorch, ONNX Runtime
float and ONNX Runtime int8. Reported: each perplexity, the int8 relative change against the float
graph (target: at most 1%), file sizes and evaluation times.

    python benchmarks/quantization.py                            # the catalogue default (bundled)
    python benchmarks/quantization.py --model runs/lstm-ptb-zaremba-small/best

Writes benchmarks/results/quantization.json and the markdown table next to it (quantization.md), then
regenerates the READMEs (``python -m zoo.tools.readme``: the ``quantization`` section of exports/README.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from zoo.backends import make_runner
from zoo.datasets import dataset_names
from zoo.export import export_model
from zoo.tools.readme import write_result
from zoo.zoo_model import ZooModel, load

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_REL_CHANGE = 0.01


def measure_int8_ppl(model: ZooModel, dataset: str = "ptb", split: str = "test", batch_size: int = 10,
                     bptt: int = 70, workdir: Path | None = None) -> dict[str, Any]:
    """Perplexity of ``split`` on eager, ONNX float and ONNX int8, and the int8 relative change."""
    with tempfile.TemporaryDirectory(prefix="zoo-quant-") as tmp:
        out = Path(workdir or tmp)
        manifests = export_model(model, out, formats=("onnx",), quantize="int8", verify=True)
        onnx_dir = out / "onnx"
        files = manifests["onnx"]["files"]
        sizes = {kind: (onnx_dir / fname).stat().st_size for kind, fname in files.items()}
        evals: dict[str, dict[str, Any]] = {}
        for backend in ("eager", "onnx", "onnx-int8"):
            runner = make_runner(model, backend, None if backend == "eager" else onnx_dir)
            view = ZooModel(model.lm, model.tokenizer, model.config, name=model.name, runner=runner, backend=backend)
            t0 = time.perf_counter()
            res = view.evaluate(dataset, split, batch_size=batch_size, bptt=bptt, progress=True)
            res["seconds"] = time.perf_counter() - t0
            evals[backend] = res
    ppl_fp, ppl_q = evals["onnx"]["ppl"], evals["onnx-int8"]["ppl"]
    rel = (ppl_q - ppl_fp) / ppl_fp
    return {
        "model": model.name, "architecture": model.lm.architecture, "num_parameters": model.num_parameters,
        "checkpoint_sha256": manifests["onnx"]["checkpoint_sha256"], "dataset": dataset, "split": split,
        "protocol": {"batch_size": batch_size, "bptt": bptt},
        "quantization": "onnxruntime quantize_dynamic, int8 weights (per channel), activations quantised at run time",
        "ppl": {b: e["ppl"] for b, e in evals.items()},
        "num_tokens": evals["eager"]["num_tokens"],
        "eval_seconds": {b: e["seconds"] for b, e in evals.items()},
        "int8_rel_ppl_change_vs_onnx_float": rel,
        "onnx_float_rel_ppl_diff_vs_eager": (ppl_fp - evals["eager"]["ppl"]) / evals["eager"]["ppl"],
        "target_max_rel_change": TARGET_REL_CHANGE, "target_met": abs(rel) <= TARGET_REL_CHANGE,
        "file_bytes": sizes, "parity": manifests["onnx"]["parity"],
    }


def markdown(r: dict[str, Any]) -> str:
    p, mb = r["ppl"], {k: v / 1e6 for k, v in r["file_bytes"].items()}
    return "\n".join([
        f"Model `{r['model']}` ({r['source']}, {r['num_parameters']:,} parameters), {r['dataset']}/{r['split']}, "
        f"batch {r['protocol']['batch_size']}, BPTT {r['protocol']['bptt']}, {r['num_tokens']:,} tokens; {r['date']}.",
        "",
        "| backend | perplexity | eval seconds | graph size (sequence) |",
        "|---|---:|---:|---:|",
        f"| eager | {p['eager']:.3f} | {r['eval_seconds']['eager']:.1f} | |",
        f"| onnx | {p['onnx']:.3f} | {r['eval_seconds']['onnx']:.1f} | {mb['sequence']:.1f} MB |",
        f"| onnx-int8 | {p['onnx-int8']:.3f} | {r['eval_seconds']['onnx-int8']:.1f} | {mb['sequence_int8']:.1f} MB |",
        "",
        f"int8 relative perplexity change vs the float graph: {100 * r['int8_rel_ppl_change_vs_onnx_float']:+.3f}% "
        f"(target: within {100 * r['target_max_rel_change']:.0f}%, {'met' if r['target_met'] else 'NOT met'}).",
        *([f"Note: {r['note']}"] if r.get("note") else []),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="catalogue name or checkpoint directory (default: default)")
    ap.add_argument("--dataset", default="ptb", choices=dataset_names())
    ap.add_argument("--split", default="test", choices=["train", "valid", "test"])
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--bptt", type=int, default=70)
    ap.add_argument("--out", default=str(RESULTS / "quantization.json"))
    ap.add_argument("--note", help="a remark stored with the result and printed under the table")
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    model = load(args.model)
    result = measure_int8_ppl(model, args.dataset, args.split, args.batch_size, args.bptt)
    result["source"] = model.source
    result["model_argument"] = args.model
    result["note"] = args.note
    result["date"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    p = result["ppl"]
    print(f"{result['model']} {args.dataset}/{args.split}: ppl eager {p['eager']:.3f}, onnx {p['onnx']:.3f}, "
          f"onnx int8 {p['onnx-int8']:.3f} -> int8 change {100 * result['int8_rel_ppl_change_vs_onnx_float']:+.3f}% "
          f"(target within {100 * TARGET_REL_CHANGE:.0f}%: {'met' if result['target_met'] else 'NOT met'})")
    write_result(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
