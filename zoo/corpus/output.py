"""What a corpus job writes: one output file per shard (Parquet or JSONL), written atomically, each followed by its
statistics file (the shard's done marker); the job's settings (``job.json``, so that a rerun into the same folder is
the same job) and its summary (``summary.json``).

Atomic: a shard is written to a temporary file named with the writer's process id and moved into place
(``os.replace``) only when complete, then its statistics are written the same way. A worker killed mid-shard
leaves only a temporary file, which the next run (or the retry) never reads and the job removes; a shard is done
exactly when its statistics file exists, so nothing is counted twice.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from zoo.errors import UsageError

#: Per-document columns, in order: where the record came from, its error (if any), then exactly the per-text fields of
#: :class:`zoo.scoring.ScoreReport` (``oov_items``/``dropped_items``: null where the library leaves them out).
ROW_FIELDS = ("id", "source", "record", "error_kind", "error", "num_tokens", "nll", "avg_nll", "ppl",
              "bits_per_token", "bits_per_input_char", "bits_per_input_char_charged", "oov", "num_unk", "num_dropped",
              "num_visible_chars", "num_unseen_chars", "warnings", "oov_items", "dropped_items")
SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl"}
STATS_SUFFIX = ".stats.json"


def _schema():
    import pyarrow as pa

    strs, ints, floats = pa.string(), pa.int64(), pa.float64()
    types = {"id": strs, "source": strs, "record": ints, "error_kind": strs, "error": strs, "num_tokens": ints,
             "nll": floats, "avg_nll": floats, "ppl": floats, "bits_per_token": floats,
             "bits_per_input_char": floats, "bits_per_input_char_charged": floats, "oov": ints, "num_unk": ints,
             "num_dropped": ints, "num_visible_chars": ints, "num_unseen_chars": ints, "warnings": pa.list_(strs),
             "oov_items": pa.list_(strs), "dropped_items": pa.list_(strs)}
    return pa.schema([(k, types[k]) for k in ROW_FIELDS])


def atomic_write_text(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or not at all (a temporary file moved into place)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class ShardWriter:
    """One shard's output file, written chunk by chunk into a temporary file and moved into place by
    :meth:`commit`. Input columns kept (``keep_columns``) follow the score columns; one whose name is a score
    column's is renamed ``input_<name>``."""

    def __init__(self, folder: Path, name: str, fmt: str):
        self.path = folder / f"{name}{SUFFIX[fmt]}"
        self.tmp = folder / f"{name}{SUFFIX[fmt]}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.fmt = fmt
        self._writer: Any = None
        self._schema: Any = None
        # (opened now, so that a shard in progress shows as its temporary file, named with the worker's pid)
        self._file = open(self.tmp, "wb")  # noqa: SIM115 (closed by commit/abort)

    @staticmethod
    def row_with_columns(row: dict[str, Any], columns: dict[str, Any]) -> dict[str, Any]:
        out = dict(row)
        for k, v in columns.items():
            out[f"input_{k}" if k in row else k] = v
        return out

    def write(self, rows: list[dict[str, Any]]) -> None:
        if self.fmt == "jsonl":
            from zoo.api.http import to_json

            self._file.write(b"".join(to_json(r) + b"\n" for r in rows))
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._schema is None:
            base = _schema()
            extra = pa.Table.from_pylist([{k: v for k, v in r.items() if k not in ROW_FIELDS} for r in rows])
            self._schema = pa.schema(list(base) + [f for f in extra.schema if f.name not in ROW_FIELDS])
            self._writer = pq.ParquetWriter(self._file, self._schema)
        try:
            table = pa.Table.from_pylist(rows, schema=self._schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise UsageError(f"an input column changes type within a shard ({e}): keep the columns with "
                             "--format jsonl") from None
        self._writer.write_table(table)

    def commit(self) -> Path:
        if self._writer is not None:
            self._writer.close()
        elif self.fmt == "parquet":  # a shard with no records: an empty file with the schema
            import pyarrow.parquet as pq

            pq.write_table(_schema().empty_table(), self._file)
        self._file.close()
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._file.close()
        self.tmp.unlink(missing_ok=True)


def stats_path(folder: Path, name: str) -> Path:
    return folder / f"{name}{STATS_SUFFIX}"


def finished_stats(folder: Path, name: str, fmt: str) -> dict[str, Any] | None:
    """A finished shard's statistics (``None`` when the shard is still to do)."""
    sp = stats_path(folder, name)
    if not sp.is_file() or not (folder / f"{name}{SUFFIX[fmt]}").is_file():
        return None
    return json.loads(sp.read_text(encoding="utf-8"))


def remove_leftovers(folder: Path) -> int:
    """Temporary files of an interrupted run (none of them is ever read); how many were removed."""
    n = 0
    for p in folder.glob("*.tmp-*"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def check_job(folder: Path, settings: dict[str, Any]) -> None:
    """Write ``job.json``, or check that the folder's job is this one: a rerun resumes only the same job (its
    shards would otherwise mix two models' or two settings' numbers)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.json"
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise UsageError(f"{folder} holds a job with other settings ({', '.join(diff)}): give another --output, "
                             "or remove that folder to start over")
        return
    atomic_write_text(path, json.dumps(settings, indent=2) + "\n")
