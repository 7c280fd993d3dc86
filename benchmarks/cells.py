"""CPU speed of the recurrent cells against the fused LSTM, measured in one run.

For each hidden size, every architecture is wrapped in the same tied language model (vocabulary 10k,
embedding = hidden size, 2 layers, batch 20, BPTT 35) and timed on:

* training: forward + backward + gradient clipping + Adam step, in training mode with dropout on;
* inference: scoring (eval mode, no grad: forward, log-softmax, gather of the targets) with batch 1
  and batch 8, BPTT-long chunks with the state carried.

The baseline ``lstm`` is the zoo's LSTM stack, i.e. ``torch.lstm``, the fused op behind ``nn.LSTM``.
Adaptive models run their fast sequence path (the default); ``[reference]`` rows time the plain
``step_with_masks`` loop of the same model (``zoo.models.base.reference_cells``) for comparison.

The CPU is shared, so absolute numbers drift: measurements are interleaved (each round times every
model once, in rotating order) and every ratio is the median over rounds of ``time(model) / time(lstm)``
taken within the same round; the table also gives the spread (min-max over rounds). One intra-op
thread by default (``--threads``) for stable numbers.

    python benchmarks/cells.py                  # writes benchmarks/results/cells.{json,md}
    python benchmarks/cells.py --hidden 200 --rounds 3 --no-reference
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from zoo.lm import LanguageModel
from zoo.models import _compiled as compiled
from zoo.models.base import reference_cells

VOCAB, BATCH, BPTT, LAYERS = 10_000, 20, 35, 2
RESULTS = Path(__file__).resolve().parent / "results"


def arch_specs(hidden: int) -> list[tuple[str, str, dict]]:
    """``(row name, architecture, arch_args)``. Adaptation sizes follow the zoo recipes' proportions."""
    adapt = 50 if hidden < 400 else 100
    hyper = 64 if hidden < 400 else 128
    return [
        ("lstm", "lstm", {"dropout_hidden": 0.25}),
        ("alstm", "alstm", {"adapt_size": adapt, "dropout_hidden": 0.2, "dropout_adapt": 0.1}),
        ("alstm-nowrap", "alstm", {"adapt_size": adapt, "dropout_hidden": 0.2, "dropout_adapt": 0.1,
                                   "layer0_wraparound": False}),
        ("hyperlstm", "hyperlstm", {"hyper_size": hyper, "hyper_embedding_size": 8, "recurrent_dropout": 0.1,
                                    "dropout_hidden": 0.2}),
        ("pnorm_gru", "pnorm_gru", {"p": 2.0, "dropout_hidden": 0.2}),
    ]


class Subject:
    """One timed configuration: a model plus the path (fast / reference) it runs on."""

    def __init__(self, name: str, arch: str, args: dict, hidden: int, reference: bool, seed: int = 0,
                 python_loop: bool = False) -> None:
        torch.manual_seed(seed)
        self.name = name + (" [reference]" if reference else "") + (" [python loop]" if python_loop else "")
        self.arch, self.reference, self.python_loop = arch, reference, python_loop
        self.lm = LanguageModel(VOCAB, arch, dict(args, hidden_size=hidden, num_layers=LAYERS), emb_size=hidden,
                                dropoute=0.1, dropouti=0.4, dropouto=0.4)
        self.opt = torch.optim.Adam(self.lm.parameters(), lr=1e-3)
        self.state: tuple | None = None
        self.num_parameters = self.lm.num_parameters()
        self.macs_per_token = macs_per_token(self.lm)

    @contextlib.contextmanager
    def _ctx(self) -> Iterator[None]:
        loops = compiled.python_only() if self.python_loop else contextlib.nullcontext()
        with reference_cells(self.reference), loops:
            yield

    def train_step(self, tokens: torch.Tensor) -> None:
        lm = self.lm.train()
        with self._ctx():
            if self.state is not None:
                self.state = tuple(s.detach() for s in self.state)
            logits, _, _, self.state = lm.forward_hidden(tokens[:, :-1], self.state)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 5.0)
            self.opt.step()

    def score(self, tokens: torch.Tensor) -> float:
        """Sum of log-probabilities of ``tokens[:, 1:]``, chunk by chunk with the state carried."""
        lm = self.lm.eval()
        total = 0.0
        with self._ctx(), torch.inference_mode():
            state = lm.init_state(tokens.shape[0])
            for i in range(0, tokens.shape[1] - 1, BPTT):
                inp, tgt = tokens[:, i:i + BPTT], tokens[:, i + 1:i + BPTT + 1]
                inp = inp[:, :tgt.shape[1]]
                logits, state = lm(inp, state)
                total += float(torch.log_softmax(logits, -1).gather(-1, tgt.unsqueeze(-1)).sum())
        return total


#: The clock of the measurements. CPU time of this process by default: with one intra-op thread it is
#: the time the work itself took, so other processes competing for the two cores do not inflate it.
CLOCK: Callable[[], float] = time.process_time


def macs_per_token(lm: LanguageModel) -> int:
    """Multiply-accumulates per token of the model's matrix products (forward): every weight matrix of
    the stack is applied once per token (hoisted or per step), plus the decoder. The ratio of two
    models' counts is where their time ratio would land if every GEMM ran at the same efficiency."""
    return sum(p.numel() for p in lm.rnn.parameters() if p.dim() >= 2) + lm.decoder.weight.numel()


def profile_subject(s: Subject, tokens_train: torch.Tensor, tokens_score: torch.Tensor) -> dict:
    """Where one train step and one B=8 scoring call spend their time (self CPU time by op)."""
    from torch.profiler import ProfilerActivity, profile

    matmul = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
    fused_rnn = ("rnn", "lstm")
    out = {}
    for key, fn in (("train", lambda: s.train_step(tokens_train)), ("score_b8", lambda: s.score(tokens_score))):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
        total = sum(t for _, t in rows) or 1.0
        mm = sum(t for k, t in rows if k in matmul)
        rnn = sum(t for k, t in rows if k not in matmul and any(w in k.lower() for w in fused_rnn))
        top = sorted(rows, key=lambda r: -r[1])[:6]
        out[key] = {"matmul_share": mm / total, "fused_rnn_share": rnn / total, "total_ms": total / 1e3,
                    "top_ops": [{"op": k, "ms": t / 1e3, "share": t / total} for k, t in top]}
    return out


def _timed(fn: Callable[[], object]) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def run_hidden(hidden: int, rounds: int, reference: bool, seed: int, models: list[str] | None = None,
               profile: bool = False) -> list[dict]:
    """All measurements for one hidden size (interleaved rounds)."""
    subjects: list[Subject] = []
    for name, arch, args in arch_specs(hidden):
        if models and name != "lstm" and name not in models:
            continue
        subjects.append(Subject(name, arch, args, hidden, reference=False, seed=seed))
        if reference and arch != "lstm" and name != "alstm-nowrap":
            subjects.append(Subject(name, arch, args, hidden, reference=True, seed=seed))
        if name in ("alstm", "hyperlstm") and compiled.get(COMPILED[arch]) is not None:  # what C++ buys
            subjects.append(Subject(name, arch, args, hidden, reference=False, seed=seed, python_loop=True))
    gen = torch.Generator().manual_seed(seed)

    def tokens(b: int, t: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (b, t), generator=gen)

    # tasks: (key, tokens per call, function of (subject, tokens))
    infer_chunks = {1: 4, 8: 2}   # chunks of BPTT per timed call (B=1: 140 tokens, B=8: 560 tokens)
    tasks = [("train", BATCH * BPTT, lambda s, x: s.train_step(x), lambda: tokens(BATCH, BPTT + 1))]
    for b, n in infer_chunks.items():
        tasks.append((f"score_b{b}", b * n * BPTT, lambda s, x: s.score(x),
                      (lambda b=b, n=n: tokens(b, n * BPTT + 1))))

    first_step = {}
    for s in subjects:   # first call of each task: allocator / kernel warm-up, reported separately
        x = tokens(BATCH, BPTT + 1)
        first_step[s.name] = _timed(lambda s=s, x=x: s.train_step(x))
        for _key, _, fn, make in tasks[1:]:
            inp = make()
            fn(s, inp)
    times: dict[str, dict[str, list[float]]] = {s.name: {k: [] for k, *_ in tasks} for s in subjects}
    for r in tqdm(range(rounds), desc=f"hidden {hidden}", unit="round", leave=False):
        order = subjects[r % len(subjects):] + subjects[:r % len(subjects)]
        for key, _, fn, make in tasks:
            inp = make()
            for s in order:
                times[s.name][key].append(_timed(lambda s=s, inp=inp, fn=fn: fn(s, inp)))
    base = times["lstm"]
    base_macs = subjects[0].macs_per_token
    rows = []
    for s in subjects:
        row = {"hidden": hidden, "model": s.name, "architecture": s.arch,
               "path": "reference" if s.reference else ("fused" if s.arch == "lstm" else
                                                        "fast, python loop" if s.python_loop else "fast"),
               "num_parameters": s.num_parameters, "first_step_s": first_step[s.name], "rounds": rounds,
               "macs_per_token": s.macs_per_token, "macs_ratio_to_lstm": s.macs_per_token / base_macs}
        if profile and not s.reference:
            row["profile"] = profile_subject(s, tokens(BATCH, BPTT + 1), tokens(8, 2 * BPTT + 1))
        for key, ntok, *_ in tasks:
            ts = times[s.name][key]
            ratios = [a / b for a, b in zip(ts, base[key], strict=True)]
            row[key] = {"tokens_per_s": ntok / statistics.median(ts), "ratio_to_lstm": statistics.median(ratios),
                        "ratio_min": min(ratios), "ratio_max": max(ratios), "seconds": ts}
        rows.append(row)
    return rows


#: The speed targets of the fast-cells issue: (row, measurement, hidden size or None for every size, at most).
TARGETS = [("alstm", "train", 650, 1.8), ("alstm", "train", 200, 2.0), ("alstm", "score_b8", None, 1.5)]


#: Architectures whose no-grad path has a compiled loop (``zoo/models/csrc/``): aLSTM (any mode), HyperLSTM (eval).
COMPILED = {"alstm": "alstm_infer", "hyperlstm": "hyper_infer"}


def extension_line(infos: dict | None) -> str:
    """How the C++ inference loops were had in this run (their compile time when the run built them)."""
    if not infos:
        return "C++ inference loops: not recorded."
    parts = []
    for name, info in infos.items():
        if not info.get("available"):
            parts.append(f"`{name}` unavailable ({info.get('reason')}; the Python loop ran)")
        else:
            how = "compiled by this run" if info.get("compiled_now") else "loaded from the build cache"
            parts.append(f"`{name}` {how} in {info['seconds']:.1f} s")
    return ("C++ inference loops (scoring): " + ", ".join(parts) + ", before any timing. `[python loop]` rows "
            "time the same model with the Python loop instead.")


def targets_table(rows: list[dict]) -> list[str]:
    """Each target beside the measured median ratio (and the worst round)."""
    out = ["", "| target | measured (median, worst round) | result |", "|---|---|---|"]
    for model, key, hidden, limit in TARGETS:
        for r in rows:
            if r["model"] == model and (hidden is None or r["hidden"] == hidden):
                m = r[key]
                what = {"train": "training", "score_b8": "scoring B=8"}[key]
                out.append(f"| {model} {what}, hidden {r['hidden']}: <= {limit:.1f}x LSTM | "
                           f"{m['ratio_to_lstm']:.2f}x ({m['ratio_max']:.2f}x) | "
                           f"{'met' if m['ratio_to_lstm'] <= limit else '**not met**'} |")
    return out if len(out) > 3 else []


def markdown(rows: list[dict], meta: dict) -> str:
    """The results table (time per token relative to the fused LSTM: lower is better, 1.0 = LSTM)."""
    def cell(r: dict, key: str) -> tuple[str, str]:
        m = r[key]
        return f"{m['tokens_per_s']:,.0f}", f"{m['ratio_to_lstm']:.2f} ({m['ratio_min']:.2f}-{m['ratio_max']:.2f})"

    lines = [
        f"CPU: {meta['cpu']}, {meta['threads']} thread(s), {meta['clock']} clock, torch {meta['torch']}; "
        f"vocab {VOCAB}, batch {BATCH}, "
        f"BPTT {BPTT}, {LAYERS} layers, tied (embedding = hidden). Ratio = time per token / fused LSTM's, "
        f"median over {meta['rounds']} interleaved rounds (min-max in brackets). Load average during the run: "
        f"{meta['loadavg_start']:.1f} -> {meta['loadavg_end']:.1f}.",
        "",
        extension_line(meta.get("extensions")),
        "",
        "| hidden | model | params | GEMM MACs x LSTM | train tok/s | train x LSTM | score B=1 tok/s "
        "| B=1 x LSTM | score B=8 tok/s | B=8 x LSTM | first step s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tr, b1, b8 = cell(r, "train"), cell(r, "score_b1"), cell(r, "score_b8")
        lines.append(f"| {r['hidden']} | {r['model']} | {r['num_parameters'] / 1e6:.2f}M | "
                     f"{r['macs_ratio_to_lstm']:.2f} | {tr[0]} | {tr[1]} "
                     f"| {b1[0]} | {b1[1]} | {b8[0]} | {b8[1]} | {r['first_step_s']:.2f} |")
    lines += targets_table(rows)
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        lines += ["", "Where the time goes (torch.profiler, self CPU time of one call):", "",
                  "| hidden | model | call | matmul share | fused RNN op share | x LSTM from its GEMMs alone "
                  "| top ops |",
                  "|---:|---|---|---:|---:|---:|---|"]
        for r in profiled:
            for key, p in r["profile"].items():
                top = ", ".join(f"{o['op']} {o['share']:.0%}" for o in p["top_ops"][:4])
                floor = p["matmul_share"] * r[key]["ratio_to_lstm"]
                lines.append(f"| {r['hidden']} | {r['model']} | {key} | {p['matmul_share']:.0%} | "
                             f"{p['fused_rnn_share']:.0%} | {floor:.2f} | {top} |")
        lines += ["", "*x LSTM from its GEMMs alone*: the matmul share times the model's ratio, i.e. the ratio it "
                  "would still have if everything but its matrix products took no time (a floor for any fusion of the "
                  "elementwise work; only fewer or faster GEMMs go below it)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[200, 650])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per hidden size")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: stable numbers)")
    ap.add_argument("--no-reference", action="store_true", help="skip the reference-loop rows")
    ap.add_argument("--models", nargs="+", help="only these rows (lstm is always measured): " +
                    ", ".join(name for name, _, _ in arch_specs(200)))
    ap.add_argument("--clock", choices=("cpu", "wall"), default=None,
                    help="cpu: process CPU time (default with 1 thread); wall: elapsed time (default otherwise)")
    ap.add_argument("--profile", action="store_true", help="also profile one call per fast model (op shares)")
    ap.add_argument("--cold-extension", action="store_true",
                    help="build the C++ inference loop into an empty folder first, to report its compile time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "cells.json"), help="JSON output ('' to skip)")
    ap.add_argument("--md", default=str(RESULTS / "cells.md"), help="markdown table output ('' to skip)")
    ap.add_argument("--render", metavar="JSON", help="only re-render the markdown table from an earlier JSON")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        table = markdown(data["results"], data["meta"])
        print(table)
        if args.md:
            Path(args.md).write_text(table)
        return
    if args.rounds < 1 or args.threads < 1 or any(h < 1 for h in args.hidden):
        ap.error("--rounds, --threads and --hidden must be positive")
    torch.set_num_threads(args.threads)
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    global CLOCK
    CLOCK = time.process_time if clock == "cpu" else time.perf_counter
    torch.set_flush_denormal(True)
    meta = {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "clock": clock,
            "torch": torch.__version__,
            "rounds": args.rounds, "vocab": VOCAB, "batch": BATCH, "bptt": BPTT, "layers": LAYERS,
            "loadavg_start": os.getloadavg()[0], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.cold_extension:
        os.environ["ZOO_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="zoo-ext-")
    for name in COMPILED.values():   # before any timing: a build (or the load) is reported, never timed
        compiled.load(name)
    meta["extensions"] = {name: compiled.status()[name] for name in COMPILED.values()}
    try:
        with open("/proc/cpuinfo") as f:
            meta["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    rows: list[dict] = []
    for hidden in args.hidden:
        rows += run_hidden(hidden, args.rounds, not args.no_reference, args.seed, args.models, args.profile)
    meta["loadavg_end"] = os.getloadavg()[0]
    table = markdown(rows, meta)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(table)


if __name__ == "__main__":
    main()
