"""Load test of the TorchServe deployment on loopback: batching on vs off, and scoring beside generation.

For each setting a fresh server is started (``zoo.tools.serve.lifecycle.start_server``: token auth on, its own run dir
and free ports), warmed up, then ``--clients`` threads each send score requests back to back for
``--duration`` seconds: one PTB test sentence per request (``{"task": "score", "texts": [s]}``),
cycling through the test set. Reported: requests/s, p50/p99 latency, errors (any non-200 reply or
exception: must be 0), and the mean batch size the handler saw (its ``X-Zoo-Batch-Size`` header).

Mixed load (on the batching-on server): ``--mixed-score-clients`` score clients alone, then the same score
clients while ``--generate-clients`` clients generate back to back (``--gen-tokens`` tokens each, sampled,
not streamed). The figure is the score p50 with generation running over the score p50 alone (target <= 2:
generation advances a time slice per worker call under TorchServe's continuous batching, so a score request
never waits for whole generations, as it did when a batch ran its generations to the end).

    python benchmarks/serving.py                      # the default model, 16 clients, 30 s per setting
    python benchmarks/serving.py --model path/to/ckpt --duration 10
    python benchmarks/serving.py --fairness --duration 20   # honest clients beside hostile ones (below)

Fairness (``--fairness``, one server with the default settings, through the front door ``zoo serve start``
puts in front): 4 honest clients each score one PTB sentence back to back, alone and then beside the hostile
classes of issue 52: (a) 8 and (b) 16 clients each looping the largest score request the limits allow, (c) 4 such
clients plus 4 generating 512 tokens, (d) 40 largest requests fired and abandoned every 10 s (each connection
closed 50 ms after its request went out), (e) 4 clients flooding requests just over the token budget, (f) 4
clients flooding 1 MB malformed bodies, (g) 4 clients looping the most expensive allowed shape of each route (2 a
512-token generation, 2 a ``/v1/completions`` of 8 prompts generating the rest of the budget). A hostile request
answered 503 (all places for long work or generation taken) waits its ``Retry-After``. Reported per class: the
honest p50 over their p50 alone (target <= 3x), the share of honest requests answered 200 (target 100%), what
the hostile clients got, and the load average (the machine is shared: rerun on a quiet one before quoting).
Writes benchmarks/results/serving_fairness.json
and .md (the docs' Benchmarks page, docs/results/benchmarks.md).

Ceiling (``--ceiling``, one server with the defaults, through the front door): ``--ceiling-clients`` (16 and 64)
clients each scoring one PTB sentence per request, back to back, on the native route and on ``/v1/completions``
(echo, no new token, ``logprobs: 1``), each load between two measurements of its in-process ceiling (their
mean): ``Service.score`` on batches of as many one-sentence requests as the server has places (8), one torch thread
as the worker, a quarter as long each. The figure is the served requests/s as a share of that ceiling (target >=
0.85), per round and its median
over ``--rounds``. Writes benchmarks/results/serving_ceiling.json and .md (the docs' Benchmarks page,
docs/results/benchmarks.md).

Writes benchmarks/results/serving.json and the markdown table next to it (serving.md), prints the table,
then regenerates the READMEs (``python -m zoo.tools.readme``: the ``serving-benchmark`` section of
serving/README.md). Clients and server share the machine, so absolute numbers depend on its load; the
on/off ratio is the comparable figure.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from tqdm.auto import tqdm

from zoo.data import DataError, corpus_files
from zoo.tools import ports
from zoo.tools.readme import write_result
from zoo.tools.serve.config import ArchiveOptions, ServerConfig, parse_model_spec, resolve_checkpoint
from zoo.tools.serve.keys import read_keys
from zoo.tools.serve.lifecycle import start_server, stop_server
from zoo.zoo_model import ZooModel

FALLBACK_SENTENCES = ["the company said it expects to report a loss for the third quarter",
                      "stocks rose in early trading as investors bought shares of technology companies",
                      "the federal reserve is expected to cut interest rates next month",
                      "mr. smith said the plan would n't change the company 's strategy"]


def sentences(limit: int = 2000) -> list[str]:
    """PTB test sentences (lines of the corpus file), or a few built-in ones without the data."""
    try:
        path = corpus_files("ptb")["test"]
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        return lines[:limit] or FALLBACK_SENTENCES
    except (DataError, OSError, KeyError):
        return FALLBACK_SENTENCES


def free_ports(n: int) -> list[int]:
    """Ports for one server (not TorchServe's defaults, which another server on the machine may hold)."""
    return ports.free_ports(n, avoid=ports.TORCHSERVE_DEFAULT_PORTS)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def load(url: str, key: str, texts: list[str], clients: int, seconds: float, warmup: float,
         generators: int = 0, gen_tokens: int = 50, completions: str = "") -> dict[str, Any]:
    """Closed-loop load: each client sends its next request as soon as the previous one returns. ``clients``
    score one sentence per request (on ``/v1/completions`` of model ``completions`` where given: echo, no new token,
    the prompt's log-probabilities, as lm-eval's ``local-completions`` asks); ``generators`` more clients generate
    ``gen_tokens`` tokens per request. Each client connects from its own loopback address
    (:func:`zoo.tools.ports.loopback_address`): the server tells clients apart by their address. The clients use
    ``http.client`` (:func:`post_json`), not ``requests``: they share the machine's two cores with the server, and
    ``requests`` costs several times the CPU per request."""
    lock = threading.Lock()
    latencies: list[float] = []
    batch_sizes: list[int] = []
    errors: list[str] = []
    gen_latencies: list[float] = []
    gen_tokens_done: list[int] = []
    start = time.perf_counter() + warmup
    stop_at = start + seconds

    target = url.rsplit("/predictions/", 1)[0] + "/v1/completions" if completions else url

    def client(idx: int, generate: bool) -> None:
        source = ports.loopback_address(idx)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        i = idx
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            if generate:
                body: dict[str, Any] = {"task": "generate", "prompt": texts[i % len(texts)][:40],
                                        "max_new_tokens": gen_tokens, "seed": i, "stop_at_eos": False}
            elif completions:
                body = {"model": completions, "prompt": texts[i % len(texts)], "max_tokens": 0, "echo": True,
                        "logprobs": 1}
            else:
                body = {"task": "score", "texts": [texts[i % len(texts)]]}
            i += clients + generators
            try:
                status, batch, reply = post_json(url if generate else target, body, headers, source)
                ok, note = status == 200, f"HTTP {status}"
                tokens = reply.get("num_tokens", 0) if ok and generate else 0
                ok = ok and (not completions or generate or "choices" in reply)
            except (OSError, http.client.HTTPException, ValueError) as e:
                ok, note, batch, tokens = False, type(e).__name__, 0, 0
            t1 = time.perf_counter()
            if t0 < start:  # warm-up requests are not counted
                continue
            with lock:
                if not ok:
                    errors.append(note)
                elif generate:
                    gen_latencies.append(t1 - t0)
                    gen_tokens_done.append(tokens)
                else:
                    latencies.append(t1 - t0)
                    batch_sizes.append(batch)

    threads = [threading.Thread(target=client, args=(k, False), daemon=True) for k in range(clients)]
    threads += [threading.Thread(target=client, args=(clients + k, True), daemon=True) for k in range(generators)]
    for t in threads:
        t.start()
    with tqdm(total=int(warmup + seconds), desc="load", unit="s", leave=False) as bar:
        while any(t.is_alive() for t in threads):
            time.sleep(1)
            bar.update(1)
    for t in threads:
        t.join()
    out = {"requests": len(latencies), "errors": len(errors), "error_kinds": sorted(set(errors)),
           "requests_per_s": len(latencies) / seconds,
           "p50_ms": 1000 * percentile(latencies, 0.50), "p99_ms": 1000 * percentile(latencies, 0.99),
           "mean_batch_size": sum(batch_sizes) / len(batch_sizes) if batch_sizes else float("nan")}
    if generators:
        out.update(generate_requests=len(gen_latencies), generate_p50_ms=1000 * percentile(gen_latencies, 0.5),
                   generated_tokens_per_s=sum(gen_tokens_done) / seconds)
    return out


def ceiling(service: Any, texts: list[str], batch: int, seconds: float, threads: int) -> dict[str, Any]:
    """The in-process ceiling: :meth:`zoo.api.service.Service.score` on batches of ``batch`` one-sentence requests
    back to back for ``seconds`` (the worker's model work, batched as its places allow, with none of the server's
    costs), with as many torch threads as the worker has."""
    import torch

    from zoo.api.service import ScoreRequest

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        service.score([ScoreRequest((t,)) for t in texts[:batch]])
        done, i, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            replies = service.score([ScoreRequest((texts[(i + k) % len(texts)],)) for k in range(batch)])
            assert not any(isinstance(r, Exception) for r in replies)
            done, i = done + batch, i + batch
        return {"requests_per_s": done / (time.perf_counter() - t0), "batch": batch, "seconds": seconds}
    finally:
        torch.set_num_threads(before)


def run_ceiling(name: str, source: str, args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    """Rounds of: each client count on the native route and on ``/v1/completions`` through the front door (one
    server, the defaults), each load between two measurements of the in-process ceiling (a quarter as long each),
    as a share of their mean: the machine's speed drifts by 10-25% between minutes, so a ceiling is compared only
    with the load beside it."""
    from zoo.api.service import Service

    ports = free_ports(4)
    cfg = ServerConfig(inference_port=ports[0], management_port=ports[1], metrics_port=ports[2], worker_port=ports[3])
    opts = ArchiveOptions(threads=args.threads)
    service = Service(ZooModel.from_pretrained(resolve_checkpoint(source)))
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zoo-bench-ceiling-") as tmp:
        run_dir = Path(tmp)
        start_server([(name, source)], run_dir, cfg, opts, timeout=300)
        try:
            url = f"{cfg.url('inference')}/predictions/{name}"
            key = read_keys(run_dir)["inference"]
            load(url, key, texts, max(args.ceiling_clients), args.warmup, 0.0)  # the server's first requests
            for r in range(args.rounds):
                row: dict[str, Any] = {}
                for clients in args.ceiling_clients:
                    for route, model in (("native", ""), ("v1", name)):
                        before = ceiling(service, texts, opts.batch_size, args.duration / 4, args.threads)
                        res = load(url, key, texts, clients, args.duration, args.warmup, completions=model)
                        after = ceiling(service, texts, opts.batch_size, args.duration / 4, args.threads)
                        top = {**before, "requests_per_s": (before["requests_per_s"] + after["requests_per_s"]) / 2,
                               "before_and_after": [before["requests_per_s"], after["requests_per_s"]]}
                        res["ceiling"] = top
                        res["share_of_ceiling"] = res["requests_per_s"] / top["requests_per_s"]
                        row[f"{route} {clients} clients"] = res
                        print(f"round {r + 1}: {route}, {clients} clients: {res['requests_per_s']:.1f} req/s = "
                              f"{res['share_of_ceiling']:.2f} of the ceiling ({top['requests_per_s']:.1f}), p50 "
                              f"{res['p50_ms']:.1f} ms, errors {res['errors']} {res['error_kinds']}", flush=True)
                rounds.append(row)
        finally:
            stop_server(run_dir)
    shares = {k: sorted(r[k]["share_of_ceiling"] for r in rounds) for k in rounds[0]}
    return {"rounds": rounds, "batch_size": opts.batch_size, "share_of_ceiling": shares,
            "median_share": {k: percentile(v, 0.5) for k, v in shares.items()}}


def ceiling_markdown(result: dict[str, Any]) -> str:
    rows = ["| load (each client one PTB sentence per request) | requests/s per round | its ceiling per round | "
            "share of the ceiling per round | median share | p50 ms | errors |", "|---|---|---|---|---:|---:|---:|"]
    rounds = result["ceiling"]["rounds"]
    for key, median in result["ceiling"]["median_share"].items():
        route, clients = key.split(" ", 1)
        where = "`/v1/completions` (echo, logprobs 1)" if route == "v1" else "native `/predictions`"
        rows.append(f"| {clients}, {where} | " + ", ".join(f"{r[key]['requests_per_s']:.1f}" for r in rounds)
                    + " | " + ", ".join(f"{r[key]['ceiling']['requests_per_s']:.1f}" for r in rounds) + " | "
                    + ", ".join(f"{r[key]['share_of_ceiling']:.2f}" for r in rounds) + f" | {median:.2f} | "
                    + f"{percentile([r[key]['p50_ms'] for r in rounds], 0.5):.1f} | "
                    + f"{sum(r[key]['errors'] for r in rounds)} |")
    beside = f"; running beside: {result['running_beside']}" if result.get("running_beside") else ""
    return (f"Measured {result['date']} on {_model_named(result)} ({result['machine']['platform']}, "
            f"{result['machine']['cpu_count']} CPUs, load average at the end "
            f"{result['machine']['load_avg_at_end'][0]:.1f}{beside}), through the front door with the defaults, "
            f"{result['duration_s']:.0f} s per load, each between two measurements of its in-process ceiling (the "
            f"mean; `Service.score` on batches of {result['ceiling']['batch_size']} one-sentence requests, one "
            "thread, a quarter as long each); target: "
            "at least 0.85 of the ceiling:\n\n" + "\n".join(rows))


def post_json(url: str, body: Any, headers: dict[str, str], source: str) -> tuple[int, int, Any]:
    """POST a JSON body from local address ``source`` on a connection of its own (the front door closes each after
    its reply): ``(status, X-Zoo-Batch-Size or 0, the decoded reply)``."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120, source_address=(source, 0))
    try:
        conn.request("POST", parts.path, body=json.dumps(body).encode(), headers=headers)
        r = conn.getresponse()
        data = r.read()
        return r.status, int(r.getheader("X-Zoo-Batch-Size") or 0), json.loads(data) if data else None
    finally:
        conn.close()


def honest_and_hostile(url: str, key: str, texts: list[str], seconds: float, hostile: Any,
                       hostile_clients: int, honest_clients: int = 4) -> dict[str, Any]:
    """``honest_clients`` scoring one sentence each back to back for ``seconds``, beside ``hostile_clients`` looping
    ``hostile`` (after a 2 s head start); a hostile request answered 503 waits its Retry-After. ``hostile``: a
    request body, or a :class:`Hostile` (another route, raw bytes, or fired and abandoned), or a list of
    ``(hostile, clients)`` (a mix; ``hostile_clients`` is then their sum)."""
    mix = hostile if isinstance(hostile, list) else [(hostile, hostile_clients)] if hostile is not None else []
    mix = [(h if isinstance(h, Hostile) else Hostile(h), n) for h, n in mix]
    lock = threading.Lock()
    honest: list[tuple[float, int]] = []
    hostile_codes: list[int] = []
    stop = threading.Event()
    headers = {"Authorization": f"Bearer {key}"}

    def hostile_loop(hostile: Hostile, client: int) -> None:
        if hostile.abandon:
            while not stop.is_set():
                abandon(url, key, hostile.body, hostile.abandon, client)
                stop.wait(10)
            return
        http = ports.loopback_session(client)
        target = url.rsplit("/predictions/", 1)[0] + hostile.path if hostile.path else url
        while not stop.is_set():
            try:
                r = http.post(target, headers={**headers, "Content-Type": "application/json"}, timeout=300,
                              data=hostile.body if isinstance(hostile.body, bytes) else json.dumps(hostile.body))
                code, wait = r.status_code, float(r.headers.get("Retry-After", 0) or 0)
            except requests.RequestException:
                code, wait = -1, 1.0
            with lock:
                hostile_codes.append(code)
            stop.wait(wait)

    def honest_loop(k: int, stop_at: float) -> None:
        http, i = ports.loopback_session(k), k
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                code = http.post(url, json={"task": "score", "texts": [texts[i % len(texts)]]}, headers=headers,
                                 timeout=120).status_code
            except requests.RequestException:
                code = -1
            with lock:
                honest.append((time.perf_counter() - t0, code))
            i += honest_clients

    hostiles = [h for h, n in mix for _ in range(n)]  # each a client of its own, from its own address
    bad = [threading.Thread(target=hostile_loop, args=(h, 100 + j), daemon=True) for j, h in enumerate(hostiles)]
    for t in bad:
        t.start()
    time.sleep(2.0 if bad else 0.0)
    stop_at = time.perf_counter() + seconds
    good = [threading.Thread(target=honest_loop, args=(k, stop_at)) for k in range(honest_clients)]
    for t in good:
        t.start()
    for t in good:
        t.join()
    stop.set()
    for t in bad:
        t.join(timeout=300)
    ok = [t for t, code in honest if code == 200]
    return {"honest_requests": len(honest), "honest_200_percent": 100 * len(ok) / max(1, len(honest)),
            "honest_p50_ms": 1000 * percentile(ok, 0.5), "honest_p99_ms": 1000 * percentile(ok, 0.99),
            "hostile_requests": len(hostile_codes),
            "hostile_codes": {str(c): hostile_codes.count(c) for c in sorted(set(hostile_codes))}}


@dataclass
class Hostile:
    """One hostile client's request: ``body`` (a JSON body, or raw bytes) sent to ``path`` (the model's
    ``/predictions`` route when empty); ``abandon``: instead of looping, fire this many requests every 10 s, each
    connection closed 50 ms after the request went out."""

    body: Any
    path: str = ""
    abandon: int = 0


def abandon(url: str, key: str, body: Any, n: int, client: int = 0) -> None:
    """Send ``body`` ``n`` times on raw connections from client ``client``'s address, hanging up 50 ms after each (one
    connection open at a time)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    for _ in range(n):
        with socket.create_connection((parts.hostname, parts.port), timeout=10,
                                      source_address=(ports.loopback_address(client), 0)) as s:
            s.sendall(head + data)
            time.sleep(0.05)


def fairness_scenarios(model: ZooModel, texts: list[str], name: str = "default") -> dict[str, tuple[Any, int]]:
    """The hostile classes (a)-(g) of issue 52: (request, clients) each."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from request_cost import requests_at_the_limits, text_of, words_of_test_split

    from zoo.api.service import Limits, Service

    limits = Limits()
    words = words_of_test_split()
    shapes = requests_at_the_limits(Service(model, limits), limits, words)
    largest = shapes["score, as few long texts as fill the token budget"]
    count = lambda t: len(model.tokenizer.encode(t).ids)  # noqa: E731
    half = limits.max_total_tokens // 2 + 1  # two texts of just over half the budget: 2 positions over it
    over = {"texts": [text_of(words, half, limits.max_chars, count, k * 3000) for k in range(2)]}
    malformed = b'{"texts": ["' + b"the cat " * 124_999  # 1,000,012 bytes, never closed
    gen = {"task": "generate", "prompt": texts[0][:40], "max_new_tokens": 512, "stop_at_eos": False}
    completion = next(b for k, b in shapes.items() if k.startswith("/v1/completions") and "x" in k)
    return {"a: 8 clients looping the largest score request": (largest, 8),
            "b: 16 clients looping the largest score request": (largest, 16),
            "c: 4 clients looping the largest score request + 4 generating 512 tokens": (
                [(largest, 4), (gen, 4)], 8),
            "d: 40 largest requests fired and abandoned every 10 s": (Hostile(largest, abandon=40), 1),
            "e: 4 clients flooding requests just over the token budget": (over, 4),
            "f: 4 clients flooding 1 MB malformed bodies": (Hostile(malformed), 4),
            "g: 4 clients looping the costliest shape of each route": (
                [(shapes["generate, a prompt filling the budget + 512 new tokens"], 2),
                 (Hostile({**completion, "model": name}, path="/v1/completions"), 2)], 4)}


def run_fairness(name: str, source: str, args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    model = ZooModel.from_pretrained(resolve_checkpoint(source))
    scenarios = fairness_scenarios(model, texts, name)
    ports = free_ports(4)
    cfg = ServerConfig(inference_port=ports[0], management_port=ports[1], metrics_port=ports[2], worker_port=ports[3])
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zoo-bench-fair-") as tmp:
        run_dir = Path(tmp)
        start_server([(name, source)], run_dir, cfg, ArchiveOptions(threads=args.threads), timeout=300)
        try:
            url = f"{cfg.url('inference')}/predictions/{name}"
            key = read_keys(run_dir)["inference"]
            honest_and_hostile(url, key, texts, args.warmup, None, 0)
            out["alone"] = honest_and_hostile(url, key, texts, args.duration, None, 0)
            for label, (body, clients) in scenarios.items():
                res = honest_and_hostile(url, key, texts, args.duration, body, clients)
                res["ratio_p50"] = res["honest_p50_ms"] / out["alone"]["honest_p50_ms"]
                res["load_avg"] = os.getloadavg()
                res["uptime"] = uptime()
                out[label] = res
                print(f"{label}: honest p50 {res['honest_p50_ms']:.0f} ms ({res['ratio_p50']:.2f}x alone), "
                      f"{res['honest_200_percent']:.1f}% 200; hostile {res['hostile_codes']}", flush=True)
        finally:
            stop_server(run_dir)
    return out


def uptime() -> str:
    """``uptime``'s line (the machine's load when a figure was measured: recorded beside it)."""
    import subprocess

    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def fairness_markdown(result: dict[str, Any]) -> str:
    alone = result["scenarios"]["alone"]
    rows = ["| beside | honest p50 ms | x alone | honest 200 | hostile requests answered | load avg |",
            "|---|---:|---:|---:|---|---:|",
            f"| nothing (4 honest clients alone) | {alone['honest_p50_ms']:.0f} | 1.00 | "
            f"{alone['honest_200_percent']:.0f}% | - | - |"]
    for label, r in result["scenarios"].items():
        if label == "alone":
            continue
        codes = ", ".join(f"{n} x {c}" for c, n in r["hostile_codes"].items())
        rows.append(f"| {label} | {r['honest_p50_ms']:.0f} | {r['ratio_p50']:.2f} | {r['honest_200_percent']:.1f}% "
                    f"| {codes} | {r['load_avg'][0]:.1f} |")
    beside = f"; running beside: {result['running_beside']}" if result.get("running_beside") else ""
    return (f"Measured {result['date']} on {_model_named(result)} ({result['machine']['platform']}, "
            f"{result['machine']['cpu_count']} CPUs{beside}), through the front door, {result['duration_s']:.0f} s "
            f"per scenario; targets: honest p50 <= 3x alone, 100% answered 200:\n\n" + "\n".join(rows))


def run_setting(name: str, source: str, opts: ArchiveOptions, args: argparse.Namespace,
                texts: list[str], mixed: bool = False) -> dict[str, Any]:
    """One fresh server: the score load, and with ``mixed`` then score alone vs score beside generation."""
    ports = free_ports(4)
    cfg = ServerConfig(inference_port=ports[0], management_port=ports[1], metrics_port=ports[2], worker_port=ports[3])
    with tempfile.TemporaryDirectory(prefix="zoo-bench-serve-") as tmp:
        run_dir = Path(tmp)
        print(f"starting server: batch_size={opts.batch_size} max_batch_delay={opts.max_batch_delay} ms", flush=True)
        start_server([(name, source)], run_dir, cfg, opts, timeout=300)
        try:
            url = f"{cfg.url('inference')}/predictions/{name}"
            key = read_keys(run_dir)["inference"]
            res = load(url, key, texts, args.clients, args.duration, args.warmup)
            if mixed:
                res["mixed"] = {
                    "score_only": load(url, key, texts, args.mixed_score_clients, args.duration, args.warmup),
                    "with_generation": load(url, key, texts, args.mixed_score_clients, args.duration, args.warmup,
                                            generators=args.generate_clients, gen_tokens=args.gen_tokens)}
        finally:
            stop_server(run_dir)
    res.update(batch_size=opts.batch_size, max_batch_delay_ms=opts.max_batch_delay)
    return res


def _model_named(result: dict[str, Any]) -> str:
    """The model as measured: ``default`` moves with the catalogue, so the checkpoint it resolved to is named."""
    folder = Path(result["checkpoint"]).name
    when = f"`{folder}` when measured, " if folder != result["model"] else ""
    return f"`{result['model']}` ({when}{result['num_parameters']:,} parameters)"


def markdown(result: dict[str, Any]) -> str:
    rows = ["| setting | batch size / delay | requests/s | p50 ms | p99 ms | mean batch | errors |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for key, r in result["runs"].items():
        rows.append(f"| {key.replace('_', ' ')} | {r['batch_size']} / {r['max_batch_delay_ms']} ms | "
                    f"{r['requests_per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                    f"{r['mean_batch_size']:.2f} | {r['errors']} |")
    rows.append(f"\nbatching on / off: {result['ratio_requests_per_s']:.2f}x requests/s, "
                f"p50 {result['ratio_p50']:.2f}x; model {_model_named(result)}, "
                f"{result['clients']} clients x {result['duration_s']:.0f} s, "
                f"{result['machine']['cpu_count']} CPUs")
    mixed = result.get("mixed")
    if mixed:
        alone, beside = mixed["score_only"], mixed["with_generation"]
        rows += ["", "Scoring beside generation (batching-on server):", "",
                 "| load | score requests/s | score p50 ms | score p99 ms | generated tokens/s | errors |",
                 "|---|---:|---:|---:|---:|---:|",
                 f"| {mixed['score_clients']} score clients | {alone['requests_per_s']:.1f} | {alone['p50_ms']:.1f} | "
                 f"{alone['p99_ms']:.1f} | - | {alone['errors']} |",
                 f"| the same + {mixed['generate_clients']} generating ({mixed['gen_tokens']} tokens each) | "
                 f"{beside['requests_per_s']:.1f} | {beside['p50_ms']:.1f} | {beside['p99_ms']:.1f} | "
                 f"{beside['generated_tokens_per_s']:.0f} | {beside['errors']} |",
                 f"\nscore p50 with generation / alone: {mixed['ratio_p50']:.2f}x (target <= 2); generation time "
                 f"slice {mixed['gen_slice_ms']} ms per worker call"]
    return "\n".join(rows)


def readme_text(result: dict[str, Any]) -> str:
    """What serving.md holds (and the serving README shows): the conditions, then the table."""
    beside = f"; running beside: {result['running_beside']}" if result.get("running_beside") else ""
    return (f"Measured {result['date']} ({result['machine']['platform']}, load average at the end "
            f"{result['machine']['load_avg_at_end'][0]:.1f}{beside}):\n\n{markdown(result)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="catalogue name, `default`, or checkpoint dir")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=30.0, help="measured seconds per setting")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--batch-size", type=int, default=8, help="batch size of the 'batching on' setting")
    ap.add_argument("--max-batch-delay", type=int, default=ArchiveOptions.max_batch_delay,
                    help="ms, 'batching on' setting")
    ap.add_argument("--threads", type=int, default=ArchiveOptions.threads,
                    help="torch threads per worker (0 = torch default)")
    ap.add_argument("--mixed-score-clients", type=int, default=4, help="score clients of the mixed load")
    ap.add_argument("--generate-clients", type=int, default=4, help="generating clients of the mixed load")
    ap.add_argument("--gen-tokens", type=int, default=50, help="tokens per generate request (mixed load)")
    ap.add_argument("--note", default="", help="what else ran on the machine (recorded in the JSON and table)")
    ap.add_argument("--no-mixed", action="store_true", help="skip the mixed score + generate load")
    ap.add_argument("--fairness", action="store_true", help="honest clients beside hostile ones (module docstring)")
    ap.add_argument("--ceiling", action="store_true", help="throughput against the in-process ceiling (the module "
                    "docstring); writes benchmarks/results/serving_ceiling.json")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the --ceiling measurement")
    ap.add_argument("--ceiling-clients", type=int, nargs="+", default=[16, 64], help="client counts of --ceiling")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/serving.json (serving_fairness.json)")
    args = ap.parse_args()

    name, source = parse_model_spec(args.model)
    model = ZooModel.from_pretrained(resolve_checkpoint(source))
    texts = sentences()
    results = Path(__file__).parent / "results"
    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform()}
    if args.ceiling:
        res = {"model": args.model, "checkpoint": str(resolve_checkpoint(source)),
               "num_parameters": model.num_parameters, "duration_s": args.duration,
               "ceiling": run_ceiling(name, source, args, texts), "running_beside": args.note,
               "machine": {**machine, "load_avg_at_end": os.getloadavg()},
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        text = ceiling_markdown(res)
        print(text)
        write_result(args.out or results / "serving_ceiling.json", res, text)
        return
    if args.fairness:
        fair = {"model": args.model, "checkpoint": str(resolve_checkpoint(source)),
                "num_parameters": model.num_parameters, "duration_s": args.duration,
                "scenarios": run_fairness(name, source, args, texts), "running_beside": args.note,
                "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                            "load_avg_at_end": os.getloadavg()},
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        text = fairness_markdown(fair)
        print(text)
        write_result(args.out or results / "serving_fairness.json", fair, text)
        return
    args.out = args.out or results / "serving.json"
    runs = {}
    for key, batch, delay in (("batching_on", args.batch_size, args.max_batch_delay), ("batching_off", 1, 0)):
        opts = ArchiveOptions(batch_size=batch, max_batch_delay=delay, threads=args.threads)
        runs[key] = run_setting(name, source, opts, args, texts, mixed=key == "batching_on" and not args.no_mixed)
        print(f"{key}: {runs[key]['requests_per_s']:.1f} req/s, p50 {runs[key]['p50_ms']:.1f} ms, "
              f"p99 {runs[key]['p99_ms']:.1f} ms, errors {runs[key]['errors']}", flush=True)
    on, off = runs["batching_on"], runs["batching_off"]
    mixed = on.pop("mixed", None)
    if mixed:
        mixed.update(score_clients=args.mixed_score_clients, generate_clients=args.generate_clients,
                     gen_tokens=args.gen_tokens, gen_slice_ms=ArchiveOptions.gen_slice_ms,
                     ratio_p50=mixed["with_generation"]["p50_ms"] / mixed["score_only"]["p50_ms"])
    result = {
        "model": args.model, "checkpoint": str(resolve_checkpoint(source)), "architecture": model.lm.architecture,
        "num_parameters": model.num_parameters, "clients": args.clients, "duration_s": args.duration,
        "request": "POST /predictions/<model> {\"task\": \"score\", \"texts\": [one PTB test sentence]}",
        "runs": runs, "ratio_requests_per_s": on["requests_per_s"] / off["requests_per_s"],
        "ratio_p50": on["p50_ms"] / off["p50_ms"], "mixed": mixed,
        "running_beside": args.note,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_at_end": os.getloadavg()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = readme_text(result)
    print(text)
    write_result(args.out, result, text)
    kinds = on["error_kinds"] + off["error_kinds"]
    if mixed:
        kinds += mixed["score_only"]["error_kinds"] + mixed["with_generation"]["error_kinds"]
    if kinds:
        raise SystemExit(f"errors during the load test: {kinds}")


if __name__ == "__main__":
    main()
