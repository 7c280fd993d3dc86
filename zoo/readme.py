"""Regenerate the README's generated sections from the catalogue and the benchmark results.

The README's numbers must come from files the evaluation and benchmark code wrote, so the sections
between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` are produced here, never edited by hand:

* ``models-table``: from ``zoo/catalog.json`` (itself written by ``zoo bundle`` from each run's eval.json),
  plus the training-curve figures under ``model_cards/``;
* ``benchmarks``: the markdown tables each benchmark wrote next to its JSON in ``benchmarks/results/``.

    python -m zoo.readme          # rewrite README.md
    python -m zoo.readme --check  # exit 1 if README.md is out of date (used by the tests)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = [
    ("cells.md", "Cell speed (training and scoring tokens/s relative to the fused `nn.LSTM`)"),
    ("backends.md", "Inference backends (eager vs TorchScript vs ONNX Runtime)"),
    ("quantization.md", "int8 ONNX quantisation"),
    ("serving.md", "TorchServe under load"),
]


def models_section(repo: Path = REPO) -> str:
    from zoo.cards import models_table_markdown

    parts = [models_table_markdown().strip()]
    curves = sorted((repo / "model_cards").glob("*curve*.png"))
    for png in curves:
        parts.append(f"![{png.stem}](model_cards/{png.name})")
    return "\n\n".join(parts)


def benchmarks_section(repo: Path = REPO) -> str:
    parts = []
    for fname, title in BENCHMARKS:
        path = repo / "benchmarks" / "results" / fname
        if path.is_file():
            parts.append(f"### {title}\n\n{path.read_text().strip()}\n\n_Source: `benchmarks/results/{fname}`._")
    return "\n\n".join(parts) if parts else "_No benchmark results yet: run `make bench`._"


def render(text: str, sections: dict[str, str]) -> str:
    for name, body in sections.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"README has no <!-- {name}:start --> ... <!-- {name}:end --> markers")
        text = pattern.sub(lambda m, b=body: m.group(1) + b.strip() + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if README.md is out of date")
    args = ap.parse_args(argv)
    readme = REPO / "README.md"
    old = readme.read_text()
    new = render(old, {"models-table": models_section(), "benchmarks": benchmarks_section()})
    if args.check:
        if new != old:
            print("README.md is out of date: run `python -m zoo.readme`", file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
