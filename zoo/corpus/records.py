"""A corpus's shards and their records: which files an INPUT names, and each record of a shard as a text to score or
a per-record error.

A *shard* is one input file (JSONL, Parquet or plain text, local or any fsspec URL the installed filesystems read):
the unit of work, of output (one output file per shard) and of resumption. A *record* is one document of a shard:
a JSONL line, a Parquet row, a plain-text file (``text_unit="file"``) or one of its lines (``"line"``). A record
that cannot be scored (not JSON, no text field, a text that is not a string, not UTF-8, empty, binary) is kept with
its error instead of its scores: it never stops the job, and it is counted in the summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from zoo.errors import InvalidRequest, UsageError
from zoo.validate import check_text

#: File name endings of each input format (optionally compressed: fsspec decompresses by the ending).
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet",
           ".txt": "text"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
#: Records read (and scored) at a time within a shard: what bounds the memory of a shard of any size, and the
#: window within which documents are sorted by length for batching.
CHUNK_DOCS = 2048
CHUNK_CHARS = 4 << 20
#: The per-record error kinds (the summary counts each).
ERROR_KINDS = ("invalid_json", "invalid_utf8", "missing_text", "not_a_string", "empty_text", "invalid_text")


@dataclass(frozen=True)
class Shard:
    """One input file. ``name`` is its output files' stem: the file's own stem plus a digest of its URL, so two
    inputs with the same file name (``a/part-0.jsonl``, ``b/part-0.jsonl``) never share an output file, and a rerun
    finds the same names whatever other inputs it is given."""

    url: str
    name: str
    kind: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class Record:
    """One document: its text, or the error that kept it from being scored."""

    index: int
    id: str
    text: str | None = None
    error_kind: str | None = None
    error: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)


def _split_ext(path: str) -> tuple[str, str]:
    """``(stem, format)`` of a file name, a compression ending looked through (``part.jsonl.gz``: jsonl)."""
    base = posixpath.basename(path.rstrip("/"))
    stem = base
    for comp in COMPRESSIONS:
        if stem.endswith(comp):
            stem = stem[: -len(comp)]
    root, ext = os.path.splitext(stem)
    return root, FORMATS.get(ext.lower(), "")


def _shard(url: str) -> Shard:
    stem, kind = _split_ext(url)
    if not kind:
        raise UsageError(f"{url}: not a corpus file (use {', '.join(sorted(FORMATS))}, optionally compressed)")
    digest = hashlib.sha1(url.encode("utf-8")).hexdigest()[:10]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:80] or "shard"
    return Shard(url, f"{safe}-{digest}", kind)


def find_shards(inputs: list[str]) -> list[Shard]:
    """The shards INPUTs name: files, folders (every corpus file under them) and globs, as local paths or fsspec
    URLs; each shard once, in the order given (a folder's and a glob's files sorted)."""
    import fsspec

    if not inputs:
        raise UsageError("give at least one INPUT (a file, a folder or a glob)")
    urls: list[str] = []
    for given in inputs:
        try:
            fs, path = fsspec.core.url_to_fs(given)
        except (ImportError, ValueError) as e:
            raise UsageError(f"{given}: cannot open ({e})") from None
        proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        local = proto in ("file", "local")
        if any(c in path for c in "*?["):
            found = sorted(p for p in fs.glob(path) if fs.isfile(p))
        elif fs.isdir(path):
            found = sorted(p for p in fs.find(path) if _split_ext(p)[1])
        elif fs.isfile(path):
            found = [path]
        else:
            raise UsageError(f"{given}: no such file or folder")
        if not found:
            raise UsageError(f"{given}: no corpus files there (.jsonl, .parquet, .txt, optionally compressed)")
        urls += [p if local else fs.unstrip_protocol(p) for p in found]
    shards = [_shard(u) for u in dict.fromkeys(urls)]
    return shards


def _record_of(obj: Any, index: int, default_id: str, text_field: str, id_field: str | None,
               keep: bool) -> Record:
    """A decoded JSON object or Parquet row as a record: its text checked as the service checks any text."""
    if not isinstance(obj, dict):
        return Record(index, default_id, error_kind="invalid_json", error="the line is JSON but not an object")
    rid = obj.get(id_field) if id_field else None
    rec = Record(index, default_id if rid is None else str(rid), columns=dict(obj) if keep else {})
    if text_field not in obj:
        rec.error_kind, rec.error = "missing_text", f"no field {text_field!r}"
        return rec
    return check_record_text(rec, obj[text_field], text_field)


def check_record_text(rec: Record, value: Any, name: str) -> Record:
    """``rec`` with ``value`` as its text if the service would score it, else with the error saying why."""
    if not isinstance(value, str):
        rec.error_kind, rec.error = "not_a_string", f"{name!r} is {type(value).__name__}, not a string"
        return rec
    try:
        rec.text = check_text(value, name)[0]
    except InvalidRequest as e:
        rec.error_kind = "empty_text" if not value.strip() else "invalid_text"
        rec.error = e.message
    return rec


def _decode(raw: bytes, rec: Record) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        rec.error_kind, rec.error = "invalid_utf8", f"not valid UTF-8 (byte {e.start})"
        return None


def _line_records(shard: Shard, text_field: str, id_field: str | None, keep: bool) -> Iterator[Record]:
    """JSONL lines, or plain-text lines (``kind == "text"``); a blank line holds no record (its number is kept)."""
    import fsspec

    with fsspec.open(shard.url, "rb", compression="infer") as f:
        for index, raw in enumerate(f):
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
            rec = Record(index, f"{shard.name}/{index}")
            line = _decode(raw, rec)
            if line is None:
                yield rec
            elif shard.kind == "text":
                yield check_record_text(rec, line, "line")
            else:
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as e:
                    rec.error_kind, rec.error = "invalid_json", f"not valid JSON ({str(e)[:120]})"
                    yield rec
                    continue
                yield _record_of(obj, index, rec.id, text_field, id_field, keep)


def _file_record(shard: Shard) -> Iterator[Record]:
    import fsspec

    with fsspec.open(shard.url, "rb", compression="infer") as f:
        raw = f.read()
    rec = Record(0, shard.name)
    text = _decode(raw, rec)
    yield rec if text is None else check_record_text(rec, text, "file")


def _parquet_records(shard: Shard, text_field: str, id_field: str | None, keep: bool) -> Iterator[Record]:
    import fsspec
    import pyarrow.parquet as pq

    with fsspec.open(shard.url, "rb") as f:
        pf = pq.ParquetFile(f)
        index = 0
        for batch in pf.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield _record_of(row, index, f"{shard.name}/{index}", text_field, id_field, keep)
                index += 1


def read_records(shard: Shard, text_field: str = "text", id_field: str | None = None, text_unit: str = "file",
                 keep_columns: bool = False) -> Iterator[list[Record]]:
    """A shard's records in order, in chunks of at most :data:`CHUNK_DOCS` records or about :data:`CHUNK_CHARS`
    characters (the memory one shard needs, whatever its size)."""
    if shard.kind == "parquet":
        records = _parquet_records(shard, text_field, id_field, keep_columns)
    elif shard.kind == "text" and text_unit == "file":
        records = _file_record(shard)
    else:
        records = _line_records(shard, text_field, id_field, keep_columns)
    chunk: list[Record] = []
    chars = 0
    for rec in records:
        chunk.append(rec)
        chars += len(rec.text or "")
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def count_records(shard: Shard, text_unit: str) -> int | None:
    """About how many records a local shard holds (its lines; a Parquet file's rows from its footer), for the
    progress bar's ETA; ``None`` where counting would mean a second download."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(shard.url)
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if proto not in ("file", "local"):
        return None
    if shard.kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if shard.kind == "text" and text_unit == "file":
        return 1
    with fsspec.open(shard.url, "rb", compression="infer") as f:
        return sum(1 for line in f if line.strip())
