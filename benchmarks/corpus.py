"""``zoo score-corpus`` throughput: documents/s and tokens/s for 1 and 2 workers, each worker's rate against the
model's own in-process batched rate, and KenLM beside it (what a CCNet-style pipeline would run instead).

The corpus is built from the WikiText-2 training split under ``$ZOO_DATA_DIR``: its articles (split at the
``= Title =`` headings) as documents, and its non-blank lines as short documents, the first ``--tokens`` words of
each, in 4 JSONL shards (so that 2 workers share the work). The model is a WikiText-2 model (default
``alstm-wt2-11m-long-light``).

* **in-process**: ``zoo.load(model).score(texts, batch_size=16)`` in this process, one torch thread, on each shard's
  texts (what a worker sorts and batches together) and on all of them at once: the model's own batched rate, which a
  worker should keep (goal: a worker at >= 0.9 of it);
* **score-corpus, 1 and 2 workers**: the whole job (process start, model load, reading, writing Parquet) by wall
  time, and each worker's own rate (tokens over the seconds its shards took); goal: 2 workers >= 1.8x one;
* **KenLM**: the ``kenlm`` package (``pip install kenlm``) querying a 3-gram model this script builds from the same
  training split (absolute discounting with back-off, trigrams seen once pruned, written as ARPA), one thread.
  Its perplexity here is on its own training text, as is the zoo model's: the numbers are speed, not quality.

Times are wall seconds on a machine that may be shared: the load average before and after is in the JSON; rerun on
a quiet machine before quoting the ratios.

    python benchmarks/corpus.py                 # about 40,000 words per corpus
    python benchmarks/corpus.py --tokens 5000 --out /tmp/corpus.json   # a quick run

Writes benchmarks/results/corpus.json and .md (the benchmarks page).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

import zoo
from zoo.corpus import score_corpus
from zoo.data import corpus_files
from zoo.tools.readme import write_result

HEADING = re.compile(r"^ = [^=].* = $")


def wikitext_corpora(max_words: int) -> dict[str, list[str]]:
    """The training split's articles and its lines, the first ``max_words`` words of each."""
    lines = corpus_files("wikitext-2")["train"].read_text(encoding="utf-8").splitlines()
    articles: list[list[str]] = []
    for line in lines:
        if HEADING.match(line) or not articles:
            articles.append([])
        if line.strip():
            articles[-1].append(line.strip())
    out: dict[str, list[str]] = {}
    for name, texts in (("documents", ["\n".join(a) for a in articles if a]),
                        ("lines", [line.strip() for line in lines if line.strip() and not HEADING.match(line)])):
        picked, words = [], 0
        for t in texts:
            if words >= max_words:
                break
            picked.append(t)
            words += len(t.split())
        out[name] = picked
    return out


def write_shards(texts: list[str], folder: Path, shards: int = 4) -> list[list[str]]:
    """``shards`` JSONL files of about equal characters (longest documents first, each to the lightest shard)."""
    folder.mkdir(parents=True)
    parts: list[list[int]] = [[] for _ in range(shards)]
    sizes = [0] * shards
    for i in sorted(range(len(texts)), key=lambda i: -len(texts[i])):
        k = sizes.index(min(sizes))
        parts[k].append(i)
        sizes[k] += len(texts[i])
    for k, part in enumerate(parts):
        with open(folder / f"part-{k}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": texts[i], "id": str(i)}) + "\n" for i in sorted(part))
    return [[texts[i] for i in sorted(part)] for part in parts]


def in_process(model: Any, texts: list[str], shards: list[list[str]]) -> dict[str, float]:
    """The model's own batched rate: ``model.score`` on each shard's texts (the documents a worker sorts and batches
    together), and on the whole corpus at once (one sort over every document: fuller batches of closer lengths)."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    n = sum(model.score(s, batch_size=16).corpus["num_tokens"] for s in shards)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = model.score(texts, batch_size=16)
    whole = time.perf_counter() - t0
    return {"seconds": wall, "tokens": n, "docs_per_s": len(texts) / wall, "tokens_per_s": n / wall,
            "whole_corpus_tokens_per_s": n / whole, "ppl": report.corpus["ppl"]}


def job(model_name: str, src: Path, out: Path, workers: int) -> dict[str, Any]:
    s = score_corpus(model_name, [str(src)], out, workers=workers, progress=False)
    r = s["run"]
    per_worker = [w["tokens_per_s"] for w in r["workers"].values()]
    return {"seconds": r["seconds"], "tokens": r["tokens"], "docs_per_s": r["documents_per_s"],
            "tokens_per_s": r["tokens_per_s"], "worker_tokens_per_s": sum(per_worker) / len(per_worker),
            "workers_tokens_per_s_sum": sum(per_worker),
            "ppl": s["corpus"]["ppl"]}


# -- KenLM ---------------------------------------------------------------------------------------------------
def build_arpa(lines: list[str], path: Path, discount: float = 0.75) -> dict[str, int]:
    """A 3-gram ARPA model: absolute discounting, back-off weights that make each context's distribution sum to 1,
    trigrams seen once left out (as ``lmplz --prune`` would)."""
    counts: list[Counter] = [Counter(), Counter(), Counter()]
    for line in lines:
        toks = ["<s>", *line.split(), "</s>"]
        for n in range(3):
            for i in range(len(toks) - n):
                counts[n][tuple(toks[i:i + n + 1])] += 1
    counts[2] = Counter({k: c for k, c in counts[2].items() if c > 1})
    total = sum(c for k, c in counts[0].items() if k != ("<s>",))
    vocab = [k for k in counts[0]] + [("<unk>",)]
    uni = {k: max(counts[0].get(k, 0) - discount, 0.0) / total for k in vocab}
    uni[("<unk>",)] = len(counts[0]) * discount / total
    uni[("<s>",)] = 0.0
    logp: list[dict[tuple, float]] = [{k: math.log10(v) if v > 0 else -99.0 for k, v in uni.items()}, {}, {}]
    lower = [uni, {}]
    backoff: list[dict[tuple, float]] = [{}, {}]
    for n in (1, 2):
        ctx_total: dict[tuple, int] = defaultdict(int)
        for k, c in counts[n].items():
            ctx_total[k[:-1]] += c
        seen_mass: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
        probs = {}
        for k, c in counts[n].items():
            p = (c - discount) / ctx_total[k[:-1]]
            probs[k] = p
            seen_mass[k[:-1]][0] += p
            seen_mass[k[:-1]][1] += lower[n - 1].get(k[1:], 0.0)
        for k, p in probs.items():
            logp[n][k] = math.log10(p)
        for ctx, (mass, low) in seen_mass.items():
            backoff[n - 1][ctx] = math.log10(max(1e-12, 1.0 - mass) / max(1e-12, 1.0 - low))
        if n == 1:
            lower.append(probs)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\\data\\\n" + "".join(f"ngram {n + 1}={len(logp[n])}\n" for n in range(3)) + "\n")
        for n in range(3):
            f.write(f"\\{n + 1}-grams:\n")
            for k, lp in logp[n].items():
                bo = backoff[n].get(k) if n < 2 else None
                f.write(f"{lp:.6f}\t{' '.join(k)}" + (f"\t{bo:.6f}" if bo is not None else "") + "\n")
            f.write("\n")
        f.write("\\end\\\n")
    return {f"{n + 1}-grams": len(logp[n]) for n in range(3)}


def kenlm_rates(arpa: Path, corpora: dict[str, list[str]]) -> dict[str, Any]:
    try:
        import kenlm
    except ImportError:
        return {"available": False, "note": "pip install kenlm to measure it"}
    t0 = time.perf_counter()
    model = kenlm.Model(str(arpa))
    out: dict[str, Any] = {"available": True, "load_seconds": time.perf_counter() - t0}
    for name, texts in corpora.items():
        t0 = time.perf_counter()
        nll10, tokens = 0.0, 0
        for text in texts:
            for line in text.split("\n"):  # (KenLM scores one sentence a call, as CCNet does per line)
                nll10 -= model.score(line, bos=True, eos=True)
                tokens += len(line.split()) + 1
        wall = time.perf_counter() - t0
        out[name] = {"seconds": wall, "tokens": tokens, "docs_per_s": len(texts) / wall, "tokens_per_s": tokens / wall,
                     "ppl": 10 ** (nll10 / tokens)}
    return out


def table(res: dict[str, Any]) -> str:
    rows = ["| corpus | engine | documents/s | tokens/s | vs 1 worker (wall) | vs 1 worker (workers' own rates) "
            "| worker / in-process | perplexity |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in ("documents", "lines"):
        c = res["corpora"][name]
        one = c["workers_1"]["tokens_per_s"]
        base = c["in_process"]
        rows.append(f"| {name} ({c['docs']:,} docs) | in-process `model.score`, shard by shard | "
                    f"{base['docs_per_s']:,.1f} | {base['tokens_per_s']:,.0f} | | | | {base['ppl']:.1f} |")
        rows.append(f"| {name} | in-process `model.score`, all at once | | {base['whole_corpus_tokens_per_s']:,.0f} "
                    "| | | | |")
        for w in (1, 2):
            r = c[f"workers_{w}"]
            rows.append(f"| {name} | score-corpus, {w} worker{'s' if w > 1 else ''} | {r['docs_per_s']:,.1f} | "
                        f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / one:.2f}x | "
                        f"{r['workers_tokens_per_s_sum'] / c['workers_1']['workers_tokens_per_s_sum']:.2f}x | "
                        f"{r['worker_tokens_per_s'] / c['in_process']['tokens_per_s']:.2f} | {r['ppl']:.1f} |")
        k = res["kenlm"].get(name)
        if k:
            rows.append(f"| {name} | KenLM 3-gram (1 thread) | {k['docs_per_s']:,.1f} | {k['tokens_per_s']:,.0f} | "
                        f"| | | {k['ppl']:.1f} |")
    load = res["load_average_before"][0], res["load_average_after"][0]
    busy = " (a shared machine: rerun quiet)" if max(load) > 1.5 else ""
    rows.append(f"\nModel `{res['model']}`, {res['machine']['cores']} cores ({res['machine']['cpu']}); load average "
                f"{load[0]:.1f} before, {load[1]:.1f} after{busy}."
                " tokens/s counts each engine's own tokens (KenLM: words + `</s>`); score-corpus's by wall time of "
                "the whole job (worker start-up and model loads included). \"workers' own rates\": the workers' "
                "tokens/s over the seconds their shards took, added. \"worker / in-process\": a worker's tokens/s "
                "over the model's own batched rate in one process on the same shards (all at once, one sort over every "
                "document gives fuller batches of closer lengths: `worker_vs_in_process_whole_corpus` in the JSON).")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="alstm-wt2-11m-long-light")
    ap.add_argument("--tokens", type=int, default=40_000, help="words per corpus (default 40,000)")
    ap.add_argument("--out", default="benchmarks/results/corpus.json")
    args = ap.parse_args()
    from zoo.corpus.summary import machine

    res: dict[str, Any] = {"model": args.model, "words_per_corpus": args.tokens, "machine": machine(),
                           "load_average_before": list(os.getloadavg()), "corpora": {}}
    corpora = wikitext_corpora(args.tokens)
    model = zoo.load(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        for name, texts in corpora.items():
            src = Path(tmp) / name
            c: dict[str, Any] = {"docs": len(texts), "in_process": in_process(model, texts, write_shards(texts, src))}
            for w in (1, 2):
                c[f"workers_{w}"] = job(args.model, src, Path(tmp) / f"{name}-out-{w}", w)
            c["speedup_2_workers"] = c["workers_2"]["tokens_per_s"] / c["workers_1"]["tokens_per_s"]
            # (without the start-up: the workers' own rates added, against one worker's)
            c["speedup_2_workers_steady"] = (c["workers_2"]["workers_tokens_per_s_sum"]
                                             / c["workers_1"]["workers_tokens_per_s_sum"])
            c["worker_vs_in_process"] = c["workers_1"]["worker_tokens_per_s"] / c["in_process"]["tokens_per_s"]
            c["worker_vs_in_process_whole_corpus"] = (c["workers_1"]["worker_tokens_per_s"]
                                                      / c["in_process"]["whole_corpus_tokens_per_s"])
            res["corpora"][name] = c
            print(name, json.dumps(c))
        arpa = Path(tmp) / "wt2-3gram.arpa"
        train = [line.strip() for line in corpus_files("wikitext-2")["train"].read_text(encoding="utf-8").splitlines()
                 if line.strip()]
        t0 = time.perf_counter()
        res["kenlm_model"] = {**build_arpa(train, arpa), "build_seconds": time.perf_counter() - t0,
                              "arpa_bytes": arpa.stat().st_size}
        res["kenlm"] = kenlm_rates(arpa, corpora)
    res["load_average_after"] = list(os.getloadavg())
    write_result(args.out, res, table(res))


if __name__ == "__main__":
    main()
