"""Option groups that several commands share, written once: the model and how it runs (``--backend``,
``--revision``, ``--precision``, ``--device``), loading it from those options, and dynamic evaluation's options
with the request they make."""

from __future__ import annotations

import argparse

from zoo.backends import backend_names
from zoo.errors import UsageError
from zoo.precision import PRECISIONS


def model_command(subparsers, name: str, help_: str) -> argparse.ArgumentParser:
    """A sub-command that loads one model: its positional ``model`` and the options of how it runs."""
    sp = subparsers.add_parser(name, help=help_)
    sp.add_argument("model", help="catalogue name (see `zoo list`), `default`, a checkpoint directory, or "
                    "hf-hub:ORG/NAME[@REVISION] (a Hub repo outside the catalogue: unpinned)")
    sp.add_argument("--backend", default="eager", choices=backend_names(),
                    help="inference backend (default: eager PyTorch)")
    sp.add_argument("--revision", help="Hub revision (tag, branch or commit) to load")
    sp.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                    help="eager compute precision (default fp32: exact numbers; bf16: bfloat16 GEMMs, "
                         "slightly different numbers, faster only where the CPU runs bf16 faster)")
    sp.add_argument("--device", default="cpu",
                    help="cpu (default), cuda, cuda:N or auto (cuda when there is one); eager backend only")
    return sp


def load_model(args: argparse.Namespace):
    """The model of a :func:`model_command`, its option combinations checked before anything loads."""
    import zoo

    kwargs = {}
    if getattr(args, "revision", None):
        kwargs["revision"] = args.revision
    backend = getattr(args, "backend", "eager") or "eager"
    precision = getattr(args, "precision", None) or "fp32"
    if precision != "fp32" and backend != "eager":
        raise UsageError(f"--precision {precision} applies to the eager backend only, not --backend {backend}")
    from zoo.device import resolve_device

    device = resolve_device(getattr(args, "device", None) or "cpu", "--device")  # (before anything loads)
    if device.type != "cpu" and backend != "eager":
        raise UsageError(f"--backend {backend} runs on the CPU only: use --backend eager with --device {args.device}")
    return zoo.load(args.model, backend=backend, precision=precision, device=device, **kwargs)


def dynamic_options(sp: argparse.ArgumentParser) -> None:
    """``--dynamic`` and the ``--dynamic-*`` settings it takes (read back by :func:`dynamic_request`)."""
    from zoo.dynamic import DEFAULTS, MAX_LR, RULES

    sp.add_argument("--dynamic", action="store_true", help="dynamic evaluation: the weights adapt to the text "
                    "segment by segment, each segment scored before the step that uses it (zoo/dynamic.py), with "
                    "the settings chosen for the model on validation where its config.json has them "
                    "('dynamic_eval'), else the defaults below; a --dynamic-* option changes one")
    # (defaults None: a --dynamic-* option given without --dynamic is refused, not silently ignored)
    sp.add_argument("--dynamic-segment", type=int, help=f"tokens per update (default {DEFAULTS.segment})")
    sp.add_argument("--dynamic-lr", type=float, help=f"step size, at most {MAX_LR:g} (default {DEFAULTS.lr}; a run "
                    "whose weights overflow stops with an error)")
    sp.add_argument("--dynamic-decay", type=float,
                    help=f"decay towards the trained weights, at most 1 (default {DEFAULTS.decay})")
    sp.add_argument("--dynamic-rule", choices=RULES,
                    help="update rule: 'rms' divides the step by the RMS of the model's gradients on its training "
                    "split (computed on first use: needs the dataset) and scales the decay by it; 'sgd' is plain "
                    f"(default {DEFAULTS.rule})")
    sp.add_argument("--dynamic-eps", type=float, help=f"epsilon of the 'rms' rule (default {DEFAULTS.eps})")
    sp.add_argument("--dynamic-stats-tokens", type=int,
                    help="training tokens the 'rms' rule's gradient statistics are collected over (default "
                    f"{DEFAULTS.stats_tokens:,}; at least {DEFAULTS.stats_batch * (DEFAULTS.stats_bptt + 1):,})")


def dynamic_request(args: argparse.Namespace, stream_flags: tuple[str, ...] = ()):
    """The dynamic-evaluation request, checked before the model loads (an ONNX backend would be exported first):
    ``False``, ``True`` (the model's own settings) or the settings the options change (``{"decay": 0.0003}``).
    ``stream_flags``: options of the static protocol that dynamic evaluation replaces (refused with it)."""
    from zoo.dynamic import DEFAULTS

    given = {k: v for k in ("segment", "lr", "decay", "rule", "eps", "stats_tokens")
             if (v := getattr(args, f"dynamic_{k}")) is not None}
    if not args.dynamic:
        if given:
            raise UsageError(f"{', '.join('--dynamic-' + k.replace('_', '-') for k in given)} "
                             f"appl{'ies' if len(given) == 1 else 'y'} only with --dynamic")
        return False
    if args.backend != "eager" or args.precision != "fp32":
        raise UsageError("--dynamic runs on the eager backend in fp32 (it takes gradient steps): drop --backend "
                         "and --precision")
    fixed = [f for f in stream_flags if getattr(args, f, None) is not None]
    if fixed:
        raise UsageError(f"{' and '.join('--' + f.replace('_', '-') for f in fixed)} "
                         f"{'does' if len(fixed) == 1 else 'do'} not apply with --dynamic "
                         "(it scores one stream, batch 1, in --dynamic-segment pieces)")
    try:  # each value checked now; the model's own settings (ZooModel.dynamic_defaults) are what they change
        DEFAULTS.with_changes(given)
    except ValueError as e:
        raise UsageError(f"--dynamic: {e}") from None
    return given or True
