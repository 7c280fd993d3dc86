"""The zoo's tokenizer as a transformers ``PreTrainedTokenizerFast``: the checkpoint's ``tokenizer.json`` behind the
zoo's corpus normalisation.

``tokenizer.json`` is a ``WordLevel`` table over whitespace-separated symbols: it holds the vocabulary but not the
normalisation of raw text (PTB's lower case, ``N`` for numbers, its punctuation rules; WikiText-2's ``@-@``), which is
code (:meth:`zoo.tokenizer.Tokenizer.encode`). So every text is first normalised by the zoo's own tokenizer, the
symbols are joined by spaces, and that string goes through the fast tokenizer: the ids are the zoo's ids by
construction (a test checks them on every bundled model), and padding, truncation, ``return_tensors`` and batching
are transformers' own. Offsets (``return_offsets_mapping``) refer to that normalised string, not to the raw text.

Conventions, the zoo's written in transformers' terms:

* a line break is ``<eos>``; a text that ends with a line break ends with ``<eos>`` (one without it does not: a
  prompt to continue);
* ``<eos>`` is also ``bos_token`` and ``pad_token`` and is *not* added by default (``add_bos_token=False``, as
  GPT-2's ``<|endoftext|>``): the zoo conditions a text's first token on one ``<eos>``, and what adds it is the
  caller. lm-eval's ``hf`` model does so itself (its ``prefix_token_id`` is the ``bos_token``); elsewhere write it
  in the text (``"<eos>"`` is read as the token) or pass ``add_bos_token=True``;
* decoding is the zoo's (:meth:`zoo.tokenizer.Tokenizer.decode`): ``<eos>`` becomes a line break unless
  ``skip_special_tokens``, words are joined by spaces, a character model's ``_`` is a space.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from zoo.checkpoint import TOKENIZER_FILE, load_tokenizer, read_config
from zoo.data import EOS, UNK
from zoo.errors import CheckpointError
from zoo.tokenizer import Tokenizer

_LITERAL_EOS = re.compile(f"({re.escape(EOS)})")


class AlstmZooTokenizer(PreTrainedTokenizerFast):
    """A zoo checkpoint's tokenizer (see the module docstring). Built by :meth:`from_pretrained` from a checkpoint
    folder (``config.json`` says the normalisation, ``vocab.json`` the vocabulary, ``tokenizer.json`` the table),
    or directly from a :class:`zoo.tokenizer.Tokenizer` with :meth:`from_zoo`."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, *args: Any, zoo_tokenizer: Tokenizer | None = None, **kwargs: Any):
        if zoo_tokenizer is None:
            raise ValueError("AlstmZooTokenizer needs the zoo tokenizer: load it with "
                             "AlstmZooTokenizer.from_pretrained(<checkpoint folder>) or AutoTokenizer.from_pretrained "
                             "after `import zoo.hf`")
        self.zoo_tokenizer = zoo_tokenizer
        for name, token in (("bos_token", EOS), ("eos_token", EOS), ("pad_token", EOS),
                            ("unk_token", UNK if UNK in zoo_tokenizer.index else None)):
            kwargs.setdefault(name, token)
        kwargs.setdefault("add_bos_token", False)
        kwargs.setdefault("add_eos_token", False)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(*args, **kwargs)

    @classmethod
    def from_zoo(cls, tokenizer: Tokenizer, tokenizer_file: str | os.PathLike | None = None,
                 **kwargs: Any) -> AlstmZooTokenizer:
        """The transformers tokenizer of a zoo tokenizer: over ``tokenizer_file`` when given (a checkpoint's, which
        must hold exactly this vocabulary), else over the table the zoo writes into checkpoints
        (:meth:`zoo.tokenizer.Tokenizer.to_hf_json`)."""
        from tokenizers import Tokenizer as Backend

        if tokenizer_file is not None:
            try:
                backend = Backend.from_file(str(tokenizer_file))
            except Exception as e:  # noqa: BLE001 (tokenizers raises its own exception types)
                raise CheckpointError(f"{tokenizer_file}: not a tokenizers file ({str(e)[:120]})") from None
            if backend.get_vocab(with_added_tokens=False) != tokenizer.index:
                raise CheckpointError(f"{tokenizer_file}: its vocabulary is not the checkpoint's vocab.json")
        else:
            import json

            backend = Backend.from_str(json.dumps(tokenizer.to_hf_json()))
        return cls(tokenizer_object=backend, zoo_tokenizer=tokenizer, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any,
                        **kwargs: Any) -> AlstmZooTokenizer:
        """A checkpoint folder, a catalogue name or a Hub repo, resolved as the model is
        (:func:`zoo.hf.modeling.resolve_checkpoint`); only the tokenizer's own files are read."""
        from zoo.hf.modeling import resolve_checkpoint

        directory, _ = resolve_checkpoint(pretrained_model_name_or_path, kwargs)
        config = read_config(directory)
        tokenizer = load_tokenizer(directory, config)
        table = Path(directory) / TOKENIZER_FILE
        options = {k: kwargs[k] for k in ("add_bos_token", "add_eos_token", "padding_side", "truncation_side",
                                          "model_max_length") if kwargs.get(k) is not None}
        tok = cls.from_zoo(tokenizer, table if table.is_file() else None, **options)
        tok.name_or_path = str(pretrained_model_name_or_path)
        return tok

    # -- encoding: the zoo's normalisation first -----------------------------------------------------------
    def normalize_text(self, text: str) -> str:
        """The zoo's symbols of ``text``, space-separated (see the module docstring); a literal ``<eos>`` is the
        token."""
        out: list[str] = []
        for piece in _LITERAL_EOS.split(text):
            if piece == EOS:
                out.append(EOS)
            elif piece:
                out.extend(self.zoo_tokenizer.encode(piece, add_eos=piece.endswith("\n")).tokens)
        return " ".join(out)

    def _normalize_input(self, text: Any) -> Any:
        if isinstance(text, str):
            return self.normalize_text(text)
        if isinstance(text, list | tuple) and all(isinstance(t, str) for t in text):
            return [self.normalize_text(t) for t in text]
        return text

    def _encode_plus(self, text: Any, text_pair: Any = None, *args: Any, is_split_into_words: bool = False,
                     **kwargs: Any):
        if not is_split_into_words:  # (pre-split words are the caller's symbols: passed through)
            text, text_pair = self._normalize_input(text), self._normalize_input(text_pair)
        return super()._encode_plus(text, text_pair, *args, is_split_into_words=is_split_into_words, **kwargs)

    # -- decoding: the zoo's -------------------------------------------------------------------------------
    def _decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
                clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return self.zoo_tokenizer.decode([int(i) for i in token_ids if int(i) not in skip])
