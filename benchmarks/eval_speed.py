"""What the fused evaluation decoder buys: corpus evaluation through the logits against the targets' log-probabilities.

Scoring and validation need only each target's log-probability. Through the logits, the eager model decodes all
``[rows, vocab]`` float32 logits in one GEMM, then a log-softmax reads them again; the eager model's
``target_logprobs`` (``zoo.models._fused_loss.linear_target_logprobs``) decodes a block of the vocabulary at a
time into a buffer that stays in cache and folds it into a running log-sum-exp. This script times both on the
bundled models' validation split, interleaved in rounds on one thread (process CPU time, median of the per-round
ratios), for the two protocols the zoo evaluates with: validation during training (10 columns, BPTT 70) and a
card's test number (one column, BPTT 70). "Through the logits" is the same model behind a runner that only has
``forward`` (what an export's runner is); "library" is the eager model as shipped (fused from
``EVAL_MIN_LOGITS`` logits a call on), "fused always" the fused decoder at every size (why there is a threshold).
The perplexities of the paths are compared too.

Writes ``benchmarks/results/eval_speed.json`` and ``.md`` (and regenerates the README). Pause other work first
(``kill -STOP``): the script records what else ran.

    python benchmarks/eval_speed.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from precision import cpu_name, other_processes  # noqa: E402

import zoo  # noqa: E402
import zoo.lm as lm_mod  # noqa: E402
from zoo.data import load_corpus  # noqa: E402
from zoo.scoring import evaluate_stream  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHIPPED_MIN_LOGITS = lm_mod.EVAL_MIN_LOGITS
MODELS = ("lstm-wt2-11m-long", "alstm-wt2-11m-long-light", "alstm-ptb-5m-long-medium", "alstm-ptbchar-1.5m-long")
#: (protocol, columns, BPTT, chunks timed per round)
PROTOCOLS = (("validation", 10, 70, 8), ("test", 1, 70, 40))


class LogitsOnly:
    """The same model behind a runner with only ``init_state`` and ``forward``: scoring then goes through the
    logits and their float32 log-softmax."""

    def __init__(self, lm: torch.nn.Module) -> None:
        self.lm = lm

    def init_state(self, batch_size: int):
        return self.lm.init_state(batch_size)

    def forward(self, tokens, state):
        return self.lm(tokens, state)


def measure(name: str, rounds: int) -> list[dict]:
    model = zoo.load(name)
    lm = model.lm.eval()
    corpus = load_corpus(model.config["dataset"])
    valid = corpus.split("valid")
    rows = []
    for protocol, cols, bptt, chunks in PROTOCOLS:
        stream = valid[:cols * chunks * bptt + cols]     # `chunks` full BPTT chunks per column
        runners = {"logits": LogitsOnly(lm), "fused": lm}

        def run(which: str, runners=runners, stream=stream, cols=cols, bptt=bptt) -> tuple[float, float]:
            # "always": the fused decoder whatever the logits' size (the library fuses from EVAL_MIN_LOGITS on)
            lm_mod.EVAL_MIN_LOGITS = 0 if which == "always" else SHIPPED_MIN_LOGITS
            try:
                t0 = time.process_time()
                res = evaluate_stream(runners["logits" if which == "logits" else "fused"], stream, batch_size=cols,
                                      bptt=bptt, progress=False)
                return time.process_time() - t0, res["ppl"]
            finally:
                lm_mod.EVAL_MIN_LOGITS = SHIPPED_MIN_LOGITS

        variants = ("logits", "library", "always")
        ppl = {k: run(k)[1] for k in variants}           # warm-up
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(rounds):
            for k in (variants if r % 2 else variants[::-1]):
                times[k].append(run(k)[0])
        tokens = cols * chunks * bptt

        def ratio(k: str, times=times) -> float:
            return statistics.median(f / g for f, g in zip(times[k], times["logits"], strict=True))

        row = {"model": name, "architecture": lm.architecture, "vocab": lm.vocab_size, "protocol": protocol,
               "batch": cols, "bptt": bptt, "tokens": tokens, "logits_per_call": cols * bptt * lm.vocab_size,
               "fused_in_library": cols * bptt * lm.vocab_size >= SHIPPED_MIN_LOGITS,
               **{f"{k}_ms_per_1k_tokens": 1e6 * statistics.median(times[k]) / tokens for k in variants},
               "library_time_ratio": ratio("library"), "always_time_ratio": ratio("always"),
               "ppl_rel_diff": max(abs(ppl[k] / ppl["logits"] - 1) for k in ("library", "always")),
               "split_tokens": int(valid.numel())}
        for k in ("logits", "library"):
            row[f"split_seconds_{k}"] = row[f"{k}_ms_per_1k_tokens"] * row["split_tokens"] / 1e6
        print(f"{name} {protocol}: {row['logits_ms_per_1k_tokens']:.1f} ms per 1k tokens through the logits, "
              f"library {row['library_time_ratio']:.3f}x, fused always {row['always_time_ratio']:.3f}x; ppl differs "
              f"by {row['ppl_rel_diff']:.1e}", flush=True)
        rows.append(row)
    return rows


def table(result: dict) -> str:
    lines = [f"Measured on {result['cpu']}, one thread, process CPU time, {result['rounds']} interleaved rounds "
             f"(median of per-round ratios), the first chunks of each model's validation split; other busy processes "
             f"at the start (state T: paused during the run): {'; '.join(result['other_processes']) or 'none'}. "
             f"The library fuses from {result['eval_min_logits']:,} logits a call on; 'fused always' shows why not "
             "below.", "",
             "| model | vocabulary | protocol | logits a call | through the logits (ms / 1k tokens) | library | "
             "fused always | whole validation split, logits -> library (s) | largest perplexity difference |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| `{r['model']}` | {r['vocab']:,} | {r['protocol']} (batch {r['batch']}, BPTT {r['bptt']}) | "
                     f"{r['logits_per_call']:,}{'' if r['fused_in_library'] else ' (not fused)'} | "
                     f"{r['logits_ms_per_1k_tokens']:.1f} | {r['library_time_ratio']:.3f}x | "
                     f"{r['always_time_ratio']:.3f}x | {r['split_seconds_logits']:.0f} -> "
                     f"{r['split_seconds_library']:.0f} | {r['ppl_rel_diff']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--out", default=str(RESULTS / "eval_speed.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"cpu": cpu_name(), "threads": 1, "rounds": args.rounds, "other_processes": other_processes(),
              "load_avg_1min": os.getloadavg()[0], "eval_min_logits": SHIPPED_MIN_LOGITS, "rows": []}
    for name in args.models:
        result["rows"] += measure(name, args.rounds)
    from zoo.tools.readme import write_result
    write_result(args.out, result, table(result))


if __name__ == "__main__":
    main()
