"""``zoo export NAME --format onnx|torchscript|all [--quantize int8] [--out DIR]``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from zoo.export.common import exports_root
from zoo.export.formats import format_names, get_format


def _size(path: Path) -> str:
    n = path.stat().st_size
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _uncreatable(out: Path) -> str | None:
    """Why the folder ``out`` cannot be made (its nearest existing ancestor is a file, or not writable), or None."""
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def run(args: argparse.Namespace) -> int:
    import zoo
    from zoo.export import export_model

    formats = format_names() if args.format == "all" else (args.format,)
    specs = [get_format(f) for f in formats]
    if args.quantize and not any(args.quantize in s.quantizations for s in specs):
        takers = [n for n in format_names() if args.quantize in get_format(n).quantizations]
        print(f"zoo: error: --quantize {args.quantize} applies to the {' / '.join(takers)} export (use --format "
              f"{takers[0]} or all)", file=sys.stderr)
        return 2
    for spec in specs:  # before the model loads: a plain install has no export toolchain
        missing = [m for m in spec.exporter_requires if importlib.util.find_spec(m) is None]
        if missing:
            print(f"zoo: error: the {spec.name} export needs {', '.join(missing)}: pip install 'alstm-zoo[export]'",
                  file=sys.stderr)
            return 2
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"zoo: error: --out {args.out} is a file, not a folder", file=sys.stderr)
        return 2
    if args.out and (problem := _uncreatable(Path(args.out))):  # before the model loads and the export runs
        print(f"zoo: error: cannot create --out {args.out}: {problem}", file=sys.stderr)
        return 2
    kwargs = {"revision": args.revision} if args.revision else {}
    model = zoo.load(args.model, **kwargs)
    out = Path(args.out) if args.out else exports_root() / model.name
    try:
        results = export_model(model, out, formats=formats, quantize=args.quantize, verify=not args.no_verify,
                               progress=True)
    except (RuntimeError, OSError) as e:  # exporter / quantizer / file system failures: one line, no traceback
        print(f"zoo: error: export of {model.name} failed: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    failed = False
    for fmt, manifest in results.items():
        for fname in manifest["files"].values():
            print(f"{out / fmt / fname}  ({_size(out / fmt / fname)})")
        parity = manifest.get("parity")
        if parity:
            failed |= not parity["passed"]
            print(f"  {fmt} vs eager on (B, T) in {[(r['batch'], r['time']) for r in parity['shapes']]}: "
                  f"max |logit diff| {parity['max_abs_logit_diff']:.2e}, ppl rel diff {parity['ppl_rel_diff']:.2e}, "
                  f"step vs sequence {parity['step_vs_sequence_abs_diff']:.2e} -> "
                  f"{'ok' if parity['passed'] else 'FAILED'}")
            if "int8" in parity:
                q = parity["int8"]
                print(f"  onnx int8 vs eager (random tokens): max |logit diff| {q['max_abs_logit_diff']:.2e}, "
                      f"ppl rel diff {q['ppl_rel_diff']:.2e}")
    print(f"checkpoint sha256 {next(iter(results.values()))['checkpoint_sha256']}")
    if failed:
        print("zoo: error: an export does not match eager PyTorch within tolerance", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    sp = subparsers.add_parser("export", help="export a model to ONNX (sequence + step graphs) and/or TorchScript")
    sp.add_argument("model", help="catalogue name (see `zoo list`), `default`, a checkpoint directory, or "
                    "hf-hub:ORG/NAME[@REVISION]")
    sp.add_argument("--format", default="all", choices=[*format_names(), "all"], help="what to export (default: all)")
    sp.add_argument("--quantize", choices=sorted({q for n in format_names() for q in get_format(n).quantizations}),
                    help="also write dynamically quantised int8 ONNX graphs")
    sp.add_argument("--out", help="output folder (default: $ZOO_EXPORTS_DIR/<model name>: exports/out/ in a checkout, "
                    "else ~/.local/share/alstm-zoo/exports/); formats go to <out>/<format>/")
    sp.add_argument("--revision", help="Hub revision (tag, branch or commit) to load")
    sp.add_argument("--no-verify", action="store_true", help="skip the parity check against eager PyTorch")
    sp.set_defaults(func=run)
