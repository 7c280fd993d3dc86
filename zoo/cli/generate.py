"""``zoo generate``: sample a continuation, streamed as it is sampled."""

from __future__ import annotations

import argparse
import json
import sys

from zoo.cli.inputs import in_flags, valid_utf8
from zoo.cli.options import load_model, model_command


def register(subparsers) -> None:
    from zoo.generation import MAX_NEW_TOKENS_LIMIT, MAX_TEMPERATURE

    sp = model_command(subparsers, "generate", "sample text")
    sp.add_argument("--prompt", default="", help="text to continue (default: start of a new sentence)")
    sp.add_argument("--max-new-tokens", type=int, default=50,
                    help=f"tokens to generate, 0..{MAX_NEW_TOKENS_LIMIT} (default 50; an end of sentence counts "
                    "as one and prints as a line break)")
    sp.add_argument("--stop-at-eos", action="store_true", help="stop at the first end of sentence instead")
    sp.add_argument("--no-unk", action="store_true", help="never generate <unk>")
    sp.add_argument("--temperature", type=float, default=1.0,
                    help=f"0 = greedy; else in [1e-6, {MAX_TEMPERATURE:g}]: lower is more conservative (default 1)")
    sp.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    sp.add_argument("--top-p", type=float, default=1.0,
                    help="sample among the most likely tokens whose probability reaches p (nucleus; 1 = all)")
    sp.add_argument("--seed", type=int, help="random seed (default: fresh randomness)")
    sp.add_argument("--json", action="store_true", help="one JSON object: prompt, text, num_tokens")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zoo.api.service import CLI_LIMITS, Service, parse_generate

    valid_utf8(args.prompt, "--prompt")
    with in_flags({"prompt": "--prompt", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                   "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"}):
        req = parse_generate({"prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
                              "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                              "seed": args.seed, "stop_at_eos": args.stop_at_eos, "allow_unk": not args.no_unk},
                             CLI_LIMITS)  # checked before the model loads
    pieces = Service(load_model(args), CLI_LIMITS).stream(req)
    if args.json:
        parts = list(pieces)
        print(json.dumps({"prompt": args.prompt, "text": "".join(parts), "num_tokens": len(parts)}))
        return 0
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
