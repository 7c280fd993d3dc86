"""Scoring one shard with a loaded model: the one function every engine (this process, the process pool, Ray Data's
actors) and the datatrove blocks call, so that each gives the same numbers.

The scores are :meth:`zoo.ZooModel.score`'s, nothing re-implemented: within a chunk of a shard the texts are
sorted by length and handed to it in calls of whole batches holding :data:`CALL_CHARS` characters, where it
batches them by token length and scores each text exactly (a long text in bounded pieces with its state carried,
:func:`zoo.scoring.token_logprob_steps`; padding is masked, so no document's result or token count includes another
document's padding). Batched scores equal one-at-a-time scores to float tolerance (1e-6 relative).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zoo.corpus.output import ROW_FIELDS, ShardWriter, atomic_write_text, stats_path
from zoo.corpus.records import ERROR_KINDS, Record, Shard, read_records
from zoo.scoring import COUNT_FIELDS

#: Characters per call to ``model.score`` at least (sorted texts of similar length, in whole batches: a call cut
#: mid-batch would leave a partial batch; measured on WikiText-2 lines, batches of fewer rows cost up to 2x per token).
CALL_CHARS = 1 << 18
#: The summed per-text fields that make a corpus aggregate (:func:`zoo.scoring.aggregate`).
SUMS = ("nll", "num_tokens", "num_chars", *COUNT_FIELDS)

Progress = Callable[[int, int], None]  # (documents, tokens) just done


def score_in_order(model: Any, texts: list[str], batch_size: int = 16,
                   progress: Progress | None = None) -> list[dict[str, Any]]:
    """``model.score(texts).texts``, in the texts' order, computed in calls of similar-length texts (the library's
    own batching within each call) so that memory and padding stay bounded on a corpus of any mix of lengths."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    results: list[dict[str, Any] | None] = [None] * len(texts)
    start = 0
    while start < len(order):
        end, chars = start, 0  # whole batches of ``batch_size`` texts until the call holds CALL_CHARS
        while end < len(order) and (chars < CALL_CHARS or (end - start) % batch_size):
            chars += len(texts[order[end]])
            end += 1
        group = order[start:end]
        report = model.score([texts[i] for i in group], batch_size=batch_size)
        for i, res in zip(group, report.texts, strict=True):
            results[i] = res
        if progress is not None:
            progress(len(group), sum(r["num_tokens"] for r in report.texts))
        start = end
    return results  # type: ignore[return-value]


def row_of(shard: Shard, rec: Record, res: dict[str, Any] | None) -> dict[str, Any]:
    """One output row: where the record came from, its error or its scores (every per-text field)."""
    row = {k: None for k in ROW_FIELDS}
    row.update(id=rec.id, source=shard.url, record=rec.index, error_kind=rec.error_kind, error=rec.error)
    if res is not None:
        row.update({k: res.get(k) for k in ROW_FIELDS[5:]})
    return row


def new_stats(shard: Shard) -> dict[str, Any]:
    stats: dict[str, Any] = {"shard": shard.name, "source": shard.url, "docs": 0, "scored": 0,
                             "errors": dict.fromkeys(ERROR_KINDS, 0)}
    stats.update(dict.fromkeys(SUMS, 0))
    stats["nll"] = 0.0
    return stats


def add_to_stats(stats: dict[str, Any], rec: Record, res: dict[str, Any] | None) -> None:
    stats["docs"] += 1
    if res is None:
        stats["errors"][rec.error_kind] += 1
        return
    stats["scored"] += 1
    stats["num_chars"] += len(rec.text or "")
    for k in SUMS:
        if k != "num_chars":
            stats[k] += res[k]


def score_shard(model: Any, shard: Shard, folder: Path, settings: dict[str, Any],
                progress: Progress | None = None) -> dict[str, Any]:
    """Score every record of ``shard`` and write its output file, then its statistics (its done marker), both
    atomically; returns the statistics. ``settings``: the job's (``text_field``, ``id_field``, ``text_unit``,
    ``keep_columns``, ``format``, ``batch_size``)."""
    started = time.time()
    stats = new_stats(shard)
    writer = ShardWriter(folder, shard.name, settings["format"])
    try:
        for chunk in read_records(shard, settings["text_field"], settings["id_field"], settings["text_unit"],
                                  settings["keep_columns"]):
            valid = [r for r in chunk if r.text is not None]
            scored = score_in_order(model, [r.text for r in valid], settings["batch_size"], progress) if valid else []
            by_index = dict(zip((id(r) for r in valid), scored, strict=True))
            rows = []
            for rec in chunk:
                res = by_index.get(id(rec))
                add_to_stats(stats, rec, res)
                row = row_of(shard, rec, res)
                rows.append(ShardWriter.row_with_columns(row, rec.columns) if settings["keep_columns"] else row)
                if res is None and progress is not None:
                    progress(1, 0)
            writer.write(rows)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    stats.update(worker=f"{socket.gethostname()}:{os.getpid()}", seconds=time.time() - started)
    import json

    atomic_write_text(stats_path(folder, shard.name), json.dumps(stats, indent=1) + "\n")
    return stats
