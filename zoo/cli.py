"""The ``zoo`` command line. Bad input exits with status 2 and a one-line message, never a traceback.

Only :class:`zoo.errors.ZooError` counts as bad input; anything else is a bug and exits 1 with its traceback
(``ZOO_DEBUG=1`` shows tracebacks for user errors too). Commands that need a checkout of the repository (``zoo
serve``, ``zoo bundle``, ``zoo publish``) are not part of the library: they are contributed through the
``alstm_zoo.commands`` entry point by ``zoo.tools``, which a plain install does not ship.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from zoo.backends import backend_names
from zoo.datasets import dataset_names
from zoo.errors import HubError, UsageError, ZooError
from zoo.formatting import format_number
from zoo.precision import PRECISIONS

EXIT_USAGE = 2
#: Entry-point group of sub-commands contributed by other packages (``add(subparsers)`` functions).
COMMANDS_GROUP = "alstm_zoo.commands"
#: Commands that live in checkout tooling; named here only to say where to find them when they are missing.
CHECKOUT_COMMANDS = ("serve", "bundle", "publish")


def _load(args: argparse.Namespace):
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


# -- commands ------------------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    from zoo.catalog import catalog
    from zoo.registry import architecture_names

    if args.architectures:
        names = architecture_names()
        print(json.dumps(names) if args.json else "\n".join(names))
        return 0
    cat = catalog()
    models = cat.get("models", {})
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


def cmd_info(args: argparse.Namespace) -> int:
    model = _load(args)
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


def _read_bytes(src: str) -> bytes:
    """A file's (``-``: standard input's) bytes. A source whose first MiB is mostly NUL bytes (binary data, or an
    endless one such as /dev/zero) is refused there, not read to the end first; a shorter input, or a stray NUL
    in text, is left to the text check, which names its line."""
    if src == "-" and sys.stdin is None:  # (started with standard input closed)
        raise UsageError("no standard input to read: give --text or a file")
    f = sys.stdin.buffer if src == "-" else open(src, "rb")  # noqa: SIM115 (closed below unless stdin)
    try:
        head = f.read(1 << 20)
        if len(head) == 1 << 20:  # maybe endless (/dev/zero, /dev/urandom): judge it by its first MiB
            if head.count(b"\x00") * 20 > len(head):
                raise UsageError(f"{src} looks like binary data (NUL bytes): give a text file")
            try:
                codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
            except UnicodeDecodeError as e:
                raise UsageError(f"{src}: not valid UTF-8 (byte {e.start})") from None
        return head + f.read()
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def _read_texts(args: argparse.Namespace) -> list[str]:
    if args.text is not None and args.input is not None:
        raise UsageError("give either --text or an input file, not both")
    if args.text is not None and args.per_line:
        raise UsageError("--per-line splits an input file (or stdin) at its lines; each --text is already one "
                         "text (repeat --text for several)")
    if args.text is not None:
        texts = list(args.text)
        for n, text in enumerate(texts):
            _valid_utf8(text, "--text" if len(texts) == 1 else f"--text #{n + 1}")
    else:
        if args.input == "":  # (an unset shell variable: not a request to read standard input)
            raise UsageError("empty file name: give a file, - for standard input, or --text")
        src = args.input or "-"
        # (waiting silently on a terminal looks like a hang)
        if src == "-" and sys.stdin is not None and sys.stdin.isatty():
            print("zoo: reading the text from the terminal until Ctrl-D (or give --text or a file)", file=sys.stderr)
        try:
            raw = _read_bytes(src)
        except OSError as e:
            raise UsageError(f"cannot read {src}: {e.strerror}") from None
        try:
            content = raw.decode("utf-8").removeprefix("\ufeff")  # (a byte-order mark is not text: not "dropped")
        except UnicodeDecodeError as e:
            raise UsageError(f"{src}: not valid UTF-8 (byte {e.start})") from None
        # lines end at "\n" only (str.splitlines also splits at \f, \x1c-\x1e, \x85, \u2028/9, which would
        # shift every later line number)
        texts = [t.removesuffix("\r") for t in content.removesuffix("\n").split("\n")] if args.per_line \
            else [content]
    if not texts or all(not t.strip() for t in texts):
        raise UsageError("nothing to score: the input is empty")
    if not args.per_line and any(not t.strip() for t in texts):
        raise UsageError("empty text in the input")
    return texts  # with --per-line, blank lines stay in place (reported as skipped) so that line numbers hold


@contextlib.contextmanager
def _in_flags(names: dict[str, str]) -> Iterator[None]:
    """A request-schema error (:class:`InvalidRequest`) in the command line's words: the option (or file) the
    user gave, not the request field ("--max-new-tokens must be ...", not "max_new_tokens must be ...")."""
    from zoo.errors import InvalidRequest

    try:
        yield
    except InvalidRequest as e:
        if e.field not in names:
            raise
        raise UsageError(names[e.field] + e.message[len(e.field):]) from None


def _valid_utf8(text: str, flag: str) -> None:
    """Command-line bytes that are not UTF-8 reach Python as lone surrogates (U+DC80..U+DCFF); say so in bytes
    (the schema would call them unpaired UTF-16 surrogates, true of JSON but not of a command line)."""
    try:
        text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError as e:
        raise UsageError(f"{flag} is not valid UTF-8 (byte {e.start})") from None


def _require(args: argparse.Namespace, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """Refuse out-of-range counts before anything loads, in one line (argparse's ``type=int`` lets 0 and negatives
    through, and they would fail deep inside: a zero batch size, a zero ``--jobs`` waiting forever)."""
    for flags, low, what in ((positive, 1, "a positive integer"), (non_negative, 0, "at least 0")):
        for flag in flags:
            value = getattr(args, flag.lstrip("-").replace("-", "_"))
            if value is not None and not (math.isfinite(value) and value >= low):  # (NaN compares false)
                raise UsageError(f"{flag} must be {what}, got {value}")


def cmd_score(args: argparse.Namespace) -> int:
    _require(args, positive=("--batch-size",))
    lines = _read_texts(args)
    keep = [i for i, t in enumerate(lines) if t.strip()]
    from zoo.service import CLI_LIMITS, parse_score, to_json
    from zoo.validate import check_text

    # the service schema (no size limit on the CLI): NUL, binary data and undecodable argv bytes are refused;
    # with --per-line an error names the file's line
    if args.per_line:
        texts = [check_text(lines[i], f"line {i + 1}")[0] for i in keep]
    else:  # an error names what the user gave: the file, or the --text (which one, when several)
        given = [args.input or "stdin"] if args.text is None else \
            ["--text"] if len(keep) == 1 else [f"--text #{n + 1}" for n in range(len(keep))]
        with _in_flags({f"texts[{j}]": name for j, name in enumerate(given)}):
            texts = list(parse_score({"texts": [lines[i] for i in keep]}, CLI_LIMITS).texts)
    dynamic = _dynamic(args)
    model = _load(args)
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
    for i, res in enumerate(report.texts):
        head = (f"line {keep[i] + 1}: " if args.per_line else f"text {i + 1}: ") if len(report) > 1 else ""
        bpc = res["bits_per_input_char"]
        print(f"{head}ppl {res['ppl']:.3f}  tokens {res['num_tokens']}  <unk> {res['num_unk']}  oov {res['oov']}  "
              f"nll {res['nll']:.3f} nats  bits/token {res['bits_per_token']:.4f}"
              + (f"  bits/input char {bpc:.4f}" if bpc is not None else "")
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
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from zoo.service import CLI_LIMITS, Service, parse_generate

    _valid_utf8(args.prompt, "--prompt")
    with _in_flags({"prompt": "--prompt", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                    "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"}):
        req = parse_generate({"prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
                              "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                              "seed": args.seed, "stop_at_eos": args.stop_at_eos, "allow_unk": not args.no_unk},
                             CLI_LIMITS)  # checked before the model loads
    pieces = Service(_load(args), CLI_LIMITS).stream(req)
    if args.json:
        parts = list(pieces)
        print(json.dumps({"prompt": args.prompt, "text": "".join(parts), "num_tokens": len(parts)}))
        return 0
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    _require(args, positive=("--batch-size", "--bptt"))
    dynamic = _dynamic(args, stream_flags=("batch_size", "bptt"))
    model = _load(args)
    res = model.evaluate(args.dataset, args.split, data_dir=args.data_dir, batch_size=args.batch_size,
                         bptt=args.bptt, dynamic=dynamic)
    res["model"] = model.name
    if args.json:
        from zoo.service import to_json

        print(to_json(res).decode("utf-8"))
    else:
        # a character model's bits per predicted symbol is what its card (and the papers) call bits per character
        extra = f"  bits/symbol (the card's bpc) {res['bits_per_token']:.4f}" if model.tokenizer.is_char else ""
        print(f"{model.name} {res['dataset']}/{args.split}: ppl {res['ppl']:.3f}  avg nll {res['avg_nll']:.4f}  "
              f"tokens {res['num_tokens']}{extra}")
    return 0


def _train_parallel(args: argparse.Namespace) -> int:
    """Run several recipes as separate processes, ``--jobs`` at a time, each logging to its run dir."""
    import signal
    import subprocess
    import time

    from zoo.training import Recipe, recipe_path

    pending = [recipe_path(r) for r in args.recipe]
    names = [Recipe.load(path).name for path in pending]
    if len(set(names)) < len(names):  # two processes would share one run dir (the second is refused by its lock)
        raise UsageError(f"a recipe is named twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    for path in pending:   # refuse before starting anything: a batch never half-starts
        _check_run_dir(Path(args.run_dir or "runs") / Recipe.load(path).name, args, clear=False)
    running: list[tuple[subprocess.Popen, str]] = []
    run_dirs: dict[str, Path] = {}
    failed = []
    passthrough = [f for flag, val in (("--data-dir", args.data_dir), ("--device", args.device),
                                       ("--epochs", args.epochs), ("--max-minutes", args.max_minutes),
                                       ("--pause-after-minutes", args.pause_after_minutes),
                                       ("--precision", args.precision), ("--log-every-steps", args.log_every_steps))
                   if val is not None for f in (flag, str(val))] + (["--resume"] if args.resume else []) \
        + (["--restart"] if args.restart else []) \
        + [f for target in args.log_to or () for f in ("--log-to", target)]
    # Why: each child would otherwise start one intra-op thread per core, and N jobs on the same cores
    # then fight over them; split the cores between the jobs unless the caller chose a thread count. Two one-thread
    # runs side by side beat one two-thread run at a time in total tokens/s for the tier recipes (the recurrent
    # GEMMs are too small to use two threads well; benchmarks/precision.py --layout measures it).
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.jobs)))
    # SIGTERM / Ctrl-C: pass SIGTERM on to the running children (each checkpoints and stops), start nothing new
    stop = []

    def on_signal(signum: int, frame: object) -> None:
        stop.append(signum)
        pending.clear()
        for proc, _ in running:
            proc.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while pending or running:
        while pending and len(running) < args.jobs:
            path = pending.pop(0)
            name = Recipe.load(path).name
            run_dir = Path(args.run_dir or "runs") / name
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir / "stdout.log", "a")
            cmd = [sys.executable, "-m", "zoo.cli", "train", str(path), "--run-dir", str(run_dir), *passthrough]
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), name))
            run_dirs[name] = run_dir
            print(f"started {name} -> {run_dir}/stdout.log", flush=True)
        for proc, name in list(running):
            if proc.poll() is not None:
                running.remove((proc, name))
                how = "FAILED" if proc.returncode else "finished" if (run_dirs[name] / "eval.json").is_file() \
                    else "paused (--pause-after-minutes; continue with --resume)"
                print(f"{how} {name} (exit {proc.returncode})", flush=True)
                if proc.returncode:
                    failed.append(name)
        time.sleep(1)
    if stop:
        print(f"stopped by {signal.Signals(stop[0]).name}: continue with the same command and --resume", flush=True)
        return 128 + stop[0]
    return 1 if failed else 0


def _check_run_dir(run_dir: Path, args: argparse.Namespace, clear: bool = True) -> None:
    """A plain ``zoo train`` into a folder that holds an earlier run would replace its log and checkpoints: refuse
    unless the caller said which they meant (``--resume`` continues it, ``--restart`` removes it and starts over)."""
    from zoo.training import clear_run, run_products

    if args.resume and args.restart:
        raise UsageError("--resume and --restart exclude each other")
    found = run_products(run_dir)
    if found and not args.resume:
        if not args.restart:
            raise UsageError(f"{run_dir} already holds a run ({', '.join(found)}): continue it with --resume, or "
                             "start over with --restart (removes them)")
        if clear:
            clear_run(run_dir)


def cmd_train(args: argparse.Namespace) -> int:
    from zoo.training import Interrupted, Recipe, Trainer, recipe_path

    _require(args, positive=("--jobs", "--epochs", "--log-every-steps"),
             non_negative=("--max-minutes", "--pause-after-minutes"))
    if len(args.recipe) > 1:
        return _train_parallel(args)
    recipe = Recipe.load(recipe_path(args.recipe[0]))  # a missing or malformed recipe is a ZooError: one line
    if args.epochs:
        recipe.train.epochs = args.epochs
    if args.max_minutes is not None:
        recipe.train.max_minutes = args.max_minutes
    if args.precision is not None:
        recipe.train.precision = args.precision
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / recipe.name
    _check_run_dir(run_dir, args)
    try:
        trainer = Trainer(recipe, run_dir, data_dir=args.data_dir, device=args.device, log_to=tuple(args.log_to or ()),
                          log_every_steps=args.log_every_steps, cuda_graphs=args.cuda_graphs,
                          pause_after_minutes=args.pause_after_minutes or 0.0)
    except ValueError as e:      # options this run cannot take (--cuda-graphs on a CPU, a bad log target, ...)
        raise UsageError(str(e)) from None
    try:
        result = trainer.run(resume=args.resume)
    except Interrupted as e:
        print(f"zoo train: {e}", file=sys.stderr)
        return 128 + e.signum
    if result and result.get("paused"):
        print(json.dumps({"run_dir": str(run_dir), "paused_after_epoch": result["epochs_trained"],
                          "recipe_epochs": result["epochs"], "valid_ppl": result["valid_ppl"]}))
        print("zoo train: paused at an epoch end (--pause-after-minutes); continue with --resume",
              file=sys.stderr)
    elif result:
        print(json.dumps({"run_dir": str(run_dir), "valid_ppl": result["valid"]["ppl"],
                          "test_ppl": result["test"]["ppl"], "epochs": result["epochs_trained"]}))
    return 0


def _dynamic_options(sp: argparse.ArgumentParser) -> None:
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


def _dynamic(args: argparse.Namespace, stream_flags: tuple[str, ...] = ()):
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


def cmd_download(args: argparse.Namespace) -> int:
    from zoo.catalog import release
    from zoo.hub import HF_PREFIX, download, download_to, resolve

    if Path(args.model).is_dir():
        raise UsageError(f"{args.model} is a local folder: download takes a catalogue name or hf-hub:ORG/NAME (the "
                         "other commands take a checkpoint folder as it is)")
    if args.model.startswith(HF_PREFIX):
        if args.local_dir or args.force:
            raise UsageError("--local-dir and --force apply to catalogue names; hf-hub: repos go to the Hub cache")
        folder, source = resolve(args.model, revision=args.revision, source="hub")
        print(f"{args.model}: {source} -> {folder}")
        return 0
    if args.local_dir:
        target = download_to(args.model, args.local_dir, revision=args.revision, force=args.force)
        print(f"{args.model}: verified {len(release(args.model, args.revision).files)} files -> {target}")
        return 0
    folder, source = download(args.model, args.revision, force=args.force)
    rel = release(args.model, args.revision)
    if not rel.files:
        raise HubError(f"{rel.name}: the catalogue pins no files")
    print(f"{rel.name}: {rel.repo_id}@{rel.revision} from the {source.replace('hub ', '')}, sha256 verified for "
          f"{len(rel.files)} files -> {folder}")
    return 0


def cmd_build_ext(args: argparse.Namespace) -> int:
    from zoo.models._compiled import build_all

    return build_all(verbose=args.verbose)


# -- parser --------------------------------------------------------------------------------------------------
class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2) like every other error of the CLI: the usage block it
    prints by default buries the message, and scripts reading stderr get one line to show. The subcommands'
    parsers are of this class too (``add_subparsers`` makes them with the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from zoo.generation import MAX_NEW_TOKENS_LIMIT, MAX_TEMPERATURE

    p = OneLineParser(prog="zoo", description="Adaptive-parameterization language models: "
                      "pretrained weights, scoring, generation, training.")
    sub = p.add_subparsers(dest="command", required=True)

    def model_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
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

    sp = sub.add_parser("list", help="list pretrained models")
    sp.add_argument("--architectures", action="store_true", help="list the registered architectures instead")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_list)

    sp = model_cmd("info", "describe a model and where it was loaded from")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_info)

    sp = model_cmd("score", "score text: perplexity, bits per char, per-token log-probabilities")
    sp.add_argument("input", nargs="?", help="a UTF-8 file, or - for standard input")
    sp.add_argument("--text", action="append", help="text to score (repeatable: one result per text)")
    sp.add_argument("--per-line", action="store_true",
                    help="score each line of the input separately (with --json each object has its \"line\" "
                    "number; a blank line gives {\"line\": N, \"skipped\": \"blank\"})")
    sp.add_argument("--tokens", action="store_true", help="include per-token log-probabilities")
    sp.add_argument("--json", action="store_true", help="one JSON object per text")
    sp.add_argument("--batch-size", type=int, default=16, help="texts scored in parallel (default 16; the scores agree "
                    "to float tolerance at any batch size)")
    _dynamic_options(sp)
    sp.set_defaults(func=cmd_score)

    sp = model_cmd("generate", "sample text")
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
    sp.set_defaults(func=cmd_generate)

    sp = model_cmd("eval", "standard corpus perplexity of a benchmark split")
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
    _dynamic_options(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("train", help="train a recipe (resumable)")
    sp.add_argument("recipe", nargs="+", help="recipe .toml file(s) or bundled recipe name(s)")
    sp.add_argument("--jobs", type=int, default=1, help="with several recipes: how many train at once")
    sp.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    sp.add_argument("--restart", action="store_true", help="start over in a run dir that holds an earlier run "
                    "(removes its checkpoints, log and results; without --resume or --restart such a dir is refused)")
    sp.add_argument("--run-dir", help="output folder (default: runs/<recipe name>); with several recipes, the "
                    "folder their run dirs go in (RUN_DIR/<recipe name>)")
    sp.add_argument("--data-dir")
    sp.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    sp.add_argument("--epochs", type=int, help="override the recipe's epoch count")
    sp.add_argument("--max-minutes", type=float, help="stop cleanly at the first epoch end past this budget "
                    "(minutes of training; 0: no budget, also cancelling a recipe's own)")
    sp.add_argument("--pause-after-minutes", type=float,
                    help="train one piece of a longer run: stop at the first epoch end past this many minutes of "
                         "this process, checkpointed and not finished (no test evaluation); --resume continues")
    sp.add_argument("--precision", choices=list(PRECISIONS),
                    help="compute precision of training (default: the recipe's, else fp32); bf16 is mixed "
                         "precision with float32 weights and checkpoints (see zoo/precision.py)")
    sp.add_argument("--log-to", action="append", choices=["tensorboard"],
                    help="also log to TensorBoard (RUN_DIR/tensorboard: step-level loss and lr, epoch validation; "
                         "log.jsonl stays the source of record); view with `tensorboard --logdir runs`")
    sp.add_argument("--log-every-steps", type=int, default=50, help="steps between TensorBoard loss points")
    sp.add_argument("--cuda-graphs", action="store_true",
                    help="on a GPU: replay each update from a CUDA graph captured once per BPTT length (same "
                         "arithmetic, one launch per step; stream-mode recipes, one process; zoo/captured_step.py)")
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("download", help="fetch a pretrained model from the Hub into the cache (verified)")
    sp.add_argument("model", help="catalogue name (see `zoo list`), `default`, or hf-hub:ORG/NAME[@REVISION]")
    sp.add_argument("--revision", help="Hub revision (tag, branch or commit; default: the catalogue's pinned tag)")
    sp.add_argument("--local-dir", help="also copy the verified files into this (new or empty) folder")
    sp.add_argument("--force", action="store_true", help="download again even if the cache holds it")
    sp.set_defaults(func=cmd_download)

    from zoo.export.cli import add as add_export

    add_export(sub)

    sp = sub.add_parser("build-ext", help="compile the C++ inference loops now (else: on first use)")
    sp.add_argument("-v", "--verbose", action="store_true", help="show the compiler's output")
    sp.set_defaults(func=cmd_build_ext)
    p.subparsers = sub  # plugins add their commands here (see main)
    return p


def _plugin_commands() -> list[Any]:
    """``add(subparsers)`` functions registered under :data:`COMMANDS_GROUP`; a plugin that fails to import (the
    checkout tooling in a plain install) is left out, and its commands answer with where to find them."""
    from importlib.metadata import entry_points

    found = []
    for ep in entry_points(group=COMMANDS_GROUP):
        try:
            found.append(ep.load())
        except ImportError:
            continue
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("ZOO_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    parser = build_parser()
    for add in _plugin_commands():
        add(parser.subparsers)
    if argv and argv[0] in CHECKOUT_COMMANDS and argv[0] not in parser.subparsers.choices:
        print(f"zoo: error: `zoo {argv[0]}` is checkout tooling (zoo.tools), not part of the installed library: "
              "run it from a clone of the repository (`make venv`)", file=sys.stderr)
        return EXIT_USAGE
    command = parser.subparsers.choices.get(argv[0]) if argv else None
    if command is not None and command._subparsers is None:
        # options and positionals in any order: `zoo score M --text hi FILE` reached the plain parser's
        # "unrecognized arguments: FILE" (argparse fills an optional positional before the options that follow)
        args = command.parse_intermixed_args(argv[1:])
        args.command = argv[0]
    else:
        args = parser.parse_args(argv)
    import torch

    torch.set_flush_denormal(True)
    try:
        return args.func(args) or 0
    except ZooError as e:
        if debug:
            raise
        print(f"zoo: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("zoo: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
