"""A corpus job's progress bar and its summary: the token-weighted corpus aggregate (as ``report.corpus``), the
per-record error counts, and what the run cost (time, tokens/s in all and per worker, the machine)."""

from __future__ import annotations

import os
import platform
import socket
import time
from collections import defaultdict
from typing import Any

from zoo.corpus.records import ERROR_KINDS
from zoo.scoring import COUNT_FIELDS, aggregate


class ProgressBar:
    """Documents done of the total (where it could be counted; the ETA comes from it), tokens and tokens/s."""

    def __init__(self, total: int | None, enabled: bool, initial: int = 0):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="doc", desc="scoring", disable=not enabled,
                        dynamic_ncols=True, smoothing=0.1)
        self.tokens = 0
        self.started = time.perf_counter()

    def update(self, docs: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(1e-9, time.perf_counter() - self.started)
        self.bar.set_postfix_str(f"{self.tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False)
        self.bar.update(docs)

    def close(self) -> None:
        self.bar.close()


def machine() -> dict[str, Any]:
    """What ran the job: this machine (for a cluster, the workers are listed by host in ``workers``)."""
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"host": socket.gethostname(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "load_average": list(os.getloadavg())}


def corpus_aggregate(all_stats: list[dict[str, Any]], tokenizer: Any) -> dict[str, Any]:
    """:func:`zoo.scoring.aggregate` over the shards' sums (shards in name order: the same float sums whatever
    engine or order ran them)."""
    ordered = sorted(all_stats, key=lambda s: s["shard"])
    pseudo = [{k: s[k] for k in ("nll", "num_tokens", *COUNT_FIELDS)}
              for s in ordered]
    corpus = aggregate(pseudo, sum(s["num_chars"] for s in ordered), tokenizer)
    corpus["num_texts"] = sum(s["scored"] for s in ordered)
    return corpus


def summarize_job(all_stats: list[dict[str, Any]], run_stats: list[dict[str, Any]], tokenizer: Any,
                  wall: float, engine: dict[str, Any]) -> dict[str, Any]:
    """The summary: every shard's counts (including those of earlier runs into the same folder) and this run's
    cost."""
    errors = dict.fromkeys(ERROR_KINDS, 0)
    for s in all_stats:
        for k, v in s["errors"].items():
            errors[k] += v
    per_worker: dict[str, dict[str, float]] = defaultdict(lambda: {"shards": 0, "docs": 0, "tokens": 0,
                                                                   "seconds": 0.0})
    for s in run_stats:
        w = per_worker[s["worker"]]
        w["shards"] += 1
        w["docs"] += s["docs"]
        w["tokens"] += s["num_tokens"]
        w["seconds"] += s["seconds"]
    for w in per_worker.values():
        w["tokens_per_s"] = w["tokens"] / w["seconds"] if w["seconds"] else None
    tokens = sum(s["num_tokens"] for s in run_stats)
    docs = sum(s["docs"] for s in run_stats)
    return {
        "documents": sum(s["docs"] for s in all_stats),
        "scored": sum(s["scored"] for s in all_stats),
        "errors": errors,
        "num_errors": sum(errors.values()),
        "shards": len(all_stats),
        "corpus": corpus_aggregate(all_stats, tokenizer) if all_stats else {},
        "run": {"shards_scored": len(run_stats), "shards_skipped": len(all_stats) - len(run_stats),
                "documents": docs, "tokens": tokens, "seconds": wall,
                "documents_per_s": docs / wall if wall else None, "tokens_per_s": tokens / wall if wall else None,
                "workers": dict(sorted(per_worker.items())), **engine},
        "machine": machine(),
    }
