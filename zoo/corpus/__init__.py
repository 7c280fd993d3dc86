"""Score a whole corpus: every document of JSONL, Parquet or plain-text shards, on this machine (a pool of
processes) or a Ray cluster (Ray Data), resumable, with per-document scores equal to :meth:`zoo.ZooModel.score`'s
(``zoo score-corpus``, :func:`score_corpus`; the datatrove blocks are in :mod:`zoo.corpus.datatrove_blocks`)."""

from zoo.corpus.job import score_corpus

__all__ = ["score_corpus"]
