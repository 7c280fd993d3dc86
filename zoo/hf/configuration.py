"""The transformers configuration of a zoo checkpoint: ``config.json`` as it is, read by ``AutoConfig``.

A zoo ``config.json`` already holds everything the model needs (``architecture``, ``model_args``, ``tokenizer``); this
class only gives transformers its names for what it asks of every causal LM (``vocab_size``, the special token ids,
``tie_word_embeddings``). Nothing is renamed or duplicated in the file: :meth:`AlstmZooConfig.to_dict` writes the
zoo's own entries plus ``model_type`` / ``architectures``, and the zoo's own save writes exactly those two as well
(:func:`zoo.checkpoint.hf_fields`).

Checkpoints written before that (every bundled and released model: their ``config.json`` is sha256-pinned by the
catalogue, so it is never rewritten) have no ``model_type``, and transformers 5 refuses a ``config.json`` without
one. :func:`recognise_zoo_configs` closes that gap: it wraps the one function transformers reads every
``config.json`` through, and adds the two entries to a JSON object that is a zoo checkpoint's (it has
``zoo_format``, ``architecture`` and ``model_args``) and names no ``model_type``. Every other file passes through
untouched.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from zoo.checkpoint import HF_MODEL_TYPE, hf_fields

#: The entries that make a JSON object a zoo checkpoint's config (:func:`zoo.checkpoint.read_config` needs them).
ZOO_KEYS = ("zoo_format", "architecture", "model_args")


class AlstmZooConfig(PretrainedConfig):
    """A zoo checkpoint's ``config.json`` (see the module docstring). The special token ids are the vocabulary's
    ``<eos>`` (beginning of text, end of a line and padding: the zoo conditions a text's first token on one
    ``<eos>``); they are not stored in ``config.json`` but filled in from ``vocab.json`` by
    :meth:`zoo.hf.modeling.AlstmZooForCausalLM.from_pretrained`."""

    model_type = HF_MODEL_TYPE

    architecture: str = "lstm"
    model_args: dict | None = None
    tokenizer: dict | None = None
    zoo_format: int = 1
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        self.model_args = dict(self.model_args or {})
        self.tokenizer = dict(self.tokenizer or {})
        if self.model_args:
            self.architecture = self.model_args.get("architecture", self.architecture)
            self.vocab_size = self.model_args.get("vocab_size", self.vocab_size)
            self.tie_word_embeddings = bool(self.model_args.get("tie_weights", False))
        super().__post_init__(**kwargs)


def with_hf_fields(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``model_type`` / ``architectures`` added when it is a zoo config without them."""
    if isinstance(config, dict) and "model_type" not in config and all(k in config for k in ZOO_KEYS):
        return {**config, **hf_fields()}
    return config


def recognise_zoo_configs() -> None:
    """Let ``AutoConfig`` (and so ``AutoModelForCausalLM``, ``AutoTokenizer``, pipelines, lm-eval's ``hf`` model)
    recognise zoo checkpoints written before ``model_type`` was (see the module docstring). Idempotent."""
    read = PretrainedConfig.__dict__["_dict_from_json_file"].__func__
    if getattr(read, "_zoo_wrapped", False):
        return

    def _dict_from_json_file(cls, json_file):  # noqa: ANN001 (transformers' own signature)
        return with_hf_fields(read(cls, json_file))

    _dict_from_json_file._zoo_wrapped = True  # type: ignore[attr-defined]
    PretrainedConfig._dict_from_json_file = classmethod(_dict_from_json_file)
