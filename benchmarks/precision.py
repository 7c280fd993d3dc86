"""Training speed in fp32 and bf16 (``zoo.precision``), the two-core layout, and bf16 inference, in one run.

Sections (all measured by this script, in this order, on this machine):

1. **GEMM probe**: ``torch.mm`` in fp32 and bf16 at the shapes the models run (a recurrent GEMM per step at
   batch 20, the decoder over a BPTT segment). What the CPU's bf16 kernels can give bounds everything below.
2. **Training**: every architecture (LSTM, aLSTM, HyperLSTM, p-norm GRU) at hidden 200 and 650 (the
   ``benchmarks/cells.py`` models: vocabulary 10k, tied, 2 layers, batch 20, BPTT 35) and at the PTB-tier sizes
   (the ``*-ptb-5m-light`` / ``pnorm-gru-ptb-5m-p1`` recipes' models: batch 20, BPTT 70), each in fp32 and bf16:
   forward + backward + clipping + Adam, dropout on, the trainer's loss path (decoder fused with the loss). Adam
   is torch's default (the trainer's is fused on the CPU, ``benchmarks/fused_loss.py``): both precisions pay the same.
   Interleaved rounds, process CPU time, one thread; the
   speed-up is the median over rounds of ``time(fp32) / time(bf16)`` within a round. A profile of the aLSTM's
   step at hidden 650 in both precisions shows where the time goes.
3. **Two cores** (``--layout``): the PTB-tier aLSTM and LSTM recipes on real PTB batches, as two one-thread
   processes side by side against one two-thread process at a time (wall clock, tokens/s per run and in total).
4. **Inference** (``--inference``): the default model scores the PTB test split (batch 1, the card's protocol)
   in fp32 and bf16: perplexity, its relative change, tokens/s; and generation speed (B=1 steps).

Writes ``benchmarks/results/precision.json`` (the training records, a list of
``{"model", "hidden", "precision", "train_tokens_per_s", "threads", ...}``), ``precision_context.json``
(machine, load, GEMM probe, profile, layout, inference) and ``precision.md``, then regenerates the README.
Stop or pause other work first (``kill -STOP``): the script records the load average and what else ran.

    python benchmarks/precision.py --layout --inference
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cells import VOCAB, arch_specs  # noqa: E402

from zoo.lm import LanguageModel  # noqa: E402
from zoo.precision import autocast  # noqa: E402
from zoo.training import Recipe, recipe_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = ("fp32", "bf16")
#: The PTB-tier recipe of each architecture (its model and batch shape are what "tier" rows time).
TIER_RECIPES = {"lstm": "lstm-ptb-5m-light", "alstm": "alstm-ptb-5m-light", "hyperlstm": "hyperlstm-ptb-5m-light",
                "pnorm_gru": "pnorm-gru-ptb-5m-p1"}
#: Targets of the training-compute issue: (what, value, at least / at most).
TARGETS = [("alstm bf16 speed-up, hidden 650", ("alstm", "650"), 1.8, "min"),
           ("alstm bf16 speed-up, PTB-tier size", ("alstm", "tier"), 1.5, "min"),
           ("aLSTM / LSTM time per token, both bf16, hidden 650", ("ratio", "650"), 1.6, "max")]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f.startswith(("avx512_bf16", "amx", "avx512_fp16")))


def other_processes() -> list[str]:
    """Other busy processes (over 5% CPU) while the benchmark starts: the numbers' context."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,stat,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()[1:]
    except (OSError, subprocess.SubprocessError):
        return []
    me = os.getpid()
    rows = []
    for line in out:
        pid, stat, pcpu, args = line.split(None, 3)
        if int(pid) != me and float(pcpu) > 5.0:
            rows.append(f"{pid} {stat} {pcpu}% {args[:100]}")
    return rows[:8]


# -- 1. GEMM probe ---------------------------------------------------------------------------------------------
def gemm_probe(reps: int = 5) -> list[dict]:
    shapes = [("recurrent step, hidden 200", 20, 200, 800), ("recurrent step, hidden 390", 20, 390, 1560),
              ("recurrent step, hidden 650", 20, 650, 2600), ("hoisted input, hidden 650", 700, 650, 2600),
              ("decoder, hidden 650", 700, 650, VOCAB), ("decoder, PTB tier", 1400, 256, VOCAB)]
    rows = []
    for what, m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(n, k)
        times = {}
        for prec, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            aa, bb = a.to(dt), b.to(dt)
            calls = max(3, int(2e8 // (m * k * n)))
            torch.mm(aa, bb.t())
            best = float("inf")
            for _ in range(reps):
                t0 = time.process_time()
                for _ in range(calls):
                    torch.mm(aa, bb.t())
                best = min(best, (time.process_time() - t0) / calls)
            times[prec] = best
        rows.append({"gemm": what, "shape": [m, k, n], "fp32_ms": times["fp32"] * 1e3, "bf16_ms": times["bf16"] * 1e3,
                     "bf16_speedup": times["fp32"] / times["bf16"],
                     "fp32_gflops": 2 * m * k * n / times["fp32"] / 1e9})
    return rows


# -- 2. training ------------------------------------------------------------------------------------------------
class Subject:
    """One model in one precision, with its optimiser and carried state (one per row)."""

    def __init__(self, arch: str, lm_kwargs: dict, precision: str, batch: int, bptt: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.lm = LanguageModel(**lm_kwargs).train()
        self.opt = torch.optim.Adam(self.lm.parameters(), lr=1e-3)
        self.arch, self.precision, self.batch, self.bptt = arch, precision, batch, bptt
        self.state = None

    def step(self, tokens: torch.Tensor, fused: bool = True) -> None:
        if self.state is not None:
            self.state = tuple(s.detach() for s in self.state)
        with autocast(self.precision, "cpu"):
            if fused:   # the trainer's step: decoder fused with the loss
                loss, _, _, self.state = self.lm.training_loss(tokens[:, :-1], tokens[:, 1:], self.state)
            else:       # decode the whole segment, then cross_entropy (the unfused path)
                logits, _, _, self.state = self.lm.forward_hidden(tokens[:, :-1], self.state)
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                         tokens[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.lm.parameters(), 5.0)
        self.opt.step()


def size_configs(size: str) -> list[tuple[str, dict, int, int, int]]:
    """``(architecture, LanguageModel kwargs, hidden, batch, bptt)`` of every architecture at ``size``."""
    if size == "tier":
        out = []
        for arch, name in TIER_RECIPES.items():
            r = Recipe.load(recipe_path(name))
            kw = dict(r.model, vocab_size=VOCAB)
            out.append((arch, kw, int(r.model["arch_args"]["hidden_size"]), r.train.batch_size, r.train.bptt))
        return out
    hidden = int(size)
    out = []
    for name, arch, args in arch_specs(hidden):
        if name == "alstm-nowrap":
            continue
        kw = dict(vocab_size=VOCAB, architecture=arch, arch_args=dict(args, hidden_size=hidden, num_layers=2),
                  emb_size=hidden, dropoute=0.1, dropouti=0.4, dropouto=0.4)
        out.append((arch, kw, hidden, 20, 35))
    return out


def train_rows(sizes: list[str], rounds: int, threads: int) -> tuple[list[dict], dict]:
    records: list[dict] = []
    times: dict[tuple[str, str, str], list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    subjects: dict[tuple[str, str], list[Subject]] = {}
    for size in sizes:
        for arch, kw, _hidden, batch, bptt in size_configs(size):
            subs = [Subject(arch, kw, p, batch, bptt) for p in PRECISIONS]
            subjects[(size, arch)] = subs
            x = torch.randint(0, VOCAB, (batch, bptt + 1), generator=gen)
            for s in subs:   # warm-up: allocator, oneDNN kernel creation
                s.step(x)
                s.step(x)
    for r in tqdm(range(rounds), desc="training rounds", unit="round"):
        for (size, arch), subs in subjects.items():
            x = torch.randint(0, VOCAB, (subs[0].batch, subs[0].bptt + 1), generator=gen)
            order = subs if r % 2 == 0 else subs[::-1]
            for s in order:
                t0 = time.process_time()
                s.step(x)
                times.setdefault((size, arch, s.precision), []).append(time.process_time() - t0)
    for (size, arch), subs in subjects.items():
        for s in subs:
            ts = times[(size, arch, s.precision)]
            fp = times[(size, arch, "fp32")]
            records.append({
                "model": arch, "size": size, "hidden": int(s.lm.config["arch_args"]["hidden_size"]),
                "precision": s.precision, "threads": threads, "batch": s.batch, "bptt": s.bptt,
                "num_parameters": s.lm.num_parameters(),
                "train_tokens_per_s": s.batch * s.bptt / statistics.median(ts),
                "speedup_vs_fp32": statistics.median(a / b for a, b in zip(fp, ts, strict=True)),
                "speedup_min": min(a / b for a, b in zip(fp, ts, strict=True)),
                "speedup_max": max(a / b for a, b in zip(fp, ts, strict=True)),
                "seconds": ts})
    return records, profile_alstm(subjects.get(("650", "alstm")))


def profile_alstm(subs: list[Subject] | None) -> dict:
    """Self CPU time by op of one aLSTM train step at hidden 650, per precision: where the time goes."""
    if not subs:
        return {}
    from torch.profiler import ProfilerActivity, profile

    matmul = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
    out = {}
    x = torch.randint(0, VOCAB, (subs[0].batch, subs[0].bptt + 1), generator=torch.Generator().manual_seed(1))
    for s in subs:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            s.step(x)
        rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
        total = sum(t for _, t in rows) or 1.0
        mm = sum(t for k, t in rows if k in matmul)
        cast = sum(t for k, t in rows if k in ("aten::copy_", "aten::_to_copy", "aten::to"))
        top = sorted(rows, key=lambda r: -r[1])[:5]
        out[s.precision] = {"total_ms": total / 1e3, "matmul_ms": mm / 1e3, "matmul_share": mm / total,
                            "cast_copy_share": cast / total,
                            "top_ops": [{"op": k, "ms": t / 1e3, "share": t / total} for k, t in top]}
    return out


def loss_path_rows(rounds: int) -> list[dict]:
    """fp32 training step of the PTB-tier aLSTM and LSTM with the fused decoder + loss against decode-then-
    cross_entropy, interleaved (what zoo.models._fused_loss buys)."""
    gen = torch.Generator().manual_seed(2)
    rows = []
    for arch, kw, hidden, batch, bptt in size_configs("tier"):
        if arch not in ("alstm", "lstm"):
            continue
        s = Subject(arch, kw, "fp32", batch, bptt)
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds + 1):
            x = torch.randint(0, VOCAB, (batch, bptt + 1), generator=gen)
            for fused in ((True, False) if r % 2 else (False, True)):
                t0 = time.process_time()
                s.step(x, fused)
                if r:   # round 0: warm-up
                    times[fused].append(time.process_time() - t0)
        rows.append({"model": arch, "hidden": hidden,
                     "fused_tokens_per_s": batch * bptt / statistics.median(times[True]),
                     "unfused_tokens_per_s": batch * bptt / statistics.median(times[False]),
                     "speedup": statistics.median(a / b for a, b in zip(times[False], times[True], strict=True))})
    return rows


# -- 3. two cores -------------------------------------------------------------------------------------------------
WORKER = """
import json, sys, time, torch
from zoo.training import Recipe, Trainer, recipe_path
name, steps = sys.argv[1], int(sys.argv[2])
r = Recipe.load(recipe_path(name))
t = Trainer(r, "/tmp/zoo-precision-layout-unused", progress=False, device="cpu")
b, d = r.train.bptt, t.train_data
for i in range(2):
    t.train_step(d[i * b:(i + 1) * b].t(), d[i * b + 1:(i + 1) * b + 1].t(), b)
t0 = time.perf_counter()
for i in range(2, 2 + steps):
    t.train_step(d[i * b:(i + 1) * b].t(), d[i * b + 1:(i + 1) * b + 1].t(), b)
secs = time.perf_counter() - t0
print(json.dumps({"recipe": name, "threads": torch.get_num_threads(), "seconds": secs,
                  "tokens_per_s": steps * b * r.train.batch_size / secs}))
"""


def _workers(names: list[str], steps: int, threads: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, n, str(steps)], stdout=subprocess.PIPE, text=True,
                              env=env) for n in names]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"layout worker failed (exit {p.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def layout(steps: int) -> dict:
    names = [TIER_RECIPES["alstm"], TIER_RECIPES["lstm"]]
    cores = os.cpu_count() or 1
    side = _workers(names, steps, 1)                          # A: both at once, one thread each
    alone = [_workers([n], steps, cores)[0] for n in names]   # B: one at a time, every core
    total_a = sum(r["tokens_per_s"] for r in side)
    # B runs the same work one after the other: total tokens / total time
    tokens = [r["tokens_per_s"] * r["seconds"] for r in alone]
    total_b = sum(tokens) / sum(r["seconds"] for r in alone)
    # A also runs both to the end: the faster one finishes first, then its core idles (the layout `--jobs 2` gives)
    return {"cores": cores, "steps": steps, "side_by_side_1_thread": side, "one_at_a_time_all_threads": alone,
            "total_tokens_per_s": {"side_by_side": total_a, "one_at_a_time": total_b},
            "better": "side_by_side" if total_a >= total_b else "one_at_a_time"}


# -- 4. inference -----------------------------------------------------------------------------------------------
def inference(limit_tokens: int | None) -> dict:
    import zoo
    from zoo.data import load_corpus

    out: dict = {}
    corpus = load_corpus("ptb")
    stream = corpus.test if not limit_tokens else corpus.test[:limit_tokens]
    for prec in PRECISIONS:
        model = zoo.load("default", precision=prec)
        from zoo.scoring import evaluate_stream

        t0 = time.perf_counter()
        res = evaluate_stream(model.runner, stream, batch_size=1, bptt=70, progress=False)
        secs = time.perf_counter() - t0
        t1 = time.perf_counter()
        ids = model.generate_ids("the company said", max_new_tokens=200, seed=0, temperature=1.0)
        gen_secs = time.perf_counter() - t1
        out[prec] = {"model": model.name, "ppl": res["ppl"], "tokens": res["num_tokens"], "seconds": secs,
                     "score_tokens_per_s": res["num_tokens"] / secs, "generated": len(ids),
                     "generate_tokens_per_s": len(ids) / gen_secs}
    out["ppl_change"] = out["bf16"]["ppl"] / out["fp32"]["ppl"] - 1
    out["score_speedup"] = out["bf16"]["score_tokens_per_s"] / out["fp32"]["score_tokens_per_s"]
    out["generate_speedup"] = out["bf16"]["generate_tokens_per_s"] / out["fp32"]["generate_tokens_per_s"]
    out["split"] = "test" if not limit_tokens else f"first {limit_tokens} test tokens"
    return out


# -- report -----------------------------------------------------------------------------------------------------
def target_rows(records: list[dict]) -> list[tuple[str, float, float, str, bool]]:
    by = {(r["model"], r["size"], r["precision"]): r for r in records}
    out = []
    for what, (model, size), limit, kind in TARGETS:
        if model == "ratio":
            a, b = by.get(("alstm", size, "bf16")), by.get(("lstm", size, "bf16"))
            if not (a and b):
                continue
            value = b["train_tokens_per_s"] / a["train_tokens_per_s"]
        else:
            r = by.get((model, size, "bf16"))
            if not r:
                continue
            value = r["speedup_vs_fp32"]
        ok = value >= limit if kind == "min" else value <= limit
        out.append((what, value, limit, kind, ok))
    return out


def markdown(records: list[dict], ctx: dict) -> str:
    m = ctx["meta"]
    lines = [f"CPU: {m['cpu']} ({', '.join(m['cpu_flags']) or 'no bf16/AMX flags'}), torch {m['torch']}, "
             f"{m['threads']} thread, process CPU time, {m['rounds']} interleaved rounds. Load average "
             f"{m['loadavg_start']:.2f} -> {m['loadavg_end']:.2f}; other busy processes at the start: "
             f"{'; '.join(m['other_processes']) or 'none'}.", ""]
    lines += ["**GEMMs alone** (`torch.mm`, best of 5):", "",
              "| GEMM | shape (m, k, n) | fp32 ms | bf16 ms | bf16 speed-up |", "|---|---|---:|---:|---:|"]
    for g in ctx["gemm"]:
        lines.append(f"| {g['gemm']} | {tuple(g['shape'])} | {g['fp32_ms']:.3f} | {g['bf16_ms']:.3f} | "
                     f"{g['bf16_speedup']:.2f}x |")
    lines += ["", "**Training** (forward + backward + clip + Adam; tokens/s, median of rounds; speed-up = median "
              "of per-round fp32 time / bf16 time):", "",
              "| size | model | hidden | params | fp32 tok/s | bf16 tok/s | bf16 speed-up (min-max) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    by = {(r["model"], r["size"], r["precision"]): r for r in records}
    for r in records:
        if r["precision"] != "fp32":
            continue
        b = by[(r["model"], r["size"], "bf16")]
        size = "PTB tier" if r["size"] == "tier" else f"{r['size']}"
        lines.append(f"| {size} | {r['model']} | {r['hidden']} | {r['num_parameters'] / 1e6:.2f}M | "
                     f"{r['train_tokens_per_s']:,.0f} | {b['train_tokens_per_s']:,.0f} | {b['speedup_vs_fp32']:.2f}x "
                     f"({b['speedup_min']:.2f}-{b['speedup_max']:.2f}) |")
    lines += ["", "| target | measured | result |", "|---|---:|---|"]
    for what, value, limit, kind, ok in target_rows(records):
        lines.append(f"| {what} {'>=' if kind == 'min' else '<='} {limit}x | {value:.2f}x | "
                     f"{'met' if ok else '**not met**'} |")
    prof = ctx.get("profile") or {}
    if prof:
        lines += ["", "Where an aLSTM training step at hidden 650 spends its time (torch.profiler, self CPU time):", "",
                  "| precision | step ms | GEMM ms | GEMM share | cast/copy share | top ops |",
                  "|---|---:|---:|---:|---:|---|"]
        for prec, p in prof.items():
            top = ", ".join(f"{o['op']} {o['share']:.0%}" for o in p["top_ops"][:4])
            lines.append(f"| {prec} | {p['total_ms']:.0f} | {p['matmul_ms']:.0f} | {p['matmul_share']:.0%} | "
                         f"{p['cast_copy_share']:.0%} | {top} |")
    lp = ctx.get("loss_path")
    if lp:
        lines += ["", "**The fused decoder + loss** (`zoo.models._fused_loss`, fp32, PTB-tier models, interleaved):",
                  "",
                  "| model | decode then cross_entropy tok/s | fused tok/s | speed-up |", "|---|---:|---:|---:|"]
        for r in lp:
            lines.append(f"| {r['model']} | {r['unfused_tokens_per_s']:,.0f} | {r['fused_tokens_per_s']:,.0f} | "
                         f"{r['speedup']:.2f}x |")
    bound = ctx.get("bound")
    if bound:
        lines += ["", bound]
    lay = ctx.get("layout")
    if lay:
        lines += ["", f"**Two cores** ({lay['cores']} cores; the PTB-tier aLSTM and LSTM recipes, {lay['steps']} steps "
                  "each on real PTB batches, wall clock):", "",
                  "| layout | aLSTM tok/s | LSTM tok/s | total tok/s |", "|---|---:|---:|---:|"]
        s, a = lay["side_by_side_1_thread"], lay["one_at_a_time_all_threads"]
        tot = lay["total_tokens_per_s"]
        lines.append(f"| side by side, 1 thread each | {s[0]['tokens_per_s']:,.0f} | {s[1]['tokens_per_s']:,.0f} | "
                     f"{tot['side_by_side']:,.0f} |")
        lines.append(f"| one at a time, {lay['cores']} threads | {a[0]['tokens_per_s']:,.0f} | "
                     f"{a[1]['tokens_per_s']:,.0f} | {tot['one_at_a_time']:,.0f} |")
        lines += ["", f"Better: **{lay['better'].replace('_', ' ')}** "
                  f"({max(tot.values()) / min(tot.values()):.2f}x the total); `zoo train A B --jobs 2` runs that way."]
    inf = ctx.get("inference")
    if inf:
        f, b = inf["fp32"], inf["bf16"]
        lines += ["", f"**Inference** (`{f['model']}`, PTB {inf['split']}, batch 1, eager):", "",
                  "| precision | test ppl | score tok/s | generate tok/s |", "|---|---:|---:|---:|",
                  f"| fp32 | {f['ppl']:.3f} | {f['score_tokens_per_s']:,.0f} | {f['generate_tokens_per_s']:,.0f} |",
                  f"| bf16 | {b['ppl']:.3f} | {b['score_tokens_per_s']:,.0f} | {b['generate_tokens_per_s']:,.0f} |",
                  "", f"bf16 changes the test perplexity by {inf['ppl_change']:+.3%}; scoring runs at "
                  f"{inf['score_speedup']:.2f}x and generation at {inf['generate_speedup']:.2f}x fp32's speed "
                  "(fp32 scoring uses the compiled C++ loop; bf16 the Python loop)."]
    return "\n".join(lines) + "\n"


def bound_text(gemm: list[dict], records: list[dict], prof: dict | None = None) -> str:
    """What bounds the bf16 speed-up where a target is missed, from this run's own numbers.

    Two cases: the CPU's bf16 GEMMs are slower than fp32 (no bf16 dot-product unit exposed: nothing outside the
    kernels can help), or they are faster and Amdahl's law caps the step at ``1 / ((1 - s) + s / g)`` for GEMM
    share ``s`` (the fp32 profile) and GEMM speed-up ``g`` (the probe): the rest of the step (element-wise cell
    arithmetic, casts, the optimiser) does not get faster in bf16.
    """
    sp = [g["bf16_speedup"] for g in gemm]
    misses = [t for t in target_rows(records) if not t[4]]
    if not misses:
        return ""
    if max(sp) < 1.0:
        return (f"What bounds it: on this CPU a bf16 GEMM runs at {min(sp):.2f}x to {max(sp):.2f}x the speed of "
                "the same fp32 GEMM (table above), and GEMMs are most of a training step (profile). No change "
                "outside the kernels can make the step faster than its GEMMs allow: bf16 training can only win "
                "where the CPU's bf16 kernels beat fp32 (AVX512-BF16 dot products at twice the fp32 FMA rate, as "
                "on AMD Zen 4, or Intel AMX).")
    text = (f"What bounds it: on this CPU a bf16 GEMM runs at {min(sp):.2f}x to {max(sp):.2f}x the speed of the "
            "same fp32 GEMM (table above), but only the GEMMs get faster.")
    p32 = (prof or {}).get("fp32")
    if p32:
        s = p32["matmul_share"]
        g650 = [g["bf16_speedup"] for g in gemm if "650" in g["gemm"]]
        g = statistics.median(g650 or sp)
        cap = 1.0 / ((1.0 - s) + s / g)
        text += (f" In the fp32 profile of the aLSTM step at hidden 650, GEMMs are {s:.0%} of the time; with the "
                 f"hidden-650 GEMMs' median speed-up of {g:.2f}x, Amdahl's law caps the step at {cap:.2f}x, before "
                 "the casts bf16 adds (the bf16 profile's cast/copy share). The rest (element-wise cell "
                 "arithmetic, dropout masks, clipping, Adam) runs at fp32 speed by design: the cell state, "
                 "the loss and the optimiser stay fp32.")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["200", "650", "tier"], help="hidden sizes and/or 'tier'")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layout", action="store_true", help="also measure the two-core layouts")
    ap.add_argument("--layout-steps", type=int, default=15)
    ap.add_argument("--inference", action="store_true", help="also measure bf16 scoring / generation")
    ap.add_argument("--inference-tokens", type=int, default=0, help="score only this many test tokens (0: all)")
    ap.add_argument("--out", default=str(RESULTS / "precision.json"))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be positive")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    meta = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "torch": torch.__version__, "threads": 1,
            "rounds": args.rounds, "loadavg_start": os.getloadavg()[0], "other_processes": other_processes(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print("GEMM probe ...", flush=True)
    gemm = gemm_probe()
    records, prof = train_rows(args.sizes, args.rounds, 1)
    ctx: dict = {"meta": meta, "gemm": gemm, "profile": prof, "bound": bound_text(gemm, records, prof),
                 "loss_path": loss_path_rows(args.rounds) if "tier" in args.sizes else []}
    if args.layout:
        print("two-core layouts ...", flush=True)
        ctx["layout"] = layout(args.layout_steps)
    if args.inference:
        print("inference ...", flush=True)
        torch.set_num_threads(1)
        ctx["inference"] = inference(args.inference_tokens or None)
    meta["loadavg_end"] = os.getloadavg()[0]
    table = markdown(records, ctx)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.stem + "_context.json").write_text(json.dumps(ctx, indent=2) + "\n")
    from zoo.tools.readme import write_result

    write_result(out, records, table)


if __name__ == "__main__":
    main()
