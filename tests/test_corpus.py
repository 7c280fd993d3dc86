"""``zoo.corpus`` in this process: every input format and record error, per-document numbers equal to
``zoo.load(model).score(text)``, the corpus aggregate equal to ``report.corpus``, long texts, resumption, and the
options a rerun must share (the process pool, Ray, datatrove and the bundled models: tests/test_corpus_engines.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import zoo
from tests.conftest import CORPUS
from zoo.corpus import score_corpus
from zoo.corpus.output import ROW_FIELDS
from zoo.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")
REL = 1e-6  # batched scores equal one-at-a-time scores to float tolerance (zoo/scoring.py): the NLL and what is linear
# in it to 1e-6 relative, the perplexity in its logarithm (a 2e-7 NLL difference is 1.1e-6 of a perplexity of 155)
SCORE_FIELDS = ROW_FIELDS[5:]


def corpus_lines(n: int, start: int = 0) -> list[str]:
    lines = [line.strip() for line in (CORPUS / "train.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    return [lines[(start + i) % len(lines)] for i in range(n)]


def write_jsonl(path: Path, objs: list, extra: bytes = b"") -> Path:
    path.write_bytes(b"".join(json.dumps(o).encode() + b"\n" for o in objs) + extra)
    return path


def read_rows(folder: Path) -> dict[str, dict]:
    """Every output row of a job folder (Parquet or JSONL), by id."""
    rows = {}
    for f in sorted(folder.iterdir()):
        if f.suffix == ".parquet":
            batch = pq.read_table(f).to_pylist()
        elif f.suffix == ".jsonl":
            batch = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()]
        else:
            continue
        rows.update({r["id"]: r for r in batch})
    return rows


def assert_close(a: float | None, b: float | None, what: str = "") -> None:
    if a is None or b is None or not math.isfinite(b):
        assert a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b)), what
    else:
        assert abs(a - b) <= REL * abs(b), (what, a, b)


def assert_same_scores(row: dict, res: dict, what: str = "") -> None:
    """A row of the output against ``model.score(text).texts[0]``: every per-text field."""
    for k in SCORE_FIELDS:
        if k == "ppl":  # exp(avg_nll): relative differences grow by avg_nll, so its exponent is compared
            assert_close(math.log(row[k]), math.log(res[k]), f"{what} log ppl")
        elif k in ("nll", "avg_nll", "bits_per_token", "bits_per_input_char", "bits_per_input_char_charged"):
            assert_close(row[k], res[k], f"{what} {k}")
        else:
            assert row[k] == res.get(k), f"{what} {k}"


@pytest.fixture
def model(tiny_checkpoint):
    return zoo.load(tiny_checkpoint)


def test_every_record_kind_per_document_scores_and_the_corpus_aggregate(tmp_path, tiny_checkpoint, model):
    texts = corpus_lines(40) + ["the cat sat on the mat " * 300]  # one long text: scored in carried pieces
    good = [{"text": t, "doc": f"d{i}", "n": i} for i, t in enumerate(texts)]
    bad = [{"body": "no text field"}, {"text": 7}, {"text": "   "}, {"text": "nul\x00byte"}, ["not", "an object"]]
    (tmp_path / "in").mkdir()
    src = write_jsonl(tmp_path / "in" / "part.jsonl", good + bad, extra=b"{not json\n\n" + b'{"text": "caf\xe9"}\n')
    summary = score_corpus(tiny_checkpoint, [str(src)], tmp_path / "out", id_field="doc", workers=1, progress=False)
    rows = read_rows(tmp_path / "out")
    assert len(rows) == len(good) + len(bad) + 2  # (the blank line holds no record)
    for obj in good:  # each document exactly as the library scores it alone
        assert_same_scores(rows[obj["doc"]], model.score(obj["text"]).texts[0])
        assert rows[obj["doc"]]["error"] is None
    assert summary["errors"] == {"invalid_json": 2, "invalid_utf8": 1, "missing_text": 1, "not_a_string": 1,
                                 "empty_text": 1, "invalid_text": 1}
    assert (summary["documents"], summary["scored"], summary["num_errors"]) == (len(rows), len(good), 7)
    errors = {r["error_kind"] for r in rows.values() if r["error"]}
    assert errors == set(summary["errors"]) and all(r["nll"] is None for r in rows.values() if r["error"])
    expected = model.score(texts).corpus  # token-weighted, as the library aggregates
    for k, v in expected.items():
        if isinstance(v, float):
            assert_close(summary["corpus"][k], v)
        else:
            assert summary["corpus"][k] == v, k
    assert summary["corpus"]["num_texts"] == len(good)
    assert summary["run"]["workers"] and summary["machine"]["cores"] >= 1


def test_parquet_text_files_lines_globs_jsonl_output_and_kept_columns(tmp_path, tiny_checkpoint, model):
    texts = corpus_lines(12, start=100)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"body": texts[:6], "key": list(range(6))}), tmp_path / "in" / "p.parquet")
    (tmp_path / "in" / "doc.txt").write_text(texts[6] + "\n" + texts[7] + "\n", encoding="utf-8")
    (tmp_path / "in" / "notes.md").write_text("not a corpus file", encoding="utf-8")  # a folder's other files
    summary = score_corpus(tiny_checkpoint, [f"file://{tmp_path}/in/*.parquet"], tmp_path / "p",  # (an fsspec URL)
                           text_field="body", id_field="key", keep_columns=True, format="jsonl", workers=1,
                           progress=False)
    rows = read_rows(tmp_path / "p")
    assert summary["scored"] == 6 and sorted(rows) == [str(i) for i in range(6)]
    for i in range(6):
        assert rows[str(i)]["body"] == texts[i] and rows[str(i)]["key"] == i  # the input's columns kept
        assert_same_scores(rows[str(i)], model.score(texts[i]).texts[0])
    whole = score_corpus(tiny_checkpoint, [str(tmp_path / "in" / "doc.txt")], tmp_path / "t1", workers=1,
                         progress=False)
    lines = score_corpus(tiny_checkpoint, [str(tmp_path / "in")], tmp_path / "t2", text_unit="line", workers=1,
                         progress=False)
    assert whole["scored"] == 1 and lines["scored"] == 2  # the folder: the text's lines, and the Parquet file's rows
    assert lines["errors"]["missing_text"] == 6 and lines["shards"] == 2  # (that have no "text" column)
    (row,) = read_rows(tmp_path / "t1").values()
    assert_same_scores(row, model.score(texts[6] + "\n" + texts[7] + "\n").texts[0])


def test_a_rerun_finishes_only_what_is_missing_and_equals_one_run(tmp_path, tiny_checkpoint):
    (tmp_path / "in").mkdir()
    for k in range(3):
        write_jsonl(tmp_path / "in" / f"s{k}.jsonl", [{"text": t} for t in corpus_lines(15, start=20 * k)])
    first = score_corpus(tiny_checkpoint, [str(tmp_path / "in")], tmp_path / "out", workers=1, progress=False)
    assert first["run"]["shards_scored"] == 3
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").glob("*.parquet")}
    # an interrupted run: one shard's done marker never written, another half-written (a temporary file)
    stats = sorted((tmp_path / "out").glob("*.stats.json"))
    stats[1].unlink()
    (tmp_path / "out" / "s0-half.parquet.tmp-123-abc").write_bytes(b"PAR1 half")
    again = score_corpus(tiny_checkpoint, [str(tmp_path / "in")], tmp_path / "out", workers=1, progress=False)
    assert (again["run"]["shards_scored"], again["run"]["shards_skipped"]) == (1, 2)
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").glob("*.parquet")} == before
    assert not list((tmp_path / "out").glob("*.tmp-*"))
    assert again["corpus"] == first["corpus"] and again["documents"] == first["documents"] == 45
    with pytest.raises(UsageError, match="other settings .*text_field"):
        score_corpus(tiny_checkpoint, [str(tmp_path / "in")], tmp_path / "out", text_field="body", progress=False)


def test_bad_arguments_are_usage_errors(tmp_path, tiny_checkpoint):
    (tmp_path / "x.csv").write_text("a,b\n", encoding="utf-8")
    for inputs, kw, match in (([str(tmp_path / "missing.jsonl")], {}, "no such file"),
                              ([str(tmp_path / "x.csv")], {}, "not a corpus file"),
                              ([str(tmp_path / "*.jsonl")], {}, "no corpus files"),
                              ([str(tmp_path / "x.csv")], {"format": "csv"}, "format must be"),
                              ([str(tmp_path / "x.csv")], {"workers": 0}, "workers must be")):
        with pytest.raises(UsageError, match=match):
            score_corpus(tiny_checkpoint, inputs, tmp_path / "out", progress=False, **kw)
    assert not (tmp_path / "out").exists() or not any(p.suffix == ".parquet" for p in (tmp_path / "out").iterdir())

