"""Ready-to-use models: ``zoo.load(name_or_path)`` and the :class:`ZooModel` it returns.

Resolution of a name is :func:`zoo.hub.resolve` (which says when the network is used): an explicit local
directory is loaded as is; a catalogue name (``zoo list``, :mod:`zoo.catalog`) resolves to the Hub cache, its
copy bundled in a checkout, or a verified download; ``hf-hub:ORG/NAME[@REVISION]`` loads any compatible Hub
repo. ``default`` is an alias for the catalogue's default model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from zoo.catalog import bundled_dir, canonical_name, catalog, catalog_path, resolve_local  # noqa: F401 (re-exported)
from zoo.checkpoint import load_checkpoint, save_checkpoint
from zoo.data import load_corpus, resolve_data_dir, sentences
from zoo.device import exact_float32, resolve_device
from zoo.dynamic import DEFAULTS as DYNAMIC_DEFAULTS
from zoo.dynamic import DynamicParams, GradStats, dynamic_logprobs, gradient_stats, load_stats, save_stats
from zoo.errors import BackendError, CheckpointError, ConfigError, ModelNotFoundError, WrongType  # noqa: F401
from zoo.files import cache_home
from zoo.generation import SamplingParams, sample_ids, stream_steps, stream_text
from zoo.lm import LanguageModel
from zoo.precision import AutocastRunner
from zoo.precision import check as check_precision
from zoo.scoring import ScoreReport, Steps, evaluate_sentences, evaluate_stream, score_steps, score_texts, summarize
from zoo.tokenizer import Tokenizer
from zoo.validate import check_text


def is_folder_name(name: object) -> bool:
    """Whether ``name`` can name a folder of its own (a model's exports folder): one path component, not hidden
    and not ``..``, so a config's name can never point outside the folder it is joined to."""
    return isinstance(name, str) and 0 < len(name) <= 200 and not name.startswith(".") and not any(
        c in name for c in "/\\\0")


def _check_positive(name: str, value: object) -> None:
    """A batch size or chunk length the caller passed: a positive ``int`` (0 would fail deep in the scoring loop
    with an unrelated message, a float or a bool would be silently truncated or taken as 1)."""
    import operator

    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # an int, or an integer type that says it is one (numpy.int64)
    except TypeError:
        raise WrongType(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value}")


class ZooModel:
    """A language model with its tokenizer: score, generate, evaluate, save.

    ``runner`` is what computes logits: the eager :class:`LanguageModel` by default, or a
    TorchScript / ONNX Runtime backend with the same ``init_state/forward/step`` calls. The eager model runs on
    :attr:`device` (:meth:`to`); on CUDA in fp32 its runner replays the single-token step and the batch-1 scoring
    chunk from CUDA graphs (:mod:`zoo.captured_inference`) unless ``cuda_graphs=False``.
    """

    def __init__(self, lm: LanguageModel, tokenizer: Tokenizer, config: dict[str, Any],
                 source: str = "memory", name: str | None = None, runner: Any = None, backend: str = "eager"):
        self.lm = lm.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.source = source
        self.name = name or config.get("name", "model")
        # a name becomes a folder (the exports of `zoo export`): a config's name must not climb out of it
        if not is_folder_name(self.name):
            raise CheckpointError(f"model name {self.name!r} (config.json 'name') must be a plain name: no path "
                                  "separator, not starting with '.', at most 200 characters")
        self.runner = runner if runner is not None else self.lm
        self.backend = backend
        self.precision = "fp32"
        self.cuda_graphs = True
        self._device = torch.device("cpu")
        self._dynamic_stats: dict[tuple, GradStats] = {}
        try:  # checked at load: a malformed entry is a broken checkpoint, not a surprise at scoring time
            self.dynamic_defaults: DynamicParams = DYNAMIC_DEFAULTS.with_changes(config.get("dynamic_eval") or {})
        except ConfigError as e:
            raise CheckpointError(f"config.json 'dynamic_eval': {e}") from None

    @property
    def pinned(self) -> bool:
        """Whether the files were checked against the catalogue's sha256 pins (bundled or a catalogue release)."""
        return self.source in ("bundled", "hub cache", "hub download")

    @property
    def device(self) -> torch.device:
        """Where the eager model's weights live and its scoring, generation and evaluation run (:meth:`to`)."""
        return self._device

    def to(self, device: str | torch.device, cuda_graphs: bool | None = None) -> ZooModel:
        """Move the model to ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``: CUDA when there is one;
        :func:`zoo.device.resolve_device`); a device this machine lacks is a :class:`~zoo.errors.DeviceError`.
        On CUDA float32 stays float32 (TF32 off, :func:`zoo.device.exact_float32`), so the numbers are the CPU's
        to float rounding; ``cuda_graphs`` (default: as before, on) replays the single-token step and the batch-1
        scoring chunk from CUDA graphs. Exports (TorchScript / ONNX Runtime) run on the CPU only."""
        target = resolve_device(device)
        if cuda_graphs is not None:
            if not isinstance(cuda_graphs, bool):
                raise WrongType(f"cuda_graphs must be a bool, got {type(cuda_graphs).__name__}")
            self.cuda_graphs = cuda_graphs
        if target.type != "cpu" and self.backend != "eager":
            raise BackendError(f"the {self.backend!r} backend runs on the CPU only (device {str(device)!r}): use the "
                               "eager backend on CUDA")
        exact_float32(target)
        self.lm.to(target)
        self._device = target
        return self.set_precision(self.precision)

    def set_precision(self, precision: str) -> ZooModel:
        """Compute precision of eager scoring and generation: ``"fp32"`` (default: exact numbers) or ``"bf16"``
        (bfloat16 GEMMs, see :mod:`zoo.precision`; the perplexity changes slightly; whether it is faster depends
        on the CPU, and on a GPU it speeds up batched scoring). Exports (TorchScript / ONNX) run as exported: only
        the eager backend takes this."""
        check_precision(precision)
        if precision != "fp32" and self.backend != "eager":
            raise ConfigError(f"precision {precision!r} applies to the eager backend only, not {self.backend!r}")
        if self.backend == "eager":   # an export's runner stays as attached
            self.runner = self._eager_runner(precision)
        self.precision = precision
        return self

    def _eager_runner(self, precision: str) -> Any:
        """The model itself (CPU, fp32), its CUDA-graph runner (CUDA, fp32) or its autocast runner (bf16)."""
        if precision != "fp32":
            return AutocastRunner(self.lm, precision)
        if self._device.type == "cuda" and self.cuda_graphs:
            from zoo.captured_inference import GraphRunner

            return GraphRunner(self.lm)
        return self.lm

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, source: str = "local path",
                        name: str | None = None) -> ZooModel:
        lm, tok, config = load_checkpoint(directory)
        model = cls(lm, tok, config, source=source, name=name)
        model.directory = Path(directory)
        return model

    def save_pretrained(self, directory: str | os.PathLike, extra_config: dict[str, Any] | None = None,
                        dtype: torch.dtype | None = None) -> Path:
        extra = {k: v for k, v in self.config.items()
                 if k not in ("architecture", "model_args", "tokenizer", "num_parameters", "torch_dtype",
                              "zoo_format", "model_type", "architectures")}
        extra.update(extra_config or {})
        return save_checkpoint(directory, self.lm, self.tokenizer, extra, dtype=dtype)

    @property
    def num_parameters(self) -> int:
        return self.lm.num_parameters()

    # -- the main API ---------------------------------------------------------------------------------
    def score(self, texts: str | list[str], return_tokens: bool = False, batch_size: int = 16,
              progress: bool = False, dynamic: bool | DynamicParams | Mapping[str, Any] = False) -> ScoreReport:
        """Score one text or a list; see :mod:`zoo.scoring` for the fields and conventions.

        Args:
            texts: one text or a list of texts; each is scored from a zero state, every token exactly once.
            return_tokens: add ``tokens``, each token's ``{token, id, logprob}``, to every result.
            batch_size: texts scored together (the numbers do not depend on it).
            progress: a progress bar on standard error.
            dynamic: ``True`` (this model's own settings), a mapping of settings to change, or a
                :class:`~zoo.dynamic.DynamicParams`: score each text by dynamic evaluation (:mod:`zoo.dynamic`).

        Returns:
            One dict per text (a list), with ``.corpus``: the token-weighted totals over all texts.
        """
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise WrongType("texts must be a str or a list of str")
        if not texts:
            raise ConfigError("texts is an empty list: nothing to score")
        if not isinstance(return_tokens, bool):
            raise WrongType(f"return_tokens must be a bool, got {type(return_tokens).__name__}")
        _check_positive("batch_size", batch_size)
        dyn = self._dynamic(dynamic)
        stats = self.dynamic_stats(dyn, progress=progress) if dyn is not None else None
        return score_texts(self.lm if dyn else self.runner, self.tokenizer, texts, return_tokens=return_tokens,
                           batch_size=batch_size, progress=progress, dynamic=dyn, dynamic_stats=stats)

    def score_steps(self, texts: list[str], return_tokens: bool = False, step_tokens: int | None = None,
                    batch_size: int = 16, encodings: list[Any] | None = None) -> Steps[ScoreReport]:
        """:meth:`score` (plain, not dynamic) as steps of at most ``step_tokens`` tokens
        (:func:`zoo.scoring.score_steps`: the same numbers, the state carried across steps), for a server that shares
        its time between requests."""
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise WrongType("texts must be a non-empty list of str")
        return score_steps(self.runner, self.tokenizer, texts, return_tokens=return_tokens, batch_size=batch_size,
                           step_tokens=step_tokens, encodings=encodings)

    def _dynamic(self, dynamic: bool | DynamicParams | Mapping[str, Any]) -> DynamicParams | None:
        """``True``: this model's own settings (:attr:`dynamic_defaults`: those chosen for it on validation, where
        its checkpoint has them, else :data:`zoo.dynamic.DEFAULTS`); a mapping: those settings with some changed
        (``{"decay": 0.0003}``); a :class:`DynamicParams`: exactly these."""
        if dynamic is False or dynamic is None:
            return None
        if self.backend != "eager" or self.precision != "fp32":
            raise ConfigError("dynamic evaluation runs on the eager backend in fp32 (it takes gradient steps)")
        if self.eval_protocol()["mode"] == "sentences":  # (its statistics and its steps assume a carried stream)
            raise ConfigError("dynamic evaluation scores one stream; this model was trained on single sentences")
        if isinstance(dynamic, DynamicParams):
            return dynamic
        if isinstance(dynamic, Mapping):
            return self.dynamic_defaults.with_changes(dynamic)
        if dynamic is not True:
            raise WrongType("dynamic must be a bool, a mapping of settings or a zoo.dynamic.DynamicParams")
        return self.dynamic_defaults

    def dynamic_stats(self, params: DynamicParams = DYNAMIC_DEFAULTS, data_dir: str | os.PathLike | None = None,
                      progress: bool = False, cache: bool = True) -> GradStats | None:
        """The gradient statistics the RMS rule of dynamic evaluation needs (:func:`zoo.dynamic.gradient_stats`),
        from this model's *own training split* (its config's dataset; the text being scored never enters them).
        ``None`` when ``params`` needs none (``rule="sgd"``).

        Collecting them costs about a minute of CPU for the bundled models, and each ``zoo ... --dynamic`` command
        is a new process, so they are kept twice: on this object, and (``cache``) on disk under
        :func:`zoo.files.cache_home` ``/dynamic-stats/``, named by a digest of the weights' bytes, the tokens they
        are collected from and ``params.stats_key()``: other weights (fine-tuning) or another training text never
        find them. A file that does not load or does not fit is recomputed and replaced; a cache that cannot be
        written is skipped. ``cache=False`` neither reads nor writes the disk (what a timing of the collection
        needs)."""
        if not params.needs_stats:
            return None
        key = (params.stats_key(), str(resolve_data_dir(data_dir)), _weights_fingerprint(self.lm))
        if key not in self._dynamic_stats:
            dataset = self.config.get("dataset")
            if not dataset:
                raise ConfigError("dynamic evaluation with rule 'rms' needs the model's training split, and this "
                                 "checkpoint does not say its dataset (use rule='sgd')")
            corpus = load_corpus(dataset, data_dir)
            if corpus.vocab != self.tokenizer.vocab:
                raise ConfigError(f"dynamic evaluation with rule 'rms' needs the model's training split: the "
                                 f"{dataset} vocabulary does not match the model's (use rule='sgd')")
            self._dynamic_stats = {key: self._stats_from_cache_or_train(corpus.train, params, key[2], progress,
                                                                        cache)}
        return self._dynamic_stats[key]

    def _stats_from_cache_or_train(self, train: torch.Tensor, params: DynamicParams, weights: str, progress: bool,
                                   cache: bool) -> GradStats:
        """:meth:`dynamic_stats`' disk cache around :func:`zoo.dynamic.gradient_stats`."""
        if not cache:
            return gradient_stats(self.lm, train, params, progress=progress)
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{weights} {params.stats_key()} ".encode())
        digest.update(train[:params.stats_tokens].numpy().tobytes())
        path = cache_home() / "dynamic-stats" / f"{digest.hexdigest()}.safetensors"
        trainable = [p for p in self.lm.parameters() if p.requires_grad]
        if path.is_file():
            try:
                return load_stats(path, trainable)
            except Exception:  # noqa: BLE001 (a torn or foreign file: remade below, never trusted)
                pass
        stats = gradient_stats(self.lm, train, params, progress=progress)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_stats(stats, path)
        except OSError:
            pass  # (a read-only cache costs time, not the answer)
        return stats

    def stream(self, prompt: str = "", **sampling: Any) -> Iterator[str]:
        """Yield generated text piece by piece (keywords of :class:`SamplingParams`)."""
        prompt, params = self._generation_request(prompt, sampling)
        return stream_text(self.runner, self.tokenizer, prompt, params)

    def stream_steps(self, prompt: str, params: SamplingParams,
                     prompt_piece: int | None = None) -> Iterator[str | None]:
        """:meth:`stream` for checked parameters, with a ``None`` after each piece of at most ``prompt_piece`` prompt
        tokens read (:func:`zoo.generation.stream_steps`)."""
        prompt = self._generation_request(prompt, {})[0]
        return stream_steps(self.runner, self.tokenizer, prompt, params, prompt_piece)

    @staticmethod
    def _generation_request(prompt: Any, sampling: dict[str, Any]) -> tuple[str, SamplingParams]:
        """The prompt and sampling keywords checked as every front end checks them (``zoo.validate``): here, not
        at the first ``next()``, since the call is where the mistake is. An empty prompt starts from ``<eos>``."""
        if not isinstance(prompt, str):
            raise WrongType(f"prompt must be a str, got {type(prompt).__name__}")
        prompt = check_text(prompt, "prompt", allow_empty=True)[0]
        unknown = sorted(set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)})
        if unknown:
            raise WrongType(f"unknown sampling keyword(s) {', '.join(unknown)}; known: "
                            f"{', '.join(f.name for f in dataclasses.fields(SamplingParams))}")
        return prompt, SamplingParams(**sampling)

    def generate(self, prompt: str = "", **sampling: Any) -> str:
        """The generated continuation of ``prompt`` as text.

        Args:
            prompt: the text to continue (normalised as the model's corpus was); empty starts from ``<eos>``.
            **sampling: keywords of :class:`~zoo.generation.SamplingParams` (``max_new_tokens``, ``temperature``,
                ``top_k``, ``top_p``, ``seed``, ...).
        """
        return "".join(self.stream(prompt, **sampling))

    def generate_ids(self, prompt: str = "", **sampling: Any) -> list[int]:
        prompt, params = self._generation_request(prompt, sampling)
        return list(sample_ids(self.runner, self.tokenizer, prompt, params))

    def eval_protocol(self, split: str = "test") -> dict[str, Any]:
        """How this model's card numbers were computed on ``split`` (from the training recipe it carries): the batch
        size (the test split is one stream at batch 1 for the bundled models), the chunk length and the mode
        (``stream``, or ``sentences``: every line on its own). Defaults for checkpoints without a recipe."""
        train = (self.config.get("recipe") or {}).get("train", {})
        batch = train.get("test_batch_size", 1) if split == "test" else train.get("eval_batch_size", 10)
        return {"batch_size": int(batch), "bptt": int(train.get("eval_bptt", 70)),
                "mode": train.get("mode", "stream"), "max_len": int(train.get("max_len", 100))}

    def evaluate(self, dataset: str | None = None, split: str = "test", data_dir: str | None = None,
                 batch_size: int | None = None, bptt: int | None = None, progress: bool = True,
                 dynamic: bool | DynamicParams | Mapping[str, Any] = False) -> dict[str, Any]:
        """Corpus metrics of a benchmark split, by default with the model's own protocol (:meth:`eval_protocol`), so
        the number reproduces its card; ``dataset`` defaults to the one it was trained on. ``dynamic``: score the
        split as one stream by dynamic evaluation (:mod:`zoo.dynamic`) instead."""
        for key, value in (("batch_size", batch_size), ("bptt", bptt)):
            if value is not None:
                _check_positive(key, value)
        dyn = self._dynamic(dynamic)
        dataset = dataset or self.config.get("dataset")
        if not dataset:
            raise ConfigError("this checkpoint does not say its dataset: pass one")
        corpus = load_corpus(dataset, data_dir)
        if corpus.vocab != self.tokenizer.vocab:
            trained = self.config.get("dataset")
            raise ConfigError(f"the model's vocabulary ({len(self.tokenizer.vocab):,} symbols) is not the {dataset} "
                              f"vocabulary ({len(corpus.vocab):,})"
                              + (f": it was trained on {trained} (leave the dataset out to use it)"
                                 if trained and trained != dataset else ""))
        proto = self.eval_protocol(split)
        if dyn is not None and (batch_size is not None or bptt is not None):  # (silently ignored before)
            raise ConfigError("batch_size and bptt do not apply to dynamic evaluation: it scores one stream, batch 1, "
                              "in segments (dynamic.segment)")
        if proto["mode"] == "sentences" and bptt is not None:
            raise ConfigError(f"bptt does not apply to a sentence-level model: each sentence (at most "
                              f"{proto['max_len']} symbols) is scored whole, from a zero state")
        batch_size = batch_size or proto["batch_size"]
        bptt = bptt or proto["bptt"]
        if dyn is not None:
            stats = self.dynamic_stats(dyn, data_dir, progress=progress)
            stream = corpus.split(split)
            lp = dynamic_logprobs(self.lm, stream[:-1], stream[1:], dyn, progress=progress,
                                  desc=f"{dataset}/{split} (dynamic)", stats=stats)
            res = summarize(float(-lp.sum()), lp.numel(), None)
            res.update(batch_size=1, dynamic=dyn.to_dict())
        elif proto["mode"] == "sentences":
            seqs = sentences(corpus.split(split), self.tokenizer.eos_id, proto["max_len"])
            res = evaluate_sentences(self.runner, seqs, batch_size=batch_size, pad_id=self.tokenizer.eos_id,
                                     progress=progress, desc=f"{dataset}/{split}")
        else:
            res = evaluate_stream(self.runner, corpus.split(split), batch_size=batch_size, bptt=bptt,
                                  progress=progress, desc=f"{dataset}/{split}", vocab_size=len(self.tokenizer))
        res.update(dataset=dataset, split=split)
        return res

    def __repr__(self) -> str:
        return (f"ZooModel(name={self.name!r}, architecture={self.lm.architecture!r}, "
                f"params={self.num_parameters:,}, source={self.source!r}, backend={self.backend!r}"
                + (f", device='{self.device}')" if self.device.type != "cpu" else ")"))


def _weights_fingerprint(lm: torch.nn.Module) -> str:
    """A digest of the weights' bytes (tens of ms for the bundled models): cached statistics follow the weights."""
    h = hashlib.blake2b(digest_size=16)
    for p in lm.parameters():
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load(name_or_path: str | os.PathLike, backend: str = "eager", precision: str = "fp32", *,
         device: str | torch.device = "cpu", revision: str | None = None, source: str = "auto",
         token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
         endpoint: str | None = None) -> ZooModel:
    """Load a pretrained model by catalogue name (``zoo list``) or from a checkpoint directory.

    Args:
        name_or_path: a catalogue name (:func:`zoo.list_models`), ``"default"``, a checkpoint folder
            (``config.json``, ``model.safetensors``, ``vocab.json``) or ``"hf-hub:ORG/NAME[@REVISION]"``.
        backend: ``"eager"`` (PyTorch), or an export's backend (``"onnx"``, ``"torchscript"``; see
            :mod:`zoo.backends`).
        precision: ``"fp32"`` (default) or ``"bf16"`` for eager scoring and generation (see
            :meth:`ZooModel.set_precision`).
        device: ``"cpu"`` (default: the published numbers), ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (CUDA when
            there is one); see :meth:`ZooModel.to`.
        revision: a Hub revision (tag, branch or commit) instead of the catalogue's pinned one.
        source: ``"auto"`` (Hub cache, then the bundled copy in a checkout, else a download), ``"hub"`` or
            ``"bundled"`` (:func:`zoo.hub.resolve`).
        token: a Hugging Face token for a private repository (default: ``$HF_TOKEN``).
        cache_dir: the Hub cache (default: ``$HF_HUB_CACHE``).
        endpoint: the Hub's address (default: ``$HF_ENDPOINT``, else huggingface.co).

    Returns:
        The model; ``model.source`` says where the weights came from.
    """
    from zoo.hub import HF_PREFIX, parse_hf_spec, pinned_release, resolve

    if not isinstance(name_or_path, str | os.PathLike):
        raise WrongType(f"name_or_path must be a catalogue name, a folder path or hf-hub:ORG/NAME, got "
                        f"{type(name_or_path).__name__}")
    kwargs = {"revision": revision, "source": source, "token": token, "cache_dir": cache_dir, "endpoint": endpoint}
    check_precision(precision)
    if precision != "fp32" and backend != "eager":
        raise ConfigError(f"precision {precision!r} applies to the eager backend only, not {backend!r}")
    target = resolve_device(device)   # (a device this machine lacks: refused before anything is fetched)
    if target.type != "cpu" and backend != "eager":
        raise BackendError(f"the {backend!r} backend runs on the CPU only (device {str(device)!r}): use the eager "
                           "backend on CUDA")
    directory, source = resolve(name_or_path, **kwargs)
    text = str(name_or_path)
    if source == "local path":
        name = None
    elif text.startswith(HF_PREFIX):
        repo_id, rev = parse_hf_spec(text)
        rel = None if "unpinned" in source else pinned_release(repo_id, rev or kwargs.get("revision"))
        name = rel.name if rel else repo_id.split("/")[-1]
    else:
        name = canonical_name(text)
    model = ZooModel.from_pretrained(directory, source=source, name=name)
    if backend != "eager":
        from zoo.backends import attach_backend
        attach_backend(model, backend)
    model.set_precision(precision)
    return model.to(target) if target.type != "cpu" else model
