"""``zoo score``: perplexity, bits per character and per-token log-probabilities of texts."""

from __future__ import annotations

import argparse

from zoo.cli.inputs import in_flags, read_texts, require
from zoo.cli.options import dynamic_options, dynamic_request, load_model, model_command


def register(subparsers) -> None:
    sp = model_command(subparsers, "score", "score text: perplexity, bits per char, per-token log-probabilities")
    sp.add_argument("input", nargs="?", help="a UTF-8 file, or - for standard input")
    sp.add_argument("--text", action="append", help="text to score (repeatable: one result per text)")
    sp.add_argument("--per-line", action="store_true",
                    help="score each line of the input separately (with --json each object has its \"line\" "
                    "number; a blank line gives {\"line\": N, \"skipped\": \"blank\"})")
    sp.add_argument("--tokens", action="store_true", help="include per-token log-probabilities")
    sp.add_argument("--json", action="store_true", help="one JSON object per text")
    sp.add_argument("--batch-size", type=int, default=16, help="texts scored in parallel (default 16; the scores agree "
                    "to float tolerance at any batch size)")
    dynamic_options(sp)
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require(args, positive=("--batch-size",))
    lines = read_texts(args)
    keep = [i for i, t in enumerate(lines) if t.strip()]
    from zoo.api.http import to_json
    from zoo.api.service import CLI_LIMITS, parse_score
    from zoo.validate import check_text

    # the service schema (no size limit on the CLI): NUL, binary data and undecodable argv bytes are refused;
    # with --per-line an error names the file's line
    if args.per_line:
        texts = [check_text(lines[i], f"line {i + 1}")[0] for i in keep]
    else:  # an error names what the user gave: the file, or the --text (which one, when several)
        given = [args.input or "stdin"] if args.text is None else \
            ["--text"] if len(keep) == 1 else [f"--text #{n + 1}" for n in range(len(keep))]
        with in_flags({f"texts[{j}]": name for j, name in enumerate(given)}):
            texts = list(parse_score({"texts": [lines[i] for i in keep]}, CLI_LIMITS).texts)
    dynamic = dynamic_request(args)
    model = load_model(args)
    report = model.score(texts, return_tokens=args.tokens, batch_size=args.batch_size, progress=True,
                         dynamic=dynamic)
    by_line = dict(zip(keep, report.texts, strict=True))
    if args.json:  # one object per text; with --per-line one per input line, numbered from 1 (strict JSON:
        for i in range(len(lines)) if args.per_line else keep:  # an infinite perplexity is null, as over HTTP)
            res = by_line.get(i)
            if args.per_line:
                res = {"line": i + 1, **res} if res is not None else {"line": i + 1, "skipped": "blank"}
            print(to_json(res).decode("utf-8"))
        return 0
    _print_report(report, keep, args)
    return 0


def _print_report(report, keep: list[int], args: argparse.Namespace) -> None:
    """The human-readable lines: one per text (or input line), its warnings and tokens, then the corpus total."""
    from zoo.scoring import UNSEEN_CHAR_BITS

    for i, res in enumerate(report.texts):
        head = (f"line {keep[i] + 1}: " if args.per_line else f"text {i + 1}: ") if len(report) > 1 else ""
        bpc = res["bits_per_input_char_charged"]  # the rate that compares across tokenisations (zoo.scoring)
        print(f"{head}ppl {res['ppl']:.3f}  tokens {res['num_tokens']}  <unk> {res['num_unk']}  oov {res['oov']}  "
              f"nll {res['nll']:.3f} nats  bits/token {res['bits_per_token']:.4f}"
              + (f"  bits/input char {bpc:.4f} (comparable; {res['num_unseen_chars']} unseen chars charged "
                 f"{UNSEEN_CHAR_BITS:g} bits each)" if bpc is not None else "")
              + (f"  dropped {res['num_dropped']}" if res.get("num_dropped") else ""))
        for w in res.get("warnings", []):
            print(f"  warning: {w}")
        if args.tokens:
            print(f"  {'token':>16s}  {'log-prob (nats)':>15s}")
            for tok in res["tokens"]:
                print(f"  {tok['token']:>16s}  {tok['logprob']:15.4f}")
    if len(report) > 1:
        c = report.corpus
        print(f"all {c['num_texts']} texts: ppl {c['ppl']:.3f}  tokens {c['num_tokens']}  <unk> {c['num_unk']}")
