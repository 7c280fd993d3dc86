"""``zoo eval``: a benchmark split's corpus perplexity, by the model card's protocol unless told otherwise."""

from __future__ import annotations

import argparse

from zoo.cli.inputs import require
from zoo.cli.options import dynamic_options, dynamic_request, load_model, model_command
from zoo.datasets import dataset_names


def register(subparsers) -> None:
    sp = model_command(subparsers, "eval", "standard corpus perplexity of a benchmark split")
    sp.add_argument("--dataset", choices=dataset_names(),
                    help="corpus (default: the one the model was trained on)")
    sp.add_argument("--split", default="test", choices=["train", "valid", "test"])
    sp.add_argument("--data-dir", help="folder holding <dataset>/{train,valid,test}.txt (default: $ZOO_DATA_DIR; a "
                    "checkout's .venv sets it to ../shared/data)")
    sp.add_argument("--batch-size", type=int, help="streams (or, for a sentence-level model, sentences) scored "
                    "in parallel (default: the model card's protocol from its recipe: the test split at its "
                    "test_batch_size, 1 for the stream models, so the number is the card's; valid and train at "
                    "its eval_batch_size, 10 for most)")
    sp.add_argument("--bptt", type=int, help="chunk length (default: the card's protocol, the recipe's eval_bptt: "
                    "70 for the word models, 100 for the character models)")
    dynamic_options(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require(args, positive=("--batch-size", "--bptt"))
    dynamic = dynamic_request(args, stream_flags=("batch_size", "bptt"))
    model = load_model(args)
    res = model.evaluate(args.dataset, args.split, data_dir=args.data_dir, batch_size=args.batch_size,
                         bptt=args.bptt, dynamic=dynamic)
    res["model"] = model.name
    if args.json:
        from zoo.api.http import to_json

        print(to_json(res).decode("utf-8"))
    else:
        # a character model's bits per predicted symbol is what its card (and the papers) call bits per character
        extra = f"  bits/symbol (the card's bpc) {res['bits_per_token']:.4f}" if model.tokenizer.is_char else ""
        print(f"{model.name} {res['dataset']}/{args.split}: ppl {res['ppl']:.3f}  avg nll {res['avg_nll']:.4f}  "
              f"tokens {res['num_tokens']}{extra}")
    return 0
