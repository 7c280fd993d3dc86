"""The front door's cost: the same score load through HAProxy and against TorchServe alone (``--no-front-door``).

Two fresh servers, one after the other (same model, archive options, free ports, token auth on), each warmed up,
then ``--clients`` threads score one PTB test sentence per request back to back for ``--duration`` seconds
(``benchmarks/serving.py``'s closed loop). Reported per setting: requests/s, p50/p99 latency, errors; and the
ratios front door / alone. Through the front door every request is a new connection (the proxy checks each
request head before HTTP parsing), which the figure includes.

    python benchmarks/front_door.py                    # the default model, 4 clients, 20 s per setting

Writes benchmarks/results/front_door.json and front_door.md beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import free_ports, load, sentences  # noqa: E402  (benchmarks/serving.py)
from zoo.tools.serve.config import ArchiveOptions, ServerConfig, parse_model_spec  # noqa: E402
from zoo.tools.serve.keys import read_keys  # noqa: E402
from zoo.tools.serve.lifecycle import start_server, stop_server  # noqa: E402


def run(name: str, source: str, front_door: bool, args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    ports = free_ports(4)
    cfg = ServerConfig(inference_port=ports[0], management_port=ports[1], metrics_port=ports[2], worker_port=ports[3],
                       front_door=front_door)
    with tempfile.TemporaryDirectory(prefix="zoo-bench-front-") as tmp:
        start_server([(name, source)], Path(tmp), cfg, ArchiveOptions(threads=args.threads), timeout=300)
        try:
            url = f"{cfg.url('inference')}/predictions/{name}"
            return load(url, read_keys(Path(tmp))["inference"], texts, args.clients, args.duration, args.warmup)
        finally:
            stop_server(Path(tmp))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=ArchiveOptions.threads)
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "front_door.json"))
    args = ap.parse_args()
    name, source = parse_model_spec(args.model)
    texts = sentences()
    runs = {"front door (HAProxy)": run(name, source, True, args, texts),
            "TorchServe alone": run(name, source, False, args, texts)}
    on, off = runs.values()
    result = {"model": args.model, "clients": args.clients, "duration_s": args.duration, "runs": runs,
              "ratio_p50": on["p50_ms"] / off["p50_ms"], "ratio_requests_per_s": on["requests_per_s"] /
              off["requests_per_s"], "running_beside": args.note, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_at_end": os.getloadavg()}}
    rows = ["| setting | requests/s | p50 ms | p99 ms | errors |", "|---|---:|---:|---:|---:|"]
    rows += [f"| {k} | {r['requests_per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} |"
             for k, r in runs.items()]
    beside = f"; running beside: {args.note}" if args.note else ""
    table = (f"Measured {result['date']} ({result['machine']['platform']}, load average at the end "
             f"{result['machine']['load_avg_at_end'][0]:.1f}{beside}):\n\n" + "\n".join(rows) +
             f"\n\nfront door / alone: p50 {result['ratio_p50']:.2f}x, requests/s "
             f"{result['ratio_requests_per_s']:.2f}x; model `{args.model}`, {args.clients} clients x "
             f"{args.duration:.0f} s, one PTB test sentence per score request\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(table, encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
