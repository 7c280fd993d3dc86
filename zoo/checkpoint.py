"""Hub-layout checkpoints: ``config.json`` + ``model.safetensors`` + ``vocab.json`` (+ ``README.md``).

Loading is strict and never unpickles anything: every tensor the model expects must be in the
file with its exact shape, nothing else may be, and each failure names the file and the tensor.
Tied weights are stored once (the decoder aliases the embedding) and re-tied by construction.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zoo.errors import CheckpointError  # noqa: F401 (re-exported)
from zoo.files import write_atomic
from zoo.lm import LanguageModel
from zoo.registry import ARCHITECTURES
from zoo.tokenizer import Tokenizer

FORMAT_VERSION = 1
CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE, CARD_FILE = "config.json", "model.safetensors", "vocab.json", "README.md"
#: The vocabulary for other tools (Hugging Face ``tokenizers``); written with every checkpoint since format 1's
#: library redesign, optional when loading (older checkpoints do not have it). ``vocab.json`` is the zoo's own
#: file: a JSON *list* of the symbols in id order (not the ``{token: id}`` map some Hub repos use).
TOKENIZER_FILE = "tokenizer.json"
#: The special tokens for transformers (``AutoTokenizer`` without ``import zoo.hf``: lm-eval's ``local-completions``
#: with ``tokenizer=<checkpoint folder>``, which needs ``<eos>`` as its BOS/EOS). Derived from the vocabulary alone
#: (:func:`tokenizer_config`), so a release published without it gets it written where it is read
#: (:func:`write_tokenizer_config`), byte for byte what its pin says.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: What every checkpoint folder must hold.
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE)
#: What Hugging Face transformers reads in ``config.json`` to pick the classes :mod:`zoo.hf` registers. Written with
#: every checkpoint since the transformers door; optional when loading (the bundled and released checkpoints predate
#: it, and their config.json is sha256-pinned: :mod:`zoo.hf` fills these in for them).
HF_MODEL_TYPE = "alstm_zoo"
HF_ARCHITECTURE = "AlstmZooForCausalLM"


def hf_fields() -> dict[str, Any]:
    """The ``config.json`` entries transformers recognises a zoo checkpoint by (``AutoConfig``, ``AutoModel*``)."""
    return {"model_type": HF_MODEL_TYPE, "architectures": [HF_ARCHITECTURE]}


def save_checkpoint(directory: str | os.PathLike, model: LanguageModel, tokenizer: Tokenizer,
                    extra_config: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write a checkpoint directory; ``dtype=torch.float16`` halves the file (loaded back as float32)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tied = model.tied_keys()
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu()
             for k, v in model.state_dict().items() if k not in tied}
    config = {
        "zoo_format": FORMAT_VERSION,
        "architecture": model.architecture,
        "model_args": model.config,
        "tokenizer": tokenizer.to_dict(),
        "num_parameters": model.num_parameters(),
        "torch_dtype": str(dtype or next(iter(state.values())).dtype).replace("torch.", ""),
    }
    config.update(extra_config or {})
    config.update(hf_fields())
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "tied": json.dumps(tied)})
    os.replace(tmp, out / WEIGHTS_FILE)
    write_atomic(out / VOCAB_FILE, json.dumps(tokenizer.vocab, ensure_ascii=False), fsync=True)
    write_atomic(out / TOKENIZER_FILE, json.dumps(tokenizer.to_hf_json(), ensure_ascii=False), fsync=True)
    write_atomic(out / TOKENIZER_CONFIG_FILE, tokenizer_config_text(tokenizer), fsync=True)
    write_atomic(out / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n", fsync=True)
    return out


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """transformers' ``tokenizer_config.json`` of a zoo vocabulary: ``<eos>`` is the BOS, EOS and padding token (the
    zoo conditions a text's first token on one ``<eos>``; it ends every line), ``<unk>`` the unknown token where the
    vocabulary has one; nothing is added by default (as :class:`zoo.hf.AlstmZooTokenizer`). No
    ``tokenizer_class``: with ``import zoo.hf`` transformers picks the zoo's tokenizer from ``config.json``; without
    it, ``tokenizer.json`` as it is, with these tokens."""
    from zoo.data import EOS, UNK

    out: dict[str, Any] = {"add_bos_token": False, "add_eos_token": False, "bos_token": EOS,
                           "clean_up_tokenization_spaces": False, "eos_token": EOS, "pad_token": EOS}
    if UNK in tokenizer.index:
        out["unk_token"] = UNK
    return out


def tokenizer_config_text(tokenizer: Tokenizer) -> str:
    """:func:`tokenizer_config` as the file's exact bytes (pinned like every release file)."""
    return json.dumps(tokenizer_config(tokenizer), indent=2, sort_keys=True) + "\n"


def write_tokenizer_config(directory: str | os.PathLike) -> Path:
    """Write a checkpoint folder's :data:`TOKENIZER_CONFIG_FILE` when it lacks one (a release published before the
    file existed: bundled copies and Hub snapshots); returns its path."""
    path = Path(directory) / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        write_atomic(path, tokenizer_config_text(load_tokenizer(directory, read_config(directory))))
    return path


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a checkpoint directory holds {CONFIG_FILE}, {WEIGHTS_FILE}, "
                              f"{VOCAB_FILE})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # (invalid JSON or UTF-8, a 5000-digit number, nesting too deep)
        raise CheckpointError(f"{path}: not valid JSON ({str(e)[:120]})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    for key, kind in (("architecture", str), ("model_args", dict), ("tokenizer", dict)):
        if key not in config:
            raise CheckpointError(f"{path}: no {key!r} entry")
        if not isinstance(config[key], kind):
            raise CheckpointError(f"{path}: {key!r} must be a JSON {'string' if kind is str else 'object'}")
    if not isinstance(config["tokenizer"].get("normalization"), str):
        raise CheckpointError(f"{path}: tokenizer.normalization must be a string")
    if config["architecture"] not in ARCHITECTURES:
        raise CheckpointError(f"{path}: unknown architecture {config['architecture']!r} "
                              f"(registered: {', '.join(sorted(ARCHITECTURES))})")
    return config


#: The most a model may allocate beyond its weights (derived buffers): 1 GiB.
MAX_DERIVED_BYTES = 1 << 30
#: The largest vocabulary file read (the zoo's largest, WikiText-2's, is under 1 MB).
MAX_VOCAB_BYTES = 64 << 20


def load_tokenizer(directory: str | os.PathLike, config: dict[str, Any]) -> Tokenizer:
    name = config["tokenizer"].get("vocab_file", VOCAB_FILE)
    # a file of the checkpoint folder itself: not a path a config could point elsewhere (../, /dev/zero)
    if not isinstance(name, str) or not name or name != Path(name).name or name.startswith("."):
        raise CheckpointError(f"{Path(directory) / CONFIG_FILE}: tokenizer.vocab_file must be a file name in the "
                              f"checkpoint folder, got {name!r}")
    path = Path(directory) / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing vocabulary file")
    if path.stat().st_size > MAX_VOCAB_BYTES:
        raise CheckpointError(f"{path}: {path.stat().st_size:,} bytes, over the {MAX_VOCAB_BYTES:,} a vocabulary "
                              "may have")
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({str(e)[:120]})") from None
    if not isinstance(vocab, list) or not all(isinstance(t, str) for t in vocab):
        raise CheckpointError(f"{path}: expected a JSON list of strings")
    if len(vocab) != config["model_args"].get("vocab_size"):
        raise CheckpointError(f"{path}: {len(vocab)} entries but config says vocab_size "
                              f"{config['model_args'].get('vocab_size')!r}")
    return Tokenizer(vocab, config["tokenizer"]["normalization"])


def load_checkpoint(directory: str | os.PathLike) -> tuple[LanguageModel, Tokenizer, dict[str, Any]]:
    """Build the model from ``config.json`` and load every tensor strictly; returns it in eval mode."""
    directory = Path(directory)
    config = read_config(directory)
    tokenizer = load_tokenizer(directory, config)
    # The config is checked against the weights file's header before anything is allocated: the model is built
    # first on the meta device (shapes only), so a config that claims a huge model costs nothing.
    try:
        with torch.device("meta"):
            shapes_only = LanguageModel.from_config(config["model_args"])
    except (TypeError, ValueError, RuntimeError, ArithmeticError) as e:  # (negative or zero sizes: torch's own)
        raise CheckpointError(f"{directory / CONFIG_FILE}: model_args do not fit the architecture ({e})") from None
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing")
    expected = {k: v for k, v in shapes_only.state_dict().items() if k not in shapes_only.tied_keys()}
    try:
        with safe_open(str(weights), framework="pt") as f:
            header = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (no iterator)
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise CheckpointError(f"{weights}: corrupt or truncated safetensors file ({e})") from None
    missing = sorted(set(expected) - set(header))
    extra = sorted(set(header) - set(expected))
    if missing:
        raise CheckpointError(f"{weights}: missing tensors {missing}")
    if extra:
        raise CheckpointError(f"{weights}: unexpected tensors {extra}")
    for key, ref in expected.items():
        if header[key] != tuple(ref.shape):
            raise CheckpointError(f"{weights}: tensor {key!r} has shape {header[key]}, "
                                  f"the config implies {tuple(ref.shape)}")
    # what the model allocates beyond its weights (the one-hot input's identity matrix: vocab_size squared)
    saved = set(shapes_only.state_dict())
    derived = sum(b.numel() * b.element_size() for n, b in shapes_only.named_buffers() if n not in saved)
    if derived > MAX_DERIVED_BYTES:
        raise CheckpointError(f"{directory / CONFIG_FILE}: the model would allocate {derived:,} bytes beyond its "
                              f"weights (over {MAX_DERIVED_BYTES:,}): a one-hot input over too large a vocabulary")
    try:
        model = LanguageModel.from_config(config["model_args"])
        with safe_open(str(weights), framework="pt") as f:
            stored = {k: f.get_tensor(k) for k in expected}
    except (RuntimeError, MemoryError) as e:
        raise CheckpointError(f"{weights}: cannot load ({str(e)[:200]})") from None
    except Exception as e:  # safetensors' own error types: data that does not match its header
        raise CheckpointError(f"{weights}: corrupt or truncated safetensors file ({e})") from None
    for key, ref in expected.items():
        if not stored[key].dtype.is_floating_point and stored[key].dtype != ref.dtype:
            raise CheckpointError(f"{weights}: tensor {key!r} has dtype {stored[key].dtype}, expected {ref.dtype}")
        # a NaN or inf weight would load and then score "nan" or fail inside sampling: refuse it here, by name
        if stored[key].dtype.is_floating_point and not bool(torch.isfinite(stored[key]).all()):
            raise CheckpointError(f"{weights}: tensor {key!r} has non-finite values (NaN or inf)")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in stored.items()}, strict=False)
    model.eval()
    return model, tokenizer, config
