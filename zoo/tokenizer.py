"""Raw text to token ids, normalised the way each training corpus was.

A perplexity is only meaningful on text that looks like the training corpus, so every model
carries its tokenizer (vocabulary plus normalisation) in its checkpoint:

* ``ptb``: Mikolov's PTB: lower case, numbers (and ``%``) to ``N``, punctuation dropped except
  inside abbreviations kept by the vocabulary (``mr.``, ``u.s.``), clitics split (``do n't``,
  ``it 's``), out-of-vocabulary words (an emoji included) to ``<unk>``.
* ``wikitext``: WikiText-2's tokenisation: case kept, punctuation split into tokens, ``@-@``,
  ``@,@`` and ``@.@`` inside words and numbers, clitics split (``don 't``), OOV to ``<unk>``.
* ``ptb-char``: the PTB normalisation without the word vocabulary, keeping what the PTB-char corpus
  keeps (the period of ``mr.``, ``co.``, ``u.s.``; symbols such as ``#`` and ``*``), then one token
  per character with ``_`` for a space. A character outside the vocabulary is spelled ``<unk>`` as the
  corpus spells unknown words, and counted as out of vocabulary.

Text is first put in Unicode NFC form, the form every corpus is in (checked: no line of any split changes), so
that a decomposed accent (``e`` + U+0301, as some editors and macOS file names write it) finds the vocabulary's
``é`` instead of becoming two ``<unk>``. Every line then becomes its tokens followed by ``<eos>``, as in the
corpora. No input character
is lost silently: each is scored as a vocabulary symbol, scored as ``<unk>`` and listed in
``oov_items``, or, if the corpus never has it (PTB's punctuation), listed in ``dropped`` (see
:meth:`Tokenizer.line_pieces`; a test accounts for every character of awkward inputs).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from zoo.data import EOS, UNK
from zoo.errors import ConfigError, WrongType

NORMALIZATIONS = ("ptb", "wikitext", "ptb-char")

_PTB_CLITIC = re.compile(r"(\w)(n't)\b")
_PTB_CLITIC2 = re.compile(r"(\w)('(?:s|re|ve|ll|d|m))\b")
_PTB_TOKEN = re.compile(r"<unk>|\$|%|&|n't|'(?:s|re|ve|ll|d|m)\b|[+\-]?\d+(?:[.,/:\-]\d+)*(?:s|th|st|nd|rd)?\b"
                        r"|[^\W_]+(?:[.\-&/][^\W_]+)*\.?|\S")
#: The PTB corpus's abbreviations with a final period and no inner one (every word of ``ptb/train.txt`` that ends in
#: ``.``; the PTB-char corpus spells them the same way): a character model keeps their period, as its corpus does,
#: while a sentence's final period (which PTB dropped) is dropped. Words with an inner period (``u.s.``) keep it anyway.
PTB_ABBREVIATIONS = frozenset((
    "a adm ala ariz aug b bros c calif cie co col colo conn corp cos d dec del dr e etc f feb fla g ga "
    "gen gov h i ill inc ind j jan jr k kan ky l ltd m mass md messrs mich minn mo mr mrs ms n neb nev no "
    "nov o oct okla ore p pa prof r rep rev s sen sens sept sr st t tenn v va vs w wash wis"
).split())
#: The PTB vocabulary's words that the rules below would cut or change (computed from ``ptb/train.txt``'s vocabulary,
#: and tested to be exactly those): Mikolov's preprocessing turned numbers into ``N`` but kept these words, and the
#: PTB-char corpus spells them out as they are (``1980s``, ``500-stock``, ``us$``, ``mgm\\/ua``), so a character
#: model keeps them whole too: every line of every PTB-char split, read as text, encodes to itself (tested).
PTB_KEPT_WORDS = frozenset((
    "'80s 10-year 100-share 12-month 12-year 13-week 13th 14-year-old 190-point 190.58-point 1920s 1930s 1950s "
    "1960s 1970s 1980s 1990s 19th 1\\/2-year 2-for-1 20-year 20th 24-hour 26-week 30-day 30-share 30-year "
    "300-a-share 300-day 40-year-old 45-year-old 500-stock 52-week \\* \\*\\* a$ c$ calif.-based cities\\/abc "
    "d'arcy hk$ m$ mgm\\/ua o'brien o'connell o'kicki property\\/casualty u.s.-soviet us$"
).split())
#: Initials written with periods (``I.B.M.``): a word model whose vocabulary has only the bare form (``ibm``) reads
#: them as that word.
_INITIALS = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]\.?")
_NUMBER = re.compile(r"^[+\-]?(\d[\d,./\-]*)(s|th|st|nd|rd)?$")
_WIKI_CLITIC = re.compile(r"(\w)('(?:s|t|re|ve|ll|d|m))\b")
_WIKI_TOKEN = re.compile(r"\w+|@[-,.]@|[^\w\s]")
#: a whitespace-delimited word of printable ASCII holding a letter or digit: one symbol at least under every
#: normalisation (:meth:`Tokenizer.min_tokens`)
_COUNTED_WORD = re.compile(r"(?<!\S)[!-~]*[A-Za-z0-9][!-~]*(?!\S)")


@dataclass
class Encoding:
    """The tokens of one text: what the model scores, and what was out of vocabulary."""

    ids: list[int]
    tokens: list[str]
    oov: int = 0
    oov_items: list[str] = field(default_factory=list)
    num_chars: int = 0
    #: The input text each token came from ("" for inserted tokens: ``<eos>``, ``_``, the spelling of ``<unk>``).
    sources: list[str] = field(default_factory=list)
    #: Input text the normalisation dropped because the corpus never has it (PTB's punctuation).
    dropped: list[str] = field(default_factory=list)


class Tokenizer:
    """Vocabulary plus corpus normalisation; serialisable into a checkpoint's config."""

    def __init__(self, vocab: list[str], normalization: str):
        if normalization not in NORMALIZATIONS:
            raise ConfigError(f"unknown normalization {normalization!r}; known: {', '.join(NORMALIZATIONS)}")
        if EOS not in vocab:
            raise ConfigError("vocabulary has no <eos>")
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

    def to_hf_json(self) -> dict[str, Any]:
        """This vocabulary as a Hugging Face ``tokenizers`` file (``tokenizer.json``): other tools read it.

        A ``WordLevel`` model over whitespace-separated symbols with one ``<eos>`` appended per encoded line, so
        on text in the corpus's own conventions (every line of the benchmark splits) it gives exactly the zoo's
        ids; a character model's symbols are the corpus's space-separated characters (``_`` between words).
        What it does not carry is the zoo's normalisation of raw text (PTB's lower case, ``N`` for numbers, its
        punctuation rules): that is code (:meth:`encode`), not a table, so text must be normalised first.
        """
        special = [t for t in (EOS, UNK) if t in self.index]
        added = [{"id": self.index[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for t in special]
        eos = {"SpecialToken": {"id": EOS, "type_id": 0}}
        decoder = ({"type": "Sequence", "decoders": [
            {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "_"}, "content": " "}]}
            if self.is_char else None)
        normalizer = None
        if self.is_char and UNK not in self.index and all(ch in self.index for ch in UNK):
            # A character vocabulary has no <unk> symbol: the zoo spells a character outside the alphabet as the
            # corpus spells an unknown word, < u n k >, and so does this file (WordLevel's unk_token, absent
            # from the vocabulary, would make tokenizers fail instead). Every character as \x{HEX}: no escaping
            # rules of the regex engine to get wrong.
            alphabet = "".join(f"\\x{{{ord(s):x}}}" for s in sorted(self.index) if len(s) == 1)
            normalizer = {"type": "Replace", "pattern": {"Regex": f"[^{alphabet}\\s]"},
                          "content": " " + " ".join(UNK) + " "}
        return {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"Sequence": {"id": "A", "type_id": 0}}, eos],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, eos, {"Sequence": {"id": "B", "type_id": 1}}, eos],
                "special_tokens": {EOS: {"id": EOS, "ids": [self.eos_id], "tokens": [EOS]}},
            },
            "decoder": decoder,
            "model": {"type": "WordLevel", "vocab": dict(self.index), "unk_token": UNK},
        }

    # -- normalisation ---------------------------------------------------------------------------------
    # Each normaliser returns (symbol, source) pieces that cover every non-space character of the line exactly
    # once: ``source`` is the text the symbol came from; symbol None means the corpus never had that text and
    # it is dropped (PTB removed punctuation). Nothing else is ever lost: an input character is scored as a
    # vocabulary symbol, scored as <unk> and listed as OOV, or dropped and listed as dropped.
    def _ptb_pieces(self, line: str) -> list[tuple[str | None, str]]:
        # an already-normalised number token stays a number; lower case one character at a time so that
        # positions in the processed line are positions in ``line``
        proc = re.sub(r"(?<!\S)N(?!\S)", "0", line)
        proc = "".join(c.lower() if len(c.lower()) == 1 else c for c in proc)
        out: list[tuple[str | None, str]] = []
        for m in re.finditer(r"\S+", proc):
            cuts = sorted({m.start() + c.start(2) for rx in (_PTB_CLITIC, _PTB_CLITIC2) for c in rx.finditer(m[0])})
            bounds = [m.start(), *cuts, m.end()]
            for a, b in zip(bounds, bounds[1:], strict=False):
                if not self.is_char and proc[a:b] in self.index:  # a chunk the vocabulary knows stays whole
                    out.append((proc[a:b], line[a:b]))
                    continue
                if self.is_char:  # a PTB word the rules would cut stays whole, as the character corpus spells it
                    core = proc[a:b].rstrip(".,;:!?\"')")
                    if core in PTB_KEPT_WORDS:
                        out.append((core, line[a:a + len(core)]))
                        a += len(core)
                for t in _PTB_TOKEN.finditer(proc, a, b):
                    out.extend(self._ptb_symbol(t[0], line[t.start():t.end()]))
        return out

    def _ptb_symbol(self, tok: str, raw: str) -> list[tuple[str | None, str]]:
        """One regex token of the PTB normalisation -> its (symbol, source) pieces."""
        if tok == UNK:
            return [(tok, raw)]
        if tok == "%" or _NUMBER.match(tok):
            return [("N", raw)]
        if not self.is_char and tok not in self.index and _INITIALS.fullmatch(tok) \
                and tok.replace(".", "") in self.index:  # "i.b.m." -> "ibm"
            return [(tok.replace(".", ""), raw)]
        if tok in ("$", "&") or tok[0].isalnum() or tok.startswith("'") or tok == "n't":
            if tok.endswith(".") and len(tok) > 1:
                keep = "." in tok[:-1] or tok[:-1] in PTB_ABBREVIATIONS if self.is_char else tok in self.index
                if not keep:  # a sentence's final period: PTB dropped it
                    return [(tok[:-1], raw[:-1]), (None, raw[-1])]
            return [(tok, raw)]
        if tok in self.index and tok != ".":  # a symbol the corpus has (the character corpus keeps # * / \\ ...);
            return [(tok, raw)]              # a lone period ends a sentence, and PTB dropped those
        if unicodedata.category(tok[0])[0] in "PCZ":  # punctuation, control and format characters: PTB has none
            return [(None, raw)]
        return [(tok, raw)]  # any other symbol (an emoji, a sign): a word the model does not know

    def _wikitext_pieces(self, line: str) -> list[tuple[str | None, str]]:
        # A whitespace word the vocabulary knows stays whole before the splitting rules run: the corpus has a few
        # such words the rules would split (``1,000th``), and its own text must encode to itself.
        out: list[tuple[str | None, str]] = []
        for word in line.split():
            if word in self.index:
                out.append((word, word))
            else:
                out.extend(self._wikitext_word_pieces(word))
        return out

    def _wikitext_word_pieces(self, word: str) -> list[tuple[str | None, str]]:
        word = re.sub(r"(?<=\w)-(?=\w)", " @-@ ", word)
        word = re.sub(r"(?<=\d),(?=\d)", " @,@ ", word)
        word = re.sub(r"(?<=\d)\.(?=\d)", " @.@ ", word)
        word = _WIKI_CLITIC.sub(r"\1 \2", word)
        out: list[tuple[str | None, str]] = []
        for chunk in word.split():
            if chunk.startswith("@") and chunk.endswith("@") and len(chunk) == 3:
                out.append((chunk, chunk[1]))
            elif chunk in self.index:
                out.append((chunk, chunk))
            else:
                out.extend((t, t) for t in _WIKI_TOKEN.findall(chunk))
        return out

    def line_pieces(self, line: str) -> list[tuple[str | None, str]]:
        """``(symbol, source)`` pieces of one line, without ``<eos>``: every non-space character of the line is
        in exactly one source; symbol None = dropped by the normalisation. Character models split each word
        into characters (``_`` between words, with an empty source). Sources are the line's NFC form (see the
        module docstring): a decomposed ``e`` + U+0301 comes back as one ``é``."""
        line = unicodedata.normalize("NFC", line)
        if self.normalization == "wikitext":
            return self._wikitext_pieces(line)
        pieces = self._ptb_pieces(line)
        if not self.is_char:
            return pieces
        out: list[tuple[str | None, str]] = []
        for sym, raw in pieces:
            if sym is None:
                out.append((None, raw))
                continue
            if any(s is not None for s, _ in out):
                out.append(("_", ""))
            if len(sym) == len(raw):
                out.extend(zip(sym, raw, strict=True))
            else:  # "42" -> "N": the whole source goes with the first character
                out.extend([(sym[0], raw)] + [(c, "") for c in sym[1:]])
        return out

    def line_tokens(self, line: str) -> list[str]:
        """Normalised symbols of one line (before the vocabulary lookup), without ``<eos>``."""
        return [sym for sym, _ in self.line_pieces(line) if sym is not None]

    # -- encoding -----------------------------------------------------------------------------------------
    def min_tokens(self, text: str, add_eos: bool = True) -> int:
        """A lower bound on ``len(self.encode(text, add_eos).ids)``, at regex speed (no normalisation, no lookups):
        each line's ``<eos>``, and one symbol at least for each word holding an ASCII letter or digit (never
        dropped; unknown, it is ``<unk>``). For a server refusing a request far over its token budget without
        tokenising it (a flood of such requests cost the worker its time: ``Tokenizer.encode`` reads ~150,000
        characters a second). 0 where an unknown word could be dropped (a vocabulary without ``<unk>``)."""
        if (self.unk_id is None) if not self.is_char else not all(ch in self.index for ch in UNK):
            return 0
        lines = text.count("\n") + 1
        if lines > 1 and text.endswith("\n"):
            lines -= 1  # (as encode: a trailing newline ends the last line)
        return lines - (0 if add_eos else 1) + len(_COUNTED_WORD.findall(text))

    def encode(self, text: str, add_eos: bool = True) -> Encoding:
        """Tokens of ``text``: each line's symbols plus ``<eos>`` (the last one only if ``add_eos``)."""
        if not isinstance(text, str):
            raise WrongType(f"text must be a str, got {type(text).__name__}")
        enc = Encoding(ids=[], tokens=[], num_chars=len(text))
        lines = text.split("\n")
        if len(lines) > 1 and lines[-1] == "":
            lines.pop()  # a trailing newline ends the last line; it does not start a new one
        for n, line in enumerate(lines):
            for sym, src in self.line_pieces(line):
                if sym is None:
                    enc.dropped.append(src)
                else:
                    self._append(enc, sym, src)
            if add_eos or n < len(lines) - 1:
                enc.ids.append(self.eos_id)
                enc.tokens.append(EOS)
                enc.sources.append("")
        return enc

    def _append(self, enc: Encoding, sym: str, src: str = "") -> None:
        idx = self.index.get(sym)
        if idx is not None:
            enc.ids.append(idx)
            enc.tokens.append(sym)
            enc.sources.append(src)
            return
        if (self.unk_id is None) if not self.is_char else not all(ch in self.index for ch in UNK):
            enc.dropped.append(src or sym)  # a vocabulary with no way to say <unk> (not a corpus's): dropped
            return
        enc.oov += 1
        enc.oov_items.append(sym)
        if self.is_char:
            for k, ch in enumerate(UNK):
                enc.ids.append(self.index[ch])
                enc.tokens.append(ch)
                enc.sources.append(src if k == 0 else "")
        else:
            enc.ids.append(self.unk_id)
            enc.tokens.append(UNK)
            enc.sources.append(src)

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
