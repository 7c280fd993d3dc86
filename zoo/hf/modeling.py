"""Any zoo language model as a transformers causal LM: ``PreTrainedModel`` + ``GenerationMixin`` around the zoo's
:class:`~zoo.lm.LanguageModel`, for every registered architecture, through the model protocol only (sequence forward,
single step with explicit state, state init): nothing here knows an architecture.

Generation follows transformers' recurrent models (xLSTM, Mamba): the recurrent state travels in a cache object,
:class:`AlstmZooCache`, returned by every forward and handed back by ``generate``; after the first call
:meth:`AlstmZooForCausalLM.prepare_inputs_for_generation` feeds one token at a time. The zoo's own generation reads the
context up to its last token with the sequence forward and then takes single steps (:func:`zoo.generation.sample_ids`);
a forward that returns a cache does the same (its last input token goes through ``step``), so ``model.generate``'s
greedy tokens are ``zoo generate``'s.

Loss: ``model(input_ids, labels=labels).loss`` is transformers' causal-LM loss (position ``t`` predicts label
``t + 1``; ``-100`` ignored; the mean over the predicted labels), computed as the zoo scores (a float32 log-softmax
of the same logits). The zoo conditions a text's first token on one ``<eos>`` (:mod:`zoo.scoring`), so with
``input_ids = labels = [<eos>] + the text's ids`` (the tokenizer's ids of ``"<eos>" + text + "\\n"``) the loss is the
zoo's ``avg_nll`` of ``text`` and its exp the zoo's perplexity.

Loading is the zoo's: :meth:`AlstmZooForCausalLM.from_pretrained` resolves a name as :func:`zoo.load` does (a
checkpoint folder as it is; a catalogue name or a Hub repo with the catalogue's sha256 pins where they apply) and
loads strictly (:func:`zoo.checkpoint.load_checkpoint`: every key and shape, safetensors only, one-line
:class:`~zoo.errors.CheckpointError` otherwise). ``save_pretrained`` writes a zoo checkpoint (``zoo.load`` reads it).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from zoo.catalog import catalog
from zoo.device import resolve_device
from zoo.errors import ConfigError
from zoo.hf.configuration import AlstmZooConfig
from zoo.hub import HF_PREFIX
from zoo.lm import LanguageModel
from zoo.models._fused_loss import logits_target_logprobs
from zoo.zoo_model import ZooModel, load

#: A Hugging Face repo id (``ORG/NAME``): what transformers users pass for a Hub model.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
#: ``from_pretrained`` keywords that ask for something the zoo's loading does not do.
_UNSUPPORTED = ("quantization_config", "gguf_file", "subfolder", "tp_plan", "load_in_8bit", "load_in_4bit",
                "adapter_name_or_path")


def zoo_spec(name_or_path: str | os.PathLike) -> str:
    """What :func:`zoo.load` is given for a transformers name: a folder or a zoo name (catalogue, ``hf-hub:``) as
    it is; an ``ORG/NAME`` that is neither a folder nor a catalogue name is the Hub repo ``hf-hub:ORG/NAME``."""
    text = str(name_or_path)
    if Path(text).is_dir() or text.startswith(HF_PREFIX) or text in catalog().get("models", {}) or text == "default":
        return text
    return HF_PREFIX + text if _REPO_ID.match(text) else text


def resolve_checkpoint(name_or_path: str | os.PathLike, kwargs: dict[str, Any]) -> tuple[Path, str]:
    """The checkpoint folder and its source (:func:`zoo.hub.resolve`) for transformers' ``from_pretrained``
    arguments (``revision``, ``cache_dir``, ``token``). A local folder has no revision: transformers' callers pass
    ``"main"`` anyway (lm-eval does), and transformers ignores it there, so the zoo does too."""
    from zoo.hub import resolve

    return resolve(zoo_spec(name_or_path), revision=hub_revision(name_or_path, kwargs),
                   cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token"))


def hub_revision(name_or_path: str | os.PathLike, kwargs: dict[str, Any]) -> str | None:
    """The ``revision`` keyword where it applies (a Hub model), else ``None``."""
    return None if Path(str(name_or_path)).is_dir() else kwargs.get("revision")


class AlstmZooCache:
    """The recurrent state of a batch (the zoo's flat tuple of tensors, batch on dim 0) and how many tokens it has
    read: what transformers' attention caches are to a transformer, and what ``xLSTMCache`` is to xLSTM."""

    is_compileable = False

    def __init__(self, state: tuple[Tensor, ...], seqlen_offset: int = 0):
        self.state = tuple(state)
        self.seqlen_offset = seqlen_offset

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seqlen_offset

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the rows of the beams that survive (beam search)."""
        self.state = tuple(s.index_select(0, beam_idx.to(s.device)) for s in self.state)

    def reset(self) -> None:
        self.state = tuple(torch.zeros_like(s) for s in self.state)
        self.seqlen_offset = 0


@dataclass
class AlstmZooCausalLMOutput(ModelOutput):
    """``loss`` (with labels), ``logits [B, T, V]`` and the ``cache`` holding the state after the last input."""

    loss: Tensor | None = None
    logits: Tensor | None = None
    cache: AlstmZooCache | None = None


class AlstmZooPreTrainedModel(PreTrainedModel):
    config_class = AlstmZooConfig
    base_model_prefix = "lm"
    main_input_name = "input_ids"
    _is_stateful = True
    supports_gradient_checkpointing = False

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: the zoo's constructor initialises its weights (and ties them) itself, and loading replaces them."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # (the state is this model's own cache: transformers must not make an attention cache)


class AlstmZooForCausalLM(AlstmZooPreTrainedModel, GenerationMixin):
    """See the module docstring. ``model.lm`` is the zoo's :class:`~zoo.lm.LanguageModel`; ``model.zoo`` is the
    :class:`~zoo.zoo_model.ZooModel` it was loaded as (scoring, the zoo's generation), when it was loaded."""

    def __init__(self, config: AlstmZooConfig, lm: LanguageModel | None = None):
        super().__init__(config)
        self.lm = lm if lm is not None else LanguageModel.from_config(config.model_args)
        self.zoo: ZooModel | None = None
        self.post_init()

    # -- loading and saving: the zoo's ------------------------------------------------------------------------
    @classmethod
    def from_zoo(cls, model: ZooModel) -> AlstmZooForCausalLM:
        """The transformers model of a loaded zoo model (sharing its weights)."""
        config = AlstmZooConfig(**{**model.config, "name_or_path": model.name})
        config.bos_token_id = config.eos_token_id = config.pad_token_id = model.tokenizer.eos_id
        config.dtype = model.lm.decoder.weight.dtype
        hf = cls(config, lm=model.lm)
        hf.zoo = model
        hf.generation_config.eos_token_id = model.tokenizer.eos_id
        hf.generation_config.pad_token_id = model.tokenizer.eos_id
        return hf.eval()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args: Any,
                        **kwargs: Any) -> AlstmZooForCausalLM:
        """Load as :func:`zoo.load` does (see the module docstring). ``dtype`` (``torch_dtype``): ``None`` or
        ``"auto"`` gives float32, as the zoo loads every checkpoint; a torch dtype casts. ``device_map``: a single
        device (``"cpu"``, ``"cuda"``, ``"cuda:0"``, ``"auto"``; :meth:`to`); ``revision``, ``cache_dir``,
        ``token``: for Hub models."""
        bad = sorted(k for k in _UNSUPPORTED if kwargs.get(k))
        if model_args or bad:
            raise ConfigError(f"{cls.__name__}.from_pretrained: not supported by the zoo's loading: "
                              f"{', '.join(bad) or 'positional model arguments'}")
        directory, source = resolve_checkpoint(pretrained_model_name_or_path, kwargs)
        spec = zoo_spec(pretrained_model_name_or_path)
        model = load(spec if source != "local path" else directory, revision=hub_revision(spec, kwargs),
                     cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token"))
        hf = cls.from_zoo(model)
        hf.name_or_path = str(pretrained_model_name_or_path)
        hf.config.name_or_path = str(pretrained_model_name_or_path)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype) and dtype != torch.float32:
            hf.to(dtype)
        device = kwargs.get("device_map")
        if isinstance(device, dict) and set(device) == {""}:
            device = device[""]
        if device is not None:
            if isinstance(device, int) and not isinstance(device, bool):
                device = f"cuda:{device}"
            if not isinstance(device, str | torch.device):
                raise ConfigError(f"{cls.__name__}.from_pretrained: device_map must name one device, got {device!r}")
            hf.to(device)  # ("auto": CUDA when there is one, as the zoo's device rules say)
        return hf

    # -- devices: the zoo's rules -----------------------------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> AlstmZooForCausalLM:
        """``nn.Module.to``, with a device moved through the zoo (:meth:`zoo.ZooModel.to`: the zoo's device names,
        ``"auto"`` included, a one-line :class:`~zoo.errors.DeviceError` for a device this machine lacks, float32
        kept exact on CUDA, the CUDA-graph runner), so ``model.zoo`` scores where this model runs."""
        device = kwargs.pop("device", None)
        if args and isinstance(args[0], str | torch.device | int) and not isinstance(args[0], bool):
            device, args = args[0], args[1:]
        if isinstance(device, int):
            device = f"cuda:{device}"
        if device is not None:
            if self.zoo is not None:
                self.zoo.to(device)
            else:
                super().to(resolve_device(device))
        return super().to(*args, **kwargs) if args or kwargs else self

    def cuda(self, device: int | torch.device | None = None) -> AlstmZooForCausalLM:
        return self.to("cuda" if device is None else device if isinstance(device, torch.device) else f"cuda:{device}")

    def cpu(self) -> AlstmZooForCausalLM:
        return self.to("cpu")

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """Write a zoo checkpoint (``config.json`` with ``model_type``, ``model.safetensors``, ``vocab.json``,
        ``tokenizer.json``): what ``zoo.load`` and this class's ``from_pretrained`` read."""
        if self.zoo is None:
            raise ConfigError("save_pretrained needs the model's vocabulary: load the model with from_pretrained or "
                              "from_zoo")
        self.zoo.save_pretrained(save_directory)

    # -- computation: the model protocol ----------------------------------------------------------------------
    def get_input_embeddings(self) -> torch.nn.Module | None:
        return getattr(self.lm, "embedding", None)

    def _run(self, input_ids: Tensor, state: tuple[Tensor, ...] | None, step_last: bool) -> tuple[Tensor, tuple]:
        """Logits ``[B, T, V]`` and the state after ``input_ids``. With ``step_last`` the last token goes through the
        single-step path, as in the zoo's generation; everything before it through the sequence path."""
        if not step_last:
            return self.lm(input_ids, state)
        if state is None:
            state = self.lm.init_state(input_ids.shape[0], device=input_ids.device)
        pieces = []
        if input_ids.shape[1] > 1:
            head, state = self.lm(input_ids[:, :-1], state)
            pieces.append(head)
        last, state = self.lm.step(input_ids[:, -1], state)
        return torch.cat([*pieces, last[:, None]], dim=1), state

    def _run_left_padded(self, input_ids: Tensor, attention_mask: Tensor, step_last: bool) -> tuple[Tensor, tuple]:
        """Rows that start with padding (batched generation pads on the left) are read without it: each row from a
        zero state over its own tokens; padded positions get the logits of a zero state (nothing reads them)."""
        logits, states = [], []
        for row, mask in zip(input_ids, attention_mask, strict=True):
            start = int((mask == 0).long().cumprod(0).sum())  # the leading padding
            row_logits, row_state = self._run(row[None, start:], None, step_last)
            pad = self.lm(row[None, :start], None)[0] if start else row_logits[:, :0]
            logits.append(torch.cat([pad, row_logits], dim=1))
            states.append(row_state)
        return torch.cat(logits), tuple(torch.cat(parts) for parts in zip(*states, strict=True))

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: AlstmZooCache | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                inputs_embeds: Tensor | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> AlstmZooCausalLMOutput | tuple:
        """``input_ids [B, T]`` (after ``cache``'s state, or from a zero state) -> logits, the state as a cache
        (``use_cache``, default the config's) and, with ``labels``, the loss (module docstring)."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("the zoo's models take input_ids (token ids), not inputs_embeds")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        left_padded = (cache is None and attention_mask is not None and input_ids.shape[1] > 1
                       and bool((attention_mask[:, 0] == 0).any()))
        if left_padded:
            logits, state = self._run_left_padded(input_ids, attention_mask, bool(use_cache))
        else:
            logits, state = self._run(input_ids, cache.state if cache is not None else None, bool(use_cache))
        loss = self.causal_lm_loss(logits, labels, kwargs.get("num_items_in_batch")) if labels is not None else None
        new_cache = None
        if use_cache:
            new_cache = cache if cache is not None else AlstmZooCache(state)
            new_cache.state = state
            new_cache.seqlen_offset += input_ids.shape[1]
        out = AlstmZooCausalLMOutput(loss=loss, logits=logits, cache=new_cache)
        return out if return_dict is not False else out.to_tuple()

    @staticmethod
    def causal_lm_loss(logits: Tensor, labels: Tensor, num_items: int | Tensor | None = None) -> Tensor:
        """Mean NLL of ``labels[:, 1:]`` under ``logits[:, :-1]`` (``-100`` ignored), from the float32 log-softmax the
        zoo scores with; divided by ``num_items`` instead where the Trainer passes it."""
        targets = labels[:, 1:].to(logits.device)
        keep = targets != -100
        logp = logits_target_logprobs(logits[:, :-1], targets.masked_fill(~keep, 0))
        total = -(logp * keep).sum()
        return total / (num_items if num_items is not None else keep.sum().clamp(min=1))

    def _get_stopping_criteria(self, generation_config: Any, stopping_criteria: Any, tokenizer: Any = None,
                               *args: Any, **kwargs: Any) -> Any:
        """transformers' criteria, with ``stop_strings`` read the zoo's way (:mod:`zoo.hf.stopping`): the zoo's
        tokenizer is the one passed (``tokenizer=``) or the model's own."""
        stops = generation_config.stop_strings
        zoo_tok = getattr(tokenizer, "zoo_tokenizer", None) or (self.zoo.tokenizer if self.zoo is not None else None)
        if stops is None or zoo_tok is None:
            return super()._get_stopping_criteria(generation_config, stopping_criteria, tokenizer, *args, **kwargs)
        from zoo.hf.stopping import ZooStopStrings

        generation_config.stop_strings = None
        try:
            criteria = super()._get_stopping_criteria(generation_config, stopping_criteria, tokenizer, *args,
                                                      **kwargs)
        finally:
            generation_config.stop_strings = stops
        criteria.append(ZooStopStrings(stops, zoo_tok))
        return criteria

    def _prepare_attention_mask_for_generation(self, inputs_tensor: Tensor, generation_config: Any,
                                               model_kwargs: dict[str, Any]) -> Tensor:
        """No padding is inferred from the ids: the pad token is ``<eos>``, which is also the text start a prompt
        begins with (transformers would take that for padding once ``eos_token_id`` is not the pad id). Padding is
        what the caller's ``attention_mask`` says (the tokenizer gives one)."""
        return torch.ones(inputs_tensor.shape[:2], dtype=torch.long, device=inputs_tensor.device)

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: AlstmZooCache | None = None,
                                      attention_mask: Tensor | None = None, use_cache: bool | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        """The whole prompt on the first call; after that only the newest token, the rest being in ``cache``."""
        if cache is not None:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids.contiguous(), "cache": cache, "attention_mask": attention_mask,
                "use_cache": True if use_cache is None else use_cache}
