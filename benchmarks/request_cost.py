"""What the largest request the server's token budgets allow costs: the figure the defaults are sized by.

:class:`zoo.api.service.Limits` bounds a score request by its tokens (``max_total_tokens``) and a generate request by
prompt tokens + ``max_new_tokens`` (``max_generate_tokens``), so that no single valid request holds a worker for
long (target: about 2 s of one core on the default model). This times, on one thread, through the same service
core the server runs (:meth:`zoo.api.service.Service.score_steps` / :meth:`~zoo.api.service.Service.stream_steps`, the
scheduler's step size), the costliest requests within the default limits:

* score, one text at the character cap (one row: the costliest tokens, each a sequential step);
* score, as few long texts as fill the token budget, padded (few rows);
* score, ``max_texts`` texts filling the token budget (many rows: the cheapest tokens);
* score, 15 one-word texts beside one long text: the budget counts *padded* positions (a request's texts are
  batched together, each padded to the longest of its batch), so the long text is at most a 16th of it;
* generate, a prompt filling the budget beside ``max_new_tokens`` sampled tokens (no early stop);
* ``/v1/completions`` (:class:`zoo.api.completions.CompletionRun`, what the OpenAI route runs): one prompt with
  ``max_tokens`` generated, prompt and generated together within ``max_generate_tokens``; the same budget over
  ``max_texts`` prompts; and prompts filling ``max_total_tokens`` read with ``echo`` and ``logprobs`` (nothing
  generated).

The figure is CPU time of the process (one torch thread), not wall time: the machine is shared, and a core's
seconds are what one request takes from everyone else.

    python benchmarks/request_cost.py            # the default model, median of 3 runs
    python benchmarks/request_cost.py --model alstm-wt2-11m-long-light

Writes benchmarks/results/request_cost.json and .md (the README's benchmark section).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import zoo
from zoo.api.scheduler import STEP_TOKENS
from zoo.api.service import GenerateRequest, Limits, Service, parse_request
from zoo.data import corpus_files
from zoo.scoring import padded_positions, run_steps
from zoo.tools.readme import write_result


def words_of_test_split() -> list[str]:
    return corpus_files("ptb")["test"].read_text(encoding="utf-8").split()


def text_of(words: list[str], tokens: int, max_chars: int, tokenize: Callable[[str], int], start: int = 0) -> str:
    """A run of test-split text with at most ``tokens`` tokens and ``max_chars`` characters."""
    lo, hi = 1, min(len(words) - start, tokens)
    while lo < hi:  # the most words that fit both caps
        mid = (lo + hi + 1) // 2
        text = " ".join(words[start:start + mid])
        lo, hi = (mid, hi) if len(text) <= max_chars and tokenize(text) <= tokens else (lo, mid - 1)
    return " ".join(words[start:start + lo])


def requests_at_the_limits(service: Service, limits: Limits, words: list[str]) -> dict[str, dict[str, Any]]:
    """The costliest requests of each shape the limits allow, as request bodies."""
    tok = service.model.tokenizer

    def count(t: str) -> int:
        return len(tok.encode(t).ids)

    budget = limits.max_total_tokens
    one = text_of(words, budget, limits.max_chars, count)
    k = min(limits.max_texts, -(-budget // count(one)))  # as few long texts as fill the budget, padded
    at_cap = [text_of(words, budget // k, limits.max_chars, count, 2000 * j) for j in range(k)]
    per = budget // limits.max_texts
    many = [text_of(words, per, limits.max_chars, count, k * per) for k in range(limits.max_texts)]
    new = limits.max_new_tokens
    prompt = text_of(words, limits.max_generate_tokens - new, limits.max_prompt_chars,
                     lambda t: len(tok.encode(t, add_eos=False).ids))
    long = text_of(words, budget // 16 - 2, limits.max_chars, count, 500)  # 15 one-word texts: 2 tokens each
    completions = completion_bodies(service, limits, words, prompt)
    return {"score, one text at the character cap": {"texts": [one]},
            "score, 15 one-word texts beside one long text (padded positions)": {"texts": ["the"] * 15 + [long]},
            "score, as few long texts as fill the token budget": {"texts": at_cap},
            f"score, {limits.max_texts} texts filling the token budget": {"texts": many},
            f"generate, a prompt filling the budget + {new} new tokens": {
                "task": "generate", "prompt": prompt, "max_new_tokens": new, "seed": 0, "stop_at_eos": False},
            **completions}


def completion_bodies(service: Service, limits: Limits, words: list[str], prompt: str) -> dict[str, dict[str, Any]]:
    """The costliest ``/v1/completions`` bodies the limits allow (``prompt``: the generate shape's)."""
    tok = service.model.tokenizer
    new = limits.max_new_tokens
    n = min(limits.max_texts, 8)
    short = text_of(words, 8, limits.max_chars, lambda t: len(tok.encode(t, add_eos=False).ids))
    per = (limits.max_generate_tokens - n * len(tok.encode(short, add_eos=False).ids)) // n
    per_read = limits.max_total_tokens // limits.max_texts
    read = [text_of(words, per_read - 1, limits.max_chars, lambda t: len(tok.encode(t).ids), k * per_read)
            for k in range(limits.max_texts)]
    base = {"model": "m", "seed": 0, "temperature": 1.0}
    return {f"/v1/completions, a prompt + {new} generated": {**base, "prompt": prompt, "max_tokens": new},
            f"/v1/completions, {n} prompts x {per} generated": {**base, "prompt": [short] * n, "max_tokens": per},
            f"/v1/completions, {limits.max_texts} prompts read with echo + logprobs": {
                **base, "prompt": read, "max_tokens": 0, "echo": True, "logprobs": 5}}


def _completion_run(service: Service, body: dict[str, Any]) -> tuple[Callable[[], Any], int]:
    """A completion body as the OpenAI route runs it: (a function running it to the end, its budgeted tokens)."""
    from zoo.api.completions import CompletionRun, check_budget, parse_completion

    req = parse_completion(body, service.model.tokenizer, service.limits)
    prompt, generated = check_budget(req, service.model.tokenizer, service.limits)
    return (lambda: run_steps(CompletionRun(service.model, req).steps(STEP_TOKENS))), prompt + generated


def time_request(service: Service, body: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Median seconds of one request run to the end through the service core's steps (tokens counted); the
    request must be within the service's limits (parsed and budget-checked as the server does)."""
    if "model" in body:
        run, n = _completion_run(service, body)
    else:
        req = parse_request(body, service.limits)
        encs = service.within_budget(req)
        if isinstance(req, GenerateRequest):
            n = len(service.model.tokenizer.encode(req.prompt, add_eos=False).ids) + req.sampling.max_new_tokens
            run = lambda req=req: list(service.stream_steps(req, STEP_TOKENS))  # noqa: E731
        else:
            n = padded_positions([len(e.ids) for e in encs])
            run = lambda req=req: run_steps(service.score_steps(req, STEP_TOKENS))  # noqa: E731
    cpu, wall = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return {"tokens": n, "texts": len(body.get("texts", [])) or None, "seconds": statistics.median(cpu),
            "cpu_seconds_runs": cpu, "wall_seconds_runs": wall}


def step_cost(service: Service, words: list[str], rows: int, repeats: int = 5) -> float:
    """Median CPU seconds of one scheduler step (:data:`STEP_TOKENS` tokens) of a score request of ``rows``
    long texts: the most a worker spends on one request before turning to the next."""
    text = " ".join(words[:600])
    steps = service.score_steps(parse_request({"texts": [text] * rows}, service.limits), STEP_TOKENS)
    next(steps)  # the first step also encodes
    cpu = []
    for _ in range(repeats):
        c0 = time.process_time()
        next(steps)
        cpu.append(time.process_time() - c0)
    return statistics.median(cpu)


def markdown(result: dict[str, Any]) -> str:
    lim = result["limits"]
    rows = ["| request (within the default limits) | budgeted tokens | CPU seconds (1 thread) |", "|---|---:|---:|"]
    rows += [f"| {name} | {r['tokens']:,} | {r['seconds']:.2f} |" for name, r in result["requests"].items()]
    return (f"Measured {result['date']} on `{result['model']}` ({result['machine']['platform']}, load average "
            f"{result['machine']['load_avg'][0]:.1f}), one thread, median of {result['repeats']}; limits: "
            f"`max_total_tokens` {lim['max_total_tokens']:,}, `max_generate_tokens` {lim['max_generate_tokens']:,}, "
            f"`max_new_tokens` {lim['max_new_tokens']}, {lim['max_chars']:,} characters per text:\n\n"
            + "\n".join(rows) + f"\n\nthe costliest: {result['max_seconds']:.2f} s; one scheduler step "
            f"({result['step_tokens']} tokens): {1000 * result['step_seconds']['1']:.1f} ms for one text, "
            f"{1000 * result['step_seconds']['16']:.1f} ms for 16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "request_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    limits = Limits()
    service = Service(zoo.load(args.model), limits)
    run_steps(service.score_steps(parse_request({"text": "the cat"}), STEP_TOKENS))  # warm
    out = {name: time_request(service, body, args.repeats)
           for name, body in requests_at_the_limits(service, limits, words_of_test_split()).items()}
    for name, r in out.items():
        print(f"{name}: {r['tokens']:,} tokens, {r['seconds']:.2f} s", flush=True)
    steps = {str(rows): step_cost(service, words_of_test_split(), rows) for rows in (1, 16)}
    result = {"model": args.model, "limits": {k: getattr(limits, k) for k in (
        "max_total_tokens", "max_generate_tokens", "max_new_tokens", "max_texts", "max_chars")},
        "step_tokens": STEP_TOKENS, "step_seconds": steps, "repeats": args.repeats, "requests": out,
        "max_seconds": max(r["seconds"] for r in out.values()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_result(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
