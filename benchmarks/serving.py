"""Load test of the TorchServe deployment on loopback: batching on vs off.

For each setting a fresh server is started (``zoo.tools.serve.start_server``: token auth on, its own run dir
and free ports), warmed up, then ``--clients`` threads each send score requests back to back for
``--duration`` seconds: one PTB test sentence per request (``{"task": "score", "texts": [s]}``),
cycling through the test set. Reported: requests/s, p50/p99 latency, errors (any non-200 reply or
exception: must be 0), and the mean batch size the handler saw (its ``X-Zoo-Batch-Size`` header).

    python benchmarks/serving.py                      # the default model, 16 clients, 30 s per setting
    python benchmarks/serving.py --model path/to/ckpt --duration 10

Writes benchmarks/results/serving.json and the markdown table next to it (serving.md), prints the table,
then regenerates the READMEs (``python -m zoo.tools.readme``: the ``serving-benchmark`` section of
serving/README.md). Clients and server share the machine, so absolute numbers depend on its load; the
on/off ratio is the comparable figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests
from tqdm.auto import tqdm

from zoo.data import DataError, corpus_files
from zoo.pretrained import ZooModel
from zoo.tools.readme import write_result
from zoo.tools.serve import (
    ArchiveOptions,
    ServerConfig,
    parse_model_spec,
    read_keys,
    resolve_checkpoint,
    start_server,
    stop_server,
)

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
    socks = []
    try:
        while len(socks) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] in (8080, 8081, 8082):
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def load(url: str, key: str, texts: list[str], clients: int, seconds: float, warmup: float) -> dict[str, Any]:
    """Closed-loop load: each client sends its next request as soon as the previous one returns."""
    lock = threading.Lock()
    latencies: list[float] = []
    batch_sizes: list[int] = []
    errors: list[str] = []
    start = time.perf_counter() + warmup
    stop_at = start + seconds

    def client(idx: int) -> None:
        http = requests.Session()
        http.trust_env = False
        headers = {"Authorization": f"Bearer {key}"}
        i = idx
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            body = {"task": "score", "texts": [texts[i % len(texts)]]}
            i += clients
            try:
                r = http.post(url, json=body, headers=headers, timeout=60)
                ok, note = r.status_code == 200, f"HTTP {r.status_code}"
                batch = int(r.headers.get("X-Zoo-Batch-Size", 0))
            except requests.RequestException as e:
                ok, note, batch = False, type(e).__name__, 0
            t1 = time.perf_counter()
            if t0 < start:  # warm-up requests are not counted
                continue
            with lock:
                if ok:
                    latencies.append(t1 - t0)
                    batch_sizes.append(batch)
                else:
                    errors.append(note)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    with tqdm(total=int(warmup + seconds), desc="load", unit="s", leave=False) as bar:
        while any(t.is_alive() for t in threads):
            time.sleep(1)
            bar.update(1)
    for t in threads:
        t.join()
    return {"requests": len(latencies), "errors": len(errors), "error_kinds": sorted(set(errors)),
            "requests_per_s": len(latencies) / seconds,
            "p50_ms": 1000 * percentile(latencies, 0.50), "p99_ms": 1000 * percentile(latencies, 0.99),
            "mean_batch_size": sum(batch_sizes) / len(batch_sizes) if batch_sizes else float("nan")}


def run_setting(name: str, source: str, opts: ArchiveOptions, args: argparse.Namespace,
                texts: list[str]) -> dict[str, Any]:
    ports = free_ports(4)
    cfg = ServerConfig(inference_port=ports[0], management_port=ports[1], metrics_port=ports[2], worker_port=ports[3])
    with tempfile.TemporaryDirectory(prefix="zoo-bench-serve-") as tmp:
        run_dir = Path(tmp)
        print(f"starting server: batch_size={opts.batch_size} max_batch_delay={opts.max_batch_delay} ms", flush=True)
        start_server([(name, source)], run_dir, cfg, opts, timeout=300)
        try:
            url = f"{cfg.url('inference')}/predictions/{name}"
            res = load(url, read_keys(run_dir)["inference"], texts, args.clients, args.duration, args.warmup)
        finally:
            stop_server(run_dir)
    res.update(batch_size=opts.batch_size, max_batch_delay_ms=opts.max_batch_delay)
    return res


def markdown(result: dict[str, Any]) -> str:
    rows = ["| setting | batch size / delay | requests/s | p50 ms | p99 ms | mean batch | errors |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for key, r in result["runs"].items():
        rows.append(f"| {key.replace('_', ' ')} | {r['batch_size']} / {r['max_batch_delay_ms']} ms | "
                    f"{r['requests_per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                    f"{r['mean_batch_size']:.2f} | {r['errors']} |")
    rows.append(f"\nbatching on / off: {result['ratio_requests_per_s']:.2f}x requests/s, "
                f"p50 {result['ratio_p50']:.2f}x; model `{result['model']}` ({result['num_parameters']:,} "
                f"parameters), {result['clients']} clients x {result['duration_s']:.0f} s, "
                f"{result['machine']['cpu_count']} CPUs")
    return "\n".join(rows)


def readme_text(result: dict[str, Any]) -> str:
    """What serving.md holds (and the serving README shows): the conditions, then the table."""
    return (f"Measured {result['date']} ({result['machine']['platform']}, load average at the end "
            f"{result['machine']['load_avg_at_end'][0]:.1f}):\n\n{markdown(result)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="catalogue name, `default`, or checkpoint dir")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=30.0, help="measured seconds per setting")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--batch-size", type=int, default=8, help="batch size of the 'batching on' setting")
    ap.add_argument("--max-batch-delay", type=int, default=10, help="ms, 'batching on' setting")
    ap.add_argument("--threads", type=int, default=ArchiveOptions.threads,
                    help="torch threads per worker (0 = torch default)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving.json"))
    args = ap.parse_args()

    name, source = parse_model_spec(args.model)
    model = ZooModel.from_pretrained(resolve_checkpoint(source))
    texts = sentences()
    runs = {}
    for key, batch, delay in (("batching_on", args.batch_size, args.max_batch_delay), ("batching_off", 1, 0)):
        opts = ArchiveOptions(batch_size=batch, max_batch_delay=delay, threads=args.threads)
        runs[key] = run_setting(name, source, opts, args, texts)
        print(f"{key}: {runs[key]['requests_per_s']:.1f} req/s, p50 {runs[key]['p50_ms']:.1f} ms, "
              f"p99 {runs[key]['p99_ms']:.1f} ms, errors {runs[key]['errors']}", flush=True)
    on, off = runs["batching_on"], runs["batching_off"]
    result = {
        "model": args.model, "checkpoint": str(resolve_checkpoint(source)), "architecture": model.lm.architecture,
        "num_parameters": model.num_parameters, "clients": args.clients, "duration_s": args.duration,
        "request": "POST /predictions/<model> {\"task\": \"score\", \"texts\": [one PTB test sentence]}",
        "runs": runs, "ratio_requests_per_s": on["requests_per_s"] / off["requests_per_s"],
        "ratio_p50": on["p50_ms"] / off["p50_ms"],
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_at_end": os.getloadavg()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = readme_text(result)
    print(text)
    write_result(args.out, result, text)
    if on["errors"] or off["errors"]:
        raise SystemExit(f"errors during the load test: {on['error_kinds'] + off['error_kinds']}")


if __name__ == "__main__":
    main()
