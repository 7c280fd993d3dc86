"""The zoo's models in EleutherAI's lm-evaluation-harness (``lm_eval`` 0.4.x): model ``zoo`` and task files.

Install with the extra: ``pip install 'alstm-zoo[lm-eval]'``. Then the stock harness command works, given the
zoo's task folder (:data:`TASKS_DIR`, printed by ``zoo-lm-eval --tasks-dir``)::

    lm_eval --model zoo --model_args pretrained=alstm-ptb-5m-light --tasks zoo_ptb_test \\
        --include_path "$(zoo-lm-eval --tasks-dir)"

How ``lm_eval`` finds ``--model zoo``: lm_eval 0.4.x has no entry point group for models, but its registry takes
lazy ``"module:Object"`` placeholders. The wheel installs a ``.pth`` file whose start-up hook (the top-level module
``alstm_zoo_lm_eval_hook``: no torch, lm_eval or zoo import; both files are kept in the checkout's
``zoo/tools/lm_eval_hook/``) adds the placeholder ``zoo`` -> ``zoo.lm_eval_plugin:ZooLM`` right after the harness
imports ``lm_eval.models``; this module is imported only when the harness asks for the model
(``ALSTM_ZOO_NO_LM_EVAL_HOOK=1`` turns the hook off).

``zoo-lm-eval`` (also ``python -m zoo.lm_eval_plugin``) is the same harness command line (``lm_eval``'s own
``cli_evaluate``, every flag as documented by the harness) with two additions made before it parses anything:
the model ``zoo`` is registered (without relying on the hook) and :data:`TASKS_DIR` is put on ``--include_path``
(when the command does not name one itself). From Python, importing this module registers the model::

    import lm_eval, zoo.lm_eval_plugin as zp
    from lm_eval.tasks import TaskManager
    lm_eval.simple_evaluate(model="zoo", model_args="pretrained=alstm-ptb-5m-light", tasks=["zoo_ptb_test"],
                            task_manager=TaskManager(include_path=str(zp.TASKS_DIR)))

Conventions (the zoo's, so the harness reproduces the zoo's own numbers):

* ``loglikelihood_rolling``: each document is scored as :meth:`zoo.ZooModel.score` scores a text: from a zero
  state, its first token conditioned on one ``<eos>`` (the harness's BOS/EOS prefix), every token including each
  line's ``<eos>`` counted once, with the state carried over the whole document (an RNN needs no windows).
* ``loglikelihood``: ``log P(continuation | context)`` under the same encoding, and whether every continuation
  token is the arg-max (greedy) one.
* ``generate_until``: greedy unless ``do_sample``; the text is cut before the first ``until`` string; ``<eos>`` is a
  line break, as in the corpora, not a stop.

Every text goes through the model's tokenizer: lower-cased, numbers to ``N``, punctuation dropped (PTB), and every
word outside the closed vocabulary becomes ``<unk>``. See the README's lm-evaluation-harness section for what that
means for harness tasks.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

import zoo
from zoo.data import DATASETS, resolve_data_dir
from zoo.errors import DataError, ZooError
from zoo.generation import (
    MIN_TEMPERATURE,
    Detokenizer,
    Sampler,
    SamplingParams,
    generate_steps,
    prompt_context,
    read_context,
)
from zoo.scoring import LOGIT_BUDGET  # logits held at once (floats): bounds memory for any length

try:
    from lm_eval.api.model import LM
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("the lm-evaluation-harness plugin needs lm_eval: pip install 'alstm-zoo[lm-eval]'") from exc

log = logging.getLogger(__name__)

#: The harness task files shipped with the package (``--include_path`` this folder).
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
#: The harness model name (``--model zoo``).
MODEL_NAME = "zoo"
#: The device lm-eval's command line passes when ``--device`` is not given (lm_eval 0.4.13's ``EvaluatorConfig``).
HARNESS_DEFAULT_DEVICE = "cuda:0"
_PRECISIONS = {None: "fp32", "auto": "fp32", "float32": "fp32", "fp32": "fp32", "float": "fp32",
               "bfloat16": "bf16", "bf16": "bf16"}


def _batch_size(value: int | str | None, default: int = 32) -> int:
    """The harness passes an int, a numeric string or ``auto[:N]``; memory here is bounded by chunking anyway."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return default
    size = int(value)
    if size < 1:
        raise ValueError(f"batch_size must be at least 1, got {value!r}")
    return size


def _harness_default_device(argv: Sequence[str]) -> bool:
    """Whether this process is the harness's command line (``lm_eval``, ``python -m lm_eval``, ``zoo-lm-eval``,
    which runs it as ``lm_eval``) with no ``--device`` on it: then its device is its own default, not the user's."""
    if not argv or Path(str(argv[0])).name not in ("lm_eval", "lm-eval", "__main__.py"):
        return False
    if Path(str(argv[0])).name == "__main__.py" and Path(str(argv[0])).parent.name != "lm_eval":
        return False
    return not any(a == "--device" or a.startswith("--device=") for a in argv[1:])


def harness_device(device: str | None, argv: Sequence[str] | None = None) -> str:
    """The device to load on for the harness's ``device``: as given, except the harness's command-line default
    (:data:`HARNESS_DEFAULT_DEVICE`, passed when the command names no ``--device``; ``argv``: this process's
    ``sys.argv``), which on a machine without CUDA is the CPU, with one note, as the harness's own ``hf`` model
    falls back. A device the user named (``--device cuda:0`` on the command line, any device from Python) is kept,
    so :func:`zoo.load` refuses one this machine lacks in one line."""
    if device is None:
        return "cpu"
    argv = sys.argv if argv is None else argv
    if device == HARNESS_DEFAULT_DEVICE and not torch.cuda.is_available() and _harness_default_device(argv):
        log.warning("no CUDA device here: running on the CPU (lm-eval's default device is %s; pass --device cpu "
                    "to say so)", HARNESS_DEFAULT_DEVICE)
        return "cpu"
    return device


class ZooLM(LM):
    """A :func:`zoo.load` model behind the harness's ``LM`` interface.

    ``pretrained``: a catalogue name (``zoo list``) or a checkpoint directory; ``backend``: ``eager`` (default),
    ``torchscript``, ``onnx`` or ``onnx-int8`` (as :func:`zoo.load`); ``dtype``: ``float32`` (default) or
    ``bfloat16`` (eager only); ``revision``: a Hub revision; ``max_gen_toks``: the default generation length.
    ``device``: the harness's ``--device`` (``cpu``, ``cuda``, ``cuda:N``, ``auto``; none: the CPU), as
    :func:`zoo.load` takes it: one this machine lacks is a :class:`~zoo.errors.DeviceError`, except the harness's
    own default (``cuda:0`` when the command line names no ``--device``), which falls back to the CPU with one note,
    as the harness's ``hf`` model does (:func:`harness_device`). ``batch_size``
    (``auto`` = 32) batches documents; it never changes a score (an RNN is causal). ``trust_remote_code`` (added
    by the harness's flag of that name) is accepted and means nothing here.
    """

    def __init__(self, pretrained: str = "default", backend: str = "eager", dtype: str | None = None,
                 device: str | None = None, batch_size: int | str | None = 32, max_batch_size: int | None = None,
                 max_gen_toks: int = 256, revision: str | None = None, trust_remote_code: bool = False) -> None:
        super().__init__()
        key = dtype.lower() if isinstance(dtype, str) else dtype
        if key not in _PRECISIONS:
            raise ValueError(f"dtype {dtype!r} not supported: use float32 or bfloat16")
        kwargs = {"revision": revision} if revision else {}
        self.model = zoo.load(str(pretrained), backend=backend, precision=_PRECISIONS[key],
                              device=harness_device(device), **kwargs)
        self.batch_size = _batch_size(batch_size)
        if max_batch_size:
            self.batch_size = min(self.batch_size, int(max_batch_size))
        self.max_gen_toks = int(max_gen_toks)
        self._device = self.model.device
        self._empty_continuations = 0

    # -- metadata the harness records -----------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        """Fingerprint of the request cache: the model and its normalisation decide every token."""
        return f"zoo:{self.model.name}:{self.model.tokenizer.normalization}"

    def get_model_info(self) -> dict[str, Any]:
        return {"model_name": self.model.name, "model_source": self.model.source, "backend": self.model.backend,
                "precision": self.model.precision, "model_num_parameters": self.model.num_parameters}

    # -- encoding ----------------------------------------------------------------------------------------------
    def _ids(self, text: str) -> list[int]:
        """Token ids of ``text`` where every newline, a final one included, is an ``<eos>``, and a last line without
        one gets none (it may go on in a continuation): context + continuation encode like their concatenation."""
        return self.model.tokenizer.encode(text, add_eos=text.endswith("\n")).ids

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context ids and continuation ids. The continuation's tokens are those the concatenation adds after the
        context's; when the normalisation joins across the boundary (PTB: ``the u.s`` + ``. economy``: the context
        alone ends in ``<unk>``, the whole text has ``u.s.``) that is not a prefix, and the continuation is then
        encoded on its own."""
        ctx = self._ids(context)
        whole = self._ids(context + continuation)
        if whole[:len(ctx)] == ctx:
            return ctx, whole[len(ctx):]
        return ctx, self._ids(continuation)

    # -- the three request types ----------------------------------------------------------------------------------
    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-probability, scored exactly as ``model.score`` scores a text (see the module
        docstring); documents are batched (an RNN is causal: padding never changes a score)."""
        if not requests:
            return []
        texts = [req.args[0] for req in requests]
        report = self.model.score(texts, batch_size=self.batch_size, progress=not disable_tqdm)
        out = []
        for req, res in zip(requests, report.texts, strict=True):
            ll = -float(res["nll"])
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, ll)
            out.append(ll)
        flagged = sum(1 for r in report.texts if r["warnings"])
        if flagged:
            log.warning("%d of %d documents are mostly outside %s's vocabulary or alphabet (over a quarter <unk> or "
                        "dropped characters): their perplexity means little. Corpus: %s", flagged, len(texts),
                        self.model.name, "; ".join(report.corpus["warnings"]) or "below the threshold overall")
        return out

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log P(continuation | context), is_greedy)`` per request (see :meth:`_score_pairs`)."""
        pairs = [self._encode_pair(*req.args) for req in requests]
        results = self._score_pairs(pairs)
        for req, res in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    @torch.no_grad()
    def _score_pairs(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Score ``[<eos>] + context + continuation`` from a zero state, longest first in batches, in chunks with the
        state carried (bounded memory). A continuation that encodes to nothing (PTB drops ``.``) has probability 1
        and counts as greedy; such requests are counted and reported once, since they say nothing."""
        runner, tok = self.model.runner, self.model.tokenizer
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        empty = 0
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            seqs = [[tok.eos_id, *pairs[i][0], *pairs[i][1]] for i in idx]
            longest = max(len(s) for s in seqs) - 1
            inp = torch.full((len(idx), longest), tok.eos_id, dtype=torch.long)
            tgt = torch.full((len(idx), longest), tok.eos_id, dtype=torch.long)
            for b, seq in enumerate(seqs):
                inp[b, :len(seq) - 1] = torch.tensor(seq[:-1])
                tgt[b, :len(seq) - 1] = torch.tensor(seq[1:])
            logp = torch.empty(len(idx), longest, dtype=torch.float64)
            greedy = torch.empty(len(idx), longest, dtype=torch.bool)
            step = max(1, min(256, LOGIT_BUDGET // max(1, len(idx) * len(tok))))
            state = runner.init_state(len(idx))
            inp, tgt = inp.to(self._device), tgt.to(self._device)
            for t in range(0, longest, step):
                logits, state = runner.forward(inp[:, t:t + step], state)
                lp = torch.log_softmax(logits.float(), dim=-1)
                y = tgt[:, t:t + step, None]
                logp[:, t:t + step] = lp.gather(-1, y).squeeze(-1).double().cpu()
                greedy[:, t:t + step] = (lp.argmax(-1) == y.squeeze(-1)).cpu()
            for b, i in enumerate(idx):
                n_ctx, n_cont = len(pairs[i][0]), len(pairs[i][1])
                empty += n_cont == 0
                span = slice(n_ctx, n_ctx + n_cont)  # targets of the continuation tokens
                out[i] = (float(logp[b, span].sum()), bool(greedy[b, span].all()))
        if empty:
            self._empty_continuations += empty
            log.warning("%d continuations encode to no token for %s (its corpus has no such text, e.g. PTB has no "
                        "punctuation): scored log P = 0", empty, self.model.name)
        return [r for r in out if r is not None]

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """One continuation per ``(context, gen_kwargs)``: ``until`` (a string or list), ``max_gen_toks`` (or
        ``max_new_tokens``), ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``."""
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            text = self._generate(context, **dict(gen_kwargs or {}))
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def _generate(self, context: str, until: str | Iterable[str] | None = None, max_gen_toks: int | None = None,
                  max_new_tokens: int | None = None, do_sample: bool = False, temperature: float | None = None,
                  top_k: int = 0, top_p: float = 1.0, seed: int | None = None, **ignored: Any) -> str:
        """The generated text after ``context``, cut before the earliest ``until`` string. The loop, the sampling
        rule and the spacing are the zoo's own (:func:`zoo.generation.generate_steps`,
        :class:`~zoo.generation.Sampler`, :class:`~zoo.generation.Detokenizer`); here only the harness's arguments
        and stop strings."""
        if ignored:
            log.info("generation settings not used by zoo models: %s", sorted(ignored))
        stops = [s for s in ([until] if isinstance(until, str) else (until or ())) if s]  # "" would stop at once
        limit = int(next(v for v in (max_gen_toks, max_new_tokens, self.max_gen_toks) if v is not None))
        temp = float(temperature if temperature is not None else 1.0) if do_sample else 0.0
        if 0 < temp < MIN_TEMPERATURE:  # logits / temp would overflow to inf and the sampler fail: greedy
            temp = 0.0
        params = SamplingParams(max_new_tokens=0, temperature=temp, top_k=max(0, int(top_k)), top_p=float(top_p),
                                seed=seed)  # (the length is ``limit``, which may exceed the library's own cap)
        runner, tok = self.model.runner, self.model.tokenizer
        ids = prompt_context(tok, context)  # (the same ids as [<eos>, *self._ids(context)])
        state = read_context(runner, ids[:-1], len(tok))  # a long few-shot context in pieces, state carried
        pieces, text = Detokenizer(tok, before=context), ""
        for idx, _ in generate_steps(runner, Sampler(tok, params, ids), state, limit):
            text += pieces.piece(idx)
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:
                return text[:min(hits)]
        return text


# -- task data ---------------------------------------------------------------------------------------------------
def corpus_token_count(text: str) -> int:
    """Tokens the zoo scores in already-normalised corpus text: its whitespace words plus one ``<eos>`` per line
    (the corpora's and ``zoo eval``'s convention, and what :meth:`Tokenizer.encode` yields on such text)."""
    lines = text.split("\n")
    if len(lines) > 1 and lines[-1] == "":
        lines.pop()
    return len(text.split()) + len(lines)


def corpus_documents(zoo_corpus: str, zoo_split: str, zoo_unit: str = "split", zoo_data_dir: str | None = None,
                     **_metadata: Any) -> dict[str, Any]:
    """The task's documents (``custom_dataset`` of the task files), read from the local data dir, never
    downloaded: ``zoo_unit="split"`` gives one document, the split file's whole text; ``"line"`` one document
    per non-empty line (as ``zoo.data.sentences`` leaves empty lines out), with its line end: the ``<eos>`` that
    ends a line is scored and counted (:func:`corpus_token_count`), so the text says so, and every tokenizer reads
    it (transformers' adds a text's last ``<eos>`` only for a final line break; without it lm-eval's ``hf`` model
    scored one token less per line than the denominator counts, 7.6% flattering on PTB). The data dir is
    ``zoo_data_dir`` (pass ``--metadata '{"zoo_data_dir": "..."}'``), else ``$ZOO_DATA_DIR`` (the checkout's venv
    sets it). The harness also passes the model arguments and task metadata here: they are ignored."""
    import datasets

    if zoo_corpus not in DATASETS or zoo_corpus == "ptb-char":
        raise ValueError(f"no harness documents for corpus {zoo_corpus!r}: use ptb or wikitext-2")
    try:
        root = resolve_data_dir(zoo_data_dir)
    except DataError:  # (its own hint names --data-dir, which the harness does not have)
        raise DataError("no data dir for the zoo's harness tasks: set ZOO_DATA_DIR, or pass --metadata "
                        "'{\"zoo_data_dir\": \"...\"}' to lm_eval") from None
    path = root / zoo_corpus / f"{zoo_split}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (set ZOO_DATA_DIR, or --metadata '{{\"zoo_data_dir\": ...}}', "
                                f"to the folder holding {zoo_corpus}/{zoo_split}.txt)")
    text = path.read_text(encoding="utf-8")
    if zoo_unit == "split":
        docs = [text]
    elif zoo_unit == "line":
        docs = [line + "\n" for line in text.split("\n") if line.strip()]
    else:
        raise ValueError(f"zoo_unit must be 'split' or 'line', got {zoo_unit!r}")
    return {zoo_split: datasets.Dataset.from_dict({"text": docs})}


def process_results(doc: dict[str, str], results: tuple[float]) -> dict[str, tuple[float, int]]:
    """Rolling metrics with the zoo's token count: ``word_perplexity`` is per scored token, ``<eos>`` included,
    so it is the perplexity ``zoo eval`` and the papers report for these corpora; the byte metrics are the
    harness's usual ones (UTF-8 bytes of the document)."""
    (loglikelihood,) = results
    nbytes = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, corpus_token_count(doc["text"])),
            "byte_perplexity": (loglikelihood, nbytes), "bits_per_byte": (loglikelihood, nbytes)}


# -- registration and the command line ---------------------------------------------------------------------------
def register() -> None:
    """Register :class:`ZooLM` as the harness model ``zoo`` (idempotent): a new entry, or the start-up hook's lazy
    placeholder (``alstm_zoo_lm_eval_hook.TARGET``) upgraded to the class; a ``zoo`` registered by anyone else is
    left alone. The harness's own models are imported first: lm_eval 0.4.13 fills its registry with them only when
    it finds the registry empty. When the hook's placeholder is materialised, this runs while the module is being
    imported (below) and does the upgrade itself; the harness then stores the same class."""
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry, register_model

    current = dict(model_registry.items()).get(MODEL_NAME)
    if current is None or current == f"{ZooLM.__module__}:{ZooLM.__qualname__}":
        register_model(MODEL_NAME)(ZooLM)


def main(argv: Sequence[str] | None = None) -> None:
    """``zoo-lm-eval ARGS``: run ``lm_eval ARGS`` (the harness's CLI) with the model ``zoo`` registered and
    :data:`TASKS_DIR` as ``--include_path`` unless the command names one (the harness takes a single folder).
    ``zoo-lm-eval --tasks-dir`` prints :data:`TASKS_DIR` and exits, for the stock ``lm_eval``'s ``--include_path``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--tasks-dir" in args:
        print(TASKS_DIR)
        return
    from lm_eval.__main__ import cli_evaluate

    register()
    if args and not {"-h", "--help"} & set(args) and not any(a.startswith("--include_path") for a in args):
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *args]
    try:
        cli_evaluate()
    except ZooError as e:  # (a device this machine lacks, an unknown model: one line, as the zoo's CLI says it)
        print(f"zoo-lm-eval: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "zoo.lm_eval_plugin":  # imported (not run as a script: main() imports this module by name)
    register()

if __name__ == "__main__":
    from zoo.lm_eval_plugin import main as _main

    _main()
