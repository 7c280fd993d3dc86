"""datatrove blocks: the zoo's per-document scores in ``Document.metadata`` (:class:`ZooScorer`), and a filter that
keeps documents within a perplexity or bits-per-character range (:class:`ZooPerplexityFilter`, as CCNet's
perplexity buckets do with KenLM). Both score a batch of documents through
:func:`zoo.corpus.shard.score_in_order`, the function ``zoo score-corpus`` uses: the same numbers (to float
tolerance, 1e-6 relative: which texts share a batch moves the 7th digit), the same per-record errors.

The model is loaded once per datatrove task, in the process that runs it (the step pickles without it), with
``threads`` torch threads there (one task per core: 1). Needs ``pip install 'alstm-zoo[corpus]'`` (datatrove).
"""

from __future__ import annotations

from typing import Any

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.utils.batching import batched

from zoo.corpus.engines import load_model
from zoo.corpus.records import Record, check_record_text
from zoo.corpus.shard import score_in_order

#: The per-text fields of :class:`zoo.scoring.ScoreReport` put in the metadata (each as ``prefix + name``).
METADATA_FIELDS = ("num_tokens", "nll", "avg_nll", "ppl", "bits_per_token", "bits_per_input_char",
                   "bits_per_input_char_charged", "oov", "num_unk", "num_dropped", "num_visible_chars",
                   "num_unseen_chars", "warnings")


class _ZooScoring:
    """What both blocks share: the model spec, its lazy load, and scoring a batch of documents into metadata."""

    def _setup(self, model: str, prefix: str, batch_size: int, backend: str, precision: str, device: str,
               threads: int | None) -> None:
        self.spec = {"model": str(model), "backend": backend, "precision": precision, "revision": None,
                     "device": device}
        self.prefix, self.score_batch_size, self.threads = prefix, batch_size, threads
        self._model: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_model": None}  # (the executor ships the step; each task loads its own model)

    def _score_docs(self, docs: list[Document]) -> None:
        """Each document's scores (or ``<prefix>error``) added to its metadata."""
        if self._model is None:
            self._model = load_model(self.spec, self.threads)
        recs = [check_record_text(Record(i, str(d.id)), d.text, "text") for i, d in enumerate(docs)]
        valid = [r for r in recs if r.text is not None]
        results = score_in_order(self._model, [r.text for r in valid], self.score_batch_size) if valid else []
        by_index = {r.index: res for r, res in zip(valid, results, strict=True)}
        for rec, doc in zip(recs, docs, strict=True):
            res = by_index.get(rec.index)
            if res is None:
                doc.metadata[f"{self.prefix}error"] = f"{rec.error_kind}: {rec.error}"
                self.stat_update(f"{self.prefix}{rec.error_kind}")
                continue
            doc.metadata.update({f"{self.prefix}{k}": res[k] for k in METADATA_FIELDS})
            self.stat_update(f"{self.prefix}tokens", value=res["num_tokens"])


class ZooScorer(_ZooScoring, PipelineStep):
    """Adds ``<prefix><field>`` to each document's metadata for every per-text field of the zoo's score (perplexity,
    NLL, bits per token and per input character, ``<unk>`` counts, warnings); a document that cannot be scored
    (empty, binary) gets ``<prefix>error`` instead and passes on. ``docs_per_batch`` documents are scored together
    (sorted by length inside, in batches of ``batch_size``)."""

    name = "zoo scores"
    type = "📊 - STATS"

    def __init__(self, model: str = "default", prefix: str = "zoo_", docs_per_batch: int = 256, batch_size: int = 16,
                 backend: str = "eager", precision: str = "fp32", device: str = "cpu", threads: int | None = 1):
        super().__init__()
        self._setup(model, prefix, batch_size, backend, precision, device, threads)
        self.docs_per_batch = docs_per_batch

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for batch in batched(data, self.docs_per_batch):
            with self.track_time("batch"):
                self._score_docs(batch)
            for doc in batch:
                self.stat_update("scored" if f"{self.prefix}ppl" in doc.metadata else "errors")
                yield doc


class ZooPerplexityFilter(_ZooScoring, BaseFilter):
    """Keeps the documents whose perplexity is within ``[min_ppl, max_ppl]`` and bits per input character within
    ``[min_bpc, max_bpc]`` (any bound left ``None`` is open); the scores are added to the metadata as
    :class:`ZooScorer` adds them (also on the documents dropped, for an ``exclusion_writer``). A document that
    cannot be scored is dropped with reason ``zoo_error``. Scored ``batch_size`` documents at a time."""

    name = "zoo perplexity filter"

    def __init__(self, model: str = "default", min_ppl: float | None = None, max_ppl: float | None = None,
                 min_bpc: float | None = None, max_bpc: float | None = None, prefix: str = "zoo_",
                 exclusion_writer: Any = None, batch_size: int = 256, score_batch_size: int = 16,
                 backend: str = "eager", precision: str = "fp32", device: str = "cpu", threads: int | None = 1):
        super().__init__(exclusion_writer=exclusion_writer, batch_size=batch_size)
        self._setup(model, prefix, score_batch_size, backend, precision, device, threads)
        self.bounds = {"ppl": (min_ppl, max_ppl), "bits_per_input_char": (min_bpc, max_bpc)}

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        return self.filter_batch([doc])[0]

    def filter_batch(self, batch: list[Document]) -> list[bool | tuple[bool, str]]:
        self._score_docs(batch)
        return [self._verdict(doc) for doc in batch]

    def _verdict(self, doc: Document) -> bool | tuple[bool, str]:
        if f"{self.prefix}error" in doc.metadata:
            return False, "zoo_error"
        for key, (lo, hi) in self.bounds.items():
            value = doc.metadata[f"{self.prefix}{key}"]
            if value is None:
                return False, f"no_{key}"
            if lo is not None and value < lo:
                return False, f"{key}_below_{lo:g}"
            if hi is not None and value > hi:
                return False, f"{key}_above_{hi:g}"
        return True
