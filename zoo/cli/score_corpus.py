"""``zoo score-corpus``: every document of JSONL, Parquet or plain-text files scored into one output file per input
shard plus ``summary.json``, on this machine's cores or a Ray cluster; rerun the same command to finish an
interrupted job (:mod:`zoo.corpus`)."""

from __future__ import annotations

import argparse
import json

from zoo.cli.inputs import require
from zoo.cli.options import model_command


def register(subparsers) -> None:
    sp = model_command(subparsers, "score-corpus", "score every document of JSONL / Parquet / text files into "
                       "per-shard Parquet or JSONL files and a summary (resumable; local cores or a Ray cluster)")
    sp.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="files, folders or globs (.jsonl, .parquet, .txt, optionally .gz/.zst...), local paths or "
                    "fsspec URLs; each file is one shard")
    sp.add_argument("--output", "-o", required=True, help="output folder (a rerun into it finishes what is missing)")
    sp.add_argument("--text-field", default="text", help="the field holding the text (default: text)")
    sp.add_argument("--id-field", help="a field to copy into each result's id (default: SHARD/RECORD)")
    sp.add_argument("--text-unit", choices=("file", "line"), default="file",
                    help="plain-text inputs: one document per file (default) or per line")
    sp.add_argument("--keep-columns", action="store_true", help="copy the input's fields into the output rows")
    sp.add_argument("--format", choices=("parquet", "jsonl"), default="parquet",
                    help="output format (default parquet)")
    sp.add_argument("--workers", type=int,
                    help="processes on this machine (default: one per core) or, with --ray-address, Ray actors "
                    "(default: as many as the cluster's CPUs, or GPUs, hold)")
    sp.add_argument("--ray-address", help="run on an existing Ray cluster: auto, or HOST:PORT of its head")
    sp.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray: CPUs per actor (default 1)")
    sp.add_argument("--gpus-per-worker", type=float,
                    help="Ray: GPUs per actor (default 1 with a cuda --device, else 0)")
    sp.add_argument("--batch-size", type=int, default=16, help="texts scored in parallel within a worker "
                    "(default 16; the scores agree to float tolerance at any batch size)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require(args, positive=("--batch-size", "--workers"))
    from zoo.corpus import score_corpus

    summary = score_corpus(args.model, args.inputs, args.output, text_field=args.text_field, id_field=args.id_field,
                           text_unit=args.text_unit, keep_columns=args.keep_columns, format=args.format,
                           workers=args.workers, ray_address=args.ray_address, cpus_per_worker=args.cpus_per_worker,
                           gpus_per_worker=args.gpus_per_worker, batch_size=args.batch_size, backend=args.backend,
                           precision=args.precision, device=args.device, revision=args.revision,
                           progress=not args.no_progress)
    c, r = summary["corpus"], summary["run"]
    print(f"{summary['documents']:,} documents in {summary['shards']} shard(s): {summary['scored']:,} scored, "
          f"{summary['num_errors']:,} with errors"
          + (f" ({', '.join(f'{k} {v}' for k, v in summary['errors'].items() if v)})" if summary["num_errors"] else ""))
    if c:
        print(f"corpus: ppl {c['ppl']:.3f}  tokens {c['num_tokens']:,}  bits/input char "
              f"{c['bits_per_input_char']:.4f}" if c["bits_per_input_char"] is not None else
              f"corpus: ppl {c['ppl']:.3f}  tokens {c['num_tokens']:,}")
    print(f"this run: {r['shards_scored']} shard(s) scored, {r['shards_skipped']} already done, {r['tokens']:,} tokens "
          f"in {r['seconds']:.1f} s ({r['tokens_per_s'] or 0:,.0f} tokens/s)")
    print(f"summary: {json.dumps(str(args.output))[1:-1]}/summary.json")
    return 0
