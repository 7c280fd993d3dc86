"""Training curves from the trainer's ``log.jsonl`` files: validation perplexity against epoch and wall-clock.

    python -m zoo.tools.plots runs/lstm-ptb-zaremba-small --out model_cards/lstm-ptb-zaremba-small-curve.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def log_file(run: str | Path) -> Path:
    """A run's ``log.jsonl``: ``run`` is a run dir, or the log file itself (e.g. ``model_cards/NAME.log.jsonl``)."""
    run = Path(run)
    return run if run.is_file() else run / "log.jsonl"


def run_label(run: str | Path) -> str:
    """The run's name: its directory's, or ``NAME`` of a ``NAME.log.jsonl`` file."""
    run = Path(run)
    if not run.is_file():
        return run.name
    return run.parent.name if run.name == "log.jsonl" else run.name.removesuffix(".log.jsonl")


#: A curve is drawn up to this multiple of the best value plotted; a run above it (diverged) is marked
#: "off scale" in the legend instead of squashing every other curve into the bottom of a log axis.
SCALE_LIMIT = 20.0


def read_log(run_dir: str | Path) -> list[dict]:
    """The per-epoch records of a run (events such as resume or ASGD switches are skipped)."""
    lines = log_file(run_dir).read_text().splitlines()
    return [r for r in map(json.loads, lines) if "valid_ppl" in r and "epoch" in r]


#: Axis labels; ``valid_bpc`` is derived from the logged ``valid_loss`` (nats per character / ln 2).
YLABELS = {"valid_ppl": "validation perplexity", "valid_bpc": "validation bits per character"}


def value(rec: dict, metric: str) -> float:
    return rec["valid_loss"] / math.log(2) if metric == "valid_bpc" else rec[metric]


#: Panel layouts: ``time``: ``metric`` by epoch and by cumulative training minutes (speed and quality together);
#: ``train_valid``: the training loss and ``metric`` both by epoch (the p-norm paper's Fig. 4: how fast each
#: variant learns, on the training set and on validation).
LAYOUTS = ("time", "train_valid")


def plot_curves(run_dirs: list[str | Path], out: str | Path, title: str = "", metric: str = "valid_ppl",
                labels: list[str] | None = None, layout: str = "time") -> Path:
    """Two panels (``layout``, see :data:`LAYOUTS`), one line per run. ``labels`` (one per run) replace the run
    names, e.g. to say where each was trained when a tier mixes hardware: the minutes are then only comparable
    between runs on the same device."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown curve layout {layout!r}: one of {', '.join(LAYOUTS)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = labels if labels is not None else [run_label(run) for run in run_dirs]
    logs = [(name, recs) for run, name in zip(run_dirs, names, strict=True) if (recs := read_log(run))]
    if layout == "train_valid":
        return _plot_train_valid(fig, (ax1, ax2), logs, out, title, metric)
    lo = min((value(r, metric) for _, recs in logs for r in recs), default=1.0)
    hi = max((value(r, metric) for _, recs in logs for r in recs), default=1.0)
    top = min(hi, lo * SCALE_LIMIT)
    for label, recs in logs:
        ys = [value(r, metric) for r in recs]
        if max(ys) > top:
            label += " (off scale)"
        minutes, total = [], 0.0
        for r in recs:
            total += r["seconds"]
            minutes.append(total / 60)
        ax1.plot([r["epoch"] for r in recs], ys, marker="o", ms=3, label=label)
        ax2.plot(minutes, ys, marker="o", ms=3, label=label)
    ylabel = YLABELS.get(metric, metric)
    ax1.set(xlabel="epoch", ylabel=ylabel, yscale="log")
    from matplotlib.ticker import MaxNLocator

    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    ax2.set(xlabel="training minutes (excluding evaluation)", ylabel=ylabel, yscale="log")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(lo / 1.05, top * 1.05)
        label_log_axis(ax, lo, top)
    return _save(fig, ax1, out, title)


def _save(fig, legend_ax, out: str | Path, title: str) -> Path:
    """Legend, title, layout, then the PNG at ``out`` (its folder made); the figure is closed."""
    import matplotlib.pyplot as plt

    legend_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_train_valid(fig, axes, logs: list[tuple[str, list[dict]]], out: str | Path, title: str,
                      metric: str) -> Path:
    """Training loss (nats per token, as logged) and ``metric`` by epoch, one line per run, linear axes."""
    from matplotlib.ticker import MaxNLocator

    ax1, ax2 = axes
    for label, recs in logs:
        epochs = [r["epoch"] for r in recs]
        ax1.plot(epochs, [r["train_loss"] for r in recs], marker="o", ms=3, label=label)
        ax2.plot(epochs, [value(r, metric) for r in recs], marker="o", ms=3, label=label)
    ax1.set(xlabel="epoch", ylabel="training loss (nats per symbol)")
    ax2.set(xlabel="epoch", ylabel=YLABELS.get(metric, metric))
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(fig, ax1, out, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories holding log.jsonl, or log files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--metric", choices=sorted(YLABELS), default="valid_ppl",
                    help="valid_bpc for character-level runs (default: valid_ppl)")
    ap.add_argument("--layout", choices=LAYOUTS, default="time",
                    help="time: the metric by epoch and by training minutes; train_valid: training loss and the "
                         "metric by epoch (the p-norm paper's Fig. 4)")
    args = ap.parse_args()
    print(plot_curves(args.runs, args.out, args.title, metric=args.metric, layout=args.layout))



def label_log_axis(ax, lo: float, hi: float) -> None:
    """Readable numbers on a log-scale y axis: 120, not 1.2 x 10^2, and within less than a decade the minor
    ticks labelled too (a curve from 90 to 300 otherwise shows only "100")."""
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    if hi / max(lo, 1e-12) < 10:  # minor labels only while they cannot crowd
        ax.yaxis.set_minor_formatter(plain)


if __name__ == "__main__":
    main()
