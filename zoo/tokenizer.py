"""Raw text to token ids, normalised the way each training corpus was.

A perplexity is only meaningful on text that looks like the training corpus, so every model
carries its tokenizer (vocabulary plus normalisation) in its checkpoint:

* ``ptb``: Mikolov's PTB: lower case, numbers (and ``%``) to ``N``, punctuation dropped except
  inside abbreviations kept by the vocabulary (``mr.``, ``u.s.``), clitics split (``do n't``,
  ``it 's``), out-of-vocabulary words to ``<unk>``.
* ``wikitext``: WikiText-2's tokenisation: case kept, punctuation split into tokens, ``@-@``,
  ``@,@`` and ``@.@`` inside words and numbers, clitics split (``don 't``), OOV to ``<unk>``.
* ``ptb-char``: the PTB normalisation without the word vocabulary, then one token per character
  with ``_`` for a space. A character outside the vocabulary is spelled ``<unk>`` as the corpus
  spells unknown words, and counted as out of vocabulary, never silently dropped.

Every line of the text becomes its tokens followed by ``<eos>``, as in the corpora.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from zoo.data import EOS, UNK

NORMALIZATIONS = ("ptb", "wikitext", "ptb-char")

_PTB_CLITIC = re.compile(r"(\w)(n't)\b")
_PTB_CLITIC2 = re.compile(r"(\w)('(?:s|re|ve|ll|d|m))\b")
_PTB_TOKEN = re.compile(r"<unk>|\$|%|&|n't|'(?:s|re|ve|ll|d|m)\b|[+\-]?\d+(?:[.,/:\-]\d+)*(?:s|th|st|nd|rd)?\b"
                        r"|[^\W_]+(?:[.\-&/][^\W_]+)*\.?|\S")
_NUMBER = re.compile(r"^[+\-]?(\d[\d,./\-]*)(s|th|st|nd|rd)?$")
_WIKI_CLITIC = re.compile(r"(\w)('(?:s|t|re|ve|ll|d|m))\b")
_WIKI_TOKEN = re.compile(r"\w+|@[-,.]@|[^\w\s]")


@dataclass
class Encoding:
    """The tokens of one text: what the model scores, and what was out of vocabulary."""

    ids: list[int]
    tokens: list[str]
    oov: int = 0
    oov_items: list[str] = field(default_factory=list)
    num_chars: int = 0


class Tokenizer:
    """Vocabulary plus corpus normalisation; serialisable into a checkpoint's config."""

    def __init__(self, vocab: list[str], normalization: str):
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {normalization!r}; known: {', '.join(NORMALIZATIONS)}")
        if EOS not in vocab:
            raise ValueError("vocabulary has no <eos>")
        self.vocab = list(vocab)
        self.normalization = normalization
        self.index = {tok: i for i, tok in enumerate(self.vocab)}
        self.eos_id = self.index[EOS]
        self.unk_id = self.index.get(UNK)
        self.is_char = normalization == "ptb-char"

    def __len__(self) -> int:
        return len(self.vocab)

    def to_dict(self) -> dict[str, Any]:
        return {"normalization": self.normalization, "vocab_file": "vocab.json", "vocab_size": len(self.vocab)}

    # -- normalisation ---------------------------------------------------------------------------------
    def _ptb_words(self, line: str) -> list[str]:
        line = re.sub(r"(?<!\S)N(?!\S)", "0", line)  # an already-normalised number token stays a number
        line = _PTB_CLITIC2.sub(r"\1 \2", _PTB_CLITIC.sub(r"\1 \2", line.lower()))
        words: list[str] = []
        pieces: list[str] = []
        for chunk in line.split():  # a chunk the vocabulary knows as is (e.g. "cities\\/abc") stays whole
            if not self.is_char and chunk in self.index:
                pieces.append(chunk)
            else:
                pieces.extend(_PTB_TOKEN.findall(chunk))
        for tok in pieces:
            if tok == UNK:
                words.append(tok)
            elif tok == "%" or _NUMBER.match(tok):
                words.append("N")
            elif tok in ("$", "&") or tok[0].isalnum() or tok.startswith("'") or tok == "n't":
                if tok.endswith(".") and (self.is_char or tok not in self.index):
                    tok = tok[:-1]
                if tok:
                    words.append(tok)
            # any other single symbol is punctuation, which PTB dropped
        return words

    def _wikitext_words(self, line: str) -> list[str]:
        line = re.sub(r"(?<=\w)-(?=\w)", " @-@ ", line)
        line = re.sub(r"(?<=\d),(?=\d)", " @,@ ", line)
        line = re.sub(r"(?<=\d)\.(?=\d)", " @.@ ", line)
        line = _WIKI_CLITIC.sub(r"\1 \2", line)
        out: list[str] = []
        for chunk in line.split():
            if chunk.startswith("@") and chunk.endswith("@") and len(chunk) == 3:
                out.append(chunk)
            elif chunk in self.index:
                out.append(chunk)
            else:
                out.extend(_WIKI_TOKEN.findall(chunk))
        return out

    def line_tokens(self, line: str) -> list[str]:
        """Normalised symbols of one line (before the vocabulary lookup), without ``<eos>``."""
        if self.normalization == "wikitext":
            return self._wikitext_words(line)
        words = self._ptb_words(line)
        if not self.is_char:
            return words
        return list("_".join(words))

    # -- encoding -----------------------------------------------------------------------------------------
    def encode(self, text: str, add_eos: bool = True) -> Encoding:
        """Tokens of ``text``: each line's symbols plus ``<eos>`` (the last one only if ``add_eos``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        enc = Encoding(ids=[], tokens=[], num_chars=len(text))
        lines = text.split("\n")
        if len(lines) > 1 and lines[-1] == "":
            lines.pop()  # a trailing newline ends the last line; it does not start a new one
        for n, line in enumerate(lines):
            for sym in self.line_tokens(line):
                self._append(enc, sym)
            if add_eos or n < len(lines) - 1:
                enc.ids.append(self.eos_id)
                enc.tokens.append(EOS)
        return enc

    def _append(self, enc: Encoding, sym: str) -> None:
        idx = self.index.get(sym)
        if idx is not None:
            enc.ids.append(idx)
            enc.tokens.append(sym)
            return
        enc.oov += 1
        enc.oov_items.append(sym)
        if self.is_char:
            for ch in UNK:
                enc.ids.append(self.index[ch])
                enc.tokens.append(ch)
        else:
            enc.ids.append(self.unk_id)
            enc.tokens.append(UNK)

    def count_unk(self, enc: Encoding) -> int:
        """How many scored tokens are ``<unk>`` (word models) or out-of-vocabulary characters."""
        if self.is_char:
            return enc.oov
        return sum(1 for i in enc.ids if i == self.unk_id)

    def decode(self, ids: list[int]) -> str:
        """Detokenised text; ``<eos>`` becomes a newline."""
        toks = [self.vocab[i] for i in ids]
        if self.is_char:
            return "".join("\n" if t == EOS else t for t in toks).replace("_", " ")
        lines, cur = [], []
        for t in toks:
            if t == EOS:
                lines.append(" ".join(cur))
                cur = []
            else:
                cur.append(t)
        lines.append(" ".join(cur))
        text = "\n".join(lines)
        if self.normalization == "wikitext":
            text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
        return text

    def token_text(self, idx: int) -> str:
        """The display form of one token (as used when streaming)."""
        tok = self.vocab[idx]
        if tok == EOS:
            return "\n"
        if self.is_char:
            return " " if tok == "_" else tok
        if self.normalization == "wikitext" and tok in ("@-@", "@,@", "@.@"):
            return tok[1]
        return tok
