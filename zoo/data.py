"""Benchmark corpora (PTB, PTB-char, WikiText-2) read from a local data directory.

Nothing is ever downloaded: the corpora live in a data dir chosen by an explicit argument (``--data-dir``)
or ``$ZOO_DATA_DIR``; the library assumes no location of its own (a checkout's ``.venv`` sets
``$ZOO_DATA_DIR`` to ``../shared/data``, see the Makefile). Token
streams follow the AWD-LSTM / aLSTM ``data.py`` convention (split on whitespace, one ``<eos>``
per line, vocabulary in first-occurrence order over train, valid, test), so perplexities are
comparable with the published numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from zoo.datasets import DATASETS, get_dataset  # noqa: F401 (DATASETS re-exported)
from zoo.errors import DataError  # noqa: F401 (re-exported)

EOS = "<eos>"
UNK = "<unk>"
SPLITS = ("train", "valid", "test")


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data dir from the argument or ``$ZOO_DATA_DIR``; neither given is a :class:`DataError` saying how."""
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get("ZOO_DATA_DIR")
    if not env:
        raise DataError("no data directory: set ZOO_DATA_DIR to the folder holding "
                        f"{', '.join(d + '/' for d in DATASETS)} (each with train.txt, valid.txt, test.txt), or "
                        "give it (data_dir= in Python; --data-dir of zoo eval and zoo train)")
    return Path(env)


def corpus_files(dataset: str, data_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Paths of ``train.txt``/``valid.txt``/``test.txt``; a clear error names what is missing."""
    get_dataset(dataset)  # an unknown name is an UnknownDatasetError naming the registered ones
    root = resolve_data_dir(data_dir)
    files = {split: root / dataset / f"{split}.txt" for split in SPLITS}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise DataError(
            f"dataset {dataset!r} not found: expected {', '.join(missing)} "
            f"(set ZOO_DATA_DIR, or data_dir= / --data-dir where there is one, to the folder holding "
            f"{dataset}/train.txt, valid.txt, test.txt)"
        )
    return files


def read_tokens(path: Path) -> list[str]:
    """Whitespace tokens of a file with one ``<eos>`` appended per line.

    Read whole (the corpora are megabytes) so that a byte that is not UTF-8 is reported by line and byte offset
    as a :class:`DataError`, not as a decoder traceback."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: not valid UTF-8 (line {line}, byte {e.start})") from None
    # lines as a text-mode file iterates them (universal newlines: \n, \r\n, \r), not str.splitlines(), which
    # also breaks at form feeds and Unicode separators and would change the corpora's token streams
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines[-1] == "":
        lines.pop()
    tokens: list[str] = []
    for line in lines:
        tokens.extend(line.split())
        tokens.append(EOS)
    return tokens


@dataclass
class Corpus:
    """A tokenised corpus: vocabulary (id order) and the three splits as id tensors."""

    name: str
    vocab: list[str]
    train: Tensor
    valid: Tensor
    test: Tensor

    def split(self, name: str) -> Tensor:
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}; use one of {', '.join(SPLITS)}")
        return getattr(self, name)


@lru_cache(maxsize=4)
def _load_corpus_cached(dataset: str, root: str) -> Corpus:
    files = corpus_files(dataset, root)
    streams = {split: read_tokens(path) for split, path in files.items()}
    index: dict[str, int] = {}
    for split in SPLITS:
        for tok in streams[split]:
            if tok not in index:
                index[tok] = len(index)
    ids = {s: torch.tensor([index[t] for t in streams[s]], dtype=torch.long) for s in SPLITS}
    return Corpus(dataset, list(index), ids["train"], ids["valid"], ids["test"])


def load_corpus(dataset: str, data_dir: str | os.PathLike | None = None) -> Corpus:
    """Load (and cache in-process) a corpus by name."""
    return _load_corpus_cached(dataset, str(resolve_data_dir(data_dir)))


def batchify(data: Tensor, batch_size: int) -> Tensor:
    """Cut a token stream into ``batch_size`` contiguous columns: ``[rows, batch_size]`` (time-major)."""
    rows = data.numel() // batch_size
    if rows < 2:
        raise DataError(f"a stream of {data.numel()} tokens is too short for batch size {batch_size}")
    return data[: rows * batch_size].view(batch_size, rows).t().contiguous()


def get_batch(source: Tensor, i: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """Inputs and targets ``[B, T]`` (batch-first) for rows ``i .. i+T`` of a batchified stream."""
    seq_len = min(seq_len, source.shape[0] - 1 - i)
    x = source[i:i + seq_len].t()
    y = source[i + 1:i + 1 + seq_len].t()
    return x, y


# -- sentence-level data (independent sequences, as the p-norm paper's character-level experiment) -----------
def sentences(stream: Tensor, eos_id: int, max_len: int, limit: int = 0, seed: int = 0) -> list[Tensor]:
    """Each line of a token stream as its own sequence ``[<eos>, t_1 .. t_n, <eos>]``.

    A line's tokens are truncated to ``max_len`` (a truncated line then has no closing ``<eos>``: it did not end
    there), so a sequence predicts at most ``max_len + 1`` symbols; its first token is conditioned on ``<eos>``,
    as in stream scoring. Empty lines (nothing but ``<eos>``) are left out. ``limit > 0`` keeps a fixed random
    sample of that many lines (``numpy.random.default_rng(seed)``, in corpus order), the same for every run.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be at least 1, got {max_len}")
    ends = (stream == eos_id).nonzero().flatten().tolist()
    out: list[Tensor] = []
    start = 0
    eos = stream.new_tensor([eos_id])
    for end in ends:
        line = stream[start:end]
        start = end + 1
        if line.numel() == 0:
            continue
        body = line[:max_len]
        out.append(torch.cat([eos, body, eos]) if line.numel() <= max_len else torch.cat([eos, body]))
    if limit and limit < len(out):
        import numpy as np

        keep = np.sort(np.random.default_rng(seed).choice(len(out), size=limit, replace=False))
        out = [out[i] for i in keep]
    return out


#: The target id of padding in :func:`pad_batch` (``cross_entropy``'s default ``ignore_index``).
PAD_TARGET = -100


def pad_batch(seqs: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """Inputs and targets ``[B, T]`` of a batch of sequences (each ``[<eos>, ...]``), right-padded.

    Padded inputs hold ``pad_id`` (an RNN is causal: what follows a sequence's end never changes its scores);
    padded targets hold :data:`PAD_TARGET`, which the loss ignores, so padding never contributes to it.
    """
    longest = max(s.numel() for s in seqs) - 1
    x = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    y = torch.full((len(seqs), longest), PAD_TARGET, dtype=torch.long)
    for b, s in enumerate(seqs):
        n = s.numel() - 1
        x[b, :n] = s[:-1]
        y[b, :n] = s[1:]
    return x, y
