"""``zoo list``: the catalogue's pretrained models (or the registered architectures)."""

from __future__ import annotations

import argparse
import json

from zoo.formatting import format_number


def register(subparsers) -> None:
    sp = subparsers.add_parser("list", help="list pretrained models")
    sp.add_argument("patterns", nargs="*", metavar="PATTERN",
                    help="only names matching one of these shell-style patterns (e.g. 'alstm-*'): zoo.list_models")
    sp.add_argument("--dataset", action="append", metavar="PATTERN", help="only models of this training corpus")
    sp.add_argument("--arch", action="append", metavar="PATTERN", help="only models of this architecture")
    sp.add_argument("--architectures", action="store_true", help="list the registered architectures instead")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zoo.catalog import catalog, list_models
    from zoo.registry import architecture_names

    if args.architectures:
        names = architecture_names()
        print(json.dumps(names) if args.json else "\n".join(names))
        return 0
    cat = catalog()
    chosen = list_models(args.patterns, dataset=args.dataset, architecture=args.arch)
    models = {name: cat["models"][name] for name in chosen}
    if args.json:
        print(json.dumps({"default": cat.get("default"), "models": models}, indent=2))
        return 0
    print(f"{'name':40s} {'arch':10s} {'data':11s} {'params':>11s} {'valid':>8s} {'test':>8s}  metric")
    for name, m in sorted(models.items()):
        met = m.get("metrics", {})
        flag = " (default)" if name == cat.get("default") else ""
        print(f"{name:40s} {m.get('architecture', ''):10s} {m.get('dataset', ''):11s} "
              f"{m.get('num_parameters', 0):>11,} {format_number(met.get('valid'), 4, 'nan'):>8s} "
              f"{format_number(met.get('test'), 4, 'nan'):>8s}  {met.get('metric', '')}{flag}")
    return 0
