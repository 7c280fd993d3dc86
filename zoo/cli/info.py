"""``zoo info``: a model's description and where it was loaded from."""

from __future__ import annotations

import argparse
import json

from zoo.cli.options import load_model, model_command


def register(subparsers) -> None:
    sp = model_command(subparsers, "info", "describe a model and where it was loaded from")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--directory", action="store_true",
                    help="print only the checkpoint folder (for tools that read it: transformers, lm-eval's "
                         "tokenizer=)")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = load_model(args)
    if args.directory:
        print(getattr(model, "directory", ""))
        return 0
    info = {"name": model.name, "source": model.source, "pinned": model.pinned, "backend": model.backend,
            "device": str(model.device),
            "directory": str(getattr(model, "directory", "")), "architecture": model.lm.architecture,
            "num_parameters": model.num_parameters, "vocab_size": len(model.tokenizer),
            "normalization": model.tokenizer.normalization, "model_args": model.lm.config,
            "dataset": model.config.get("dataset"), "metrics": model.config.get("metrics"),
            # what --dynamic uses: the settings chosen for this model on validation, else the built-in defaults
            "dynamic_eval": dict(model.dynamic_defaults.to_dict(),
                                 source="config.json" if model.config.get("dynamic_eval") else "built-in defaults")}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k}: {json.dumps(v) if isinstance(v, dict) else v}")
    return 0
