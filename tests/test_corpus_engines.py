"""``zoo score-corpus`` at scale: the bundled models of every architecture, the process pool, a job killed and
rerun from the command line, a real two-node Ray cluster (``ray.cluster_utils.Cluster``: two raylets on loopback,
one CPU each) with an actor killed mid-shard, and the datatrove blocks in datatrove's own local and Ray executors
with its own readers and writers. Every engine's files are compared with the in-process run's."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import zoo
from tests.conftest import REPO
from tests.test_corpus import assert_close, assert_same_scores, corpus_lines, read_rows, write_jsonl
from zoo.corpus import score_corpus

pytestmark = pytest.mark.usefixtures("one_thread")  # (the workers' one thread: the same float sums)
MODEL = "lstm-ptb-5m-long-light"  # a bundled word model: seconds per shard below, so a kill lands mid-job


def shard_files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.glob("*.parquet"))}


def shard_tables(folder: Path) -> dict[str, list]:
    return {f.name: pq.read_table(f).to_pylist() for f in sorted(folder.glob("*.parquet"))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Four shards of 150 PTB-style lines, with a bad record in one."""
    root = tmp_path_factory.mktemp("corpus") / "in"
    root.mkdir()
    for k in range(4):
        objs = [{"text": t, "doc": f"s{k}-{i}"} for i, t in enumerate(corpus_lines(150, start=150 * k))]
        write_jsonl(root / f"part-{k}.jsonl", objs, extra=b"{broken\n" if k == 1 else b"")
    return root


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """The in-process run every other engine is compared with."""
    out = tmp_path_factory.mktemp("reference")
    score_corpus(MODEL, [str(corpus)], out, id_field="doc", workers=1, progress=False)
    return out


def test_every_bundled_model_scores_documents_as_zoo_score(tmp_path):
    """Every architecture (the bundled models: LSTM, aLSTM, HyperLSTM, p-norm GRU; word and character level):
    each document's scores equal ``zoo.load(name).score(text)`` to 1e-6 relative."""
    from zoo.catalog import bundled_dir, catalog

    texts = corpus_lines(6, start=7) + ["the n't 's market <unk> N " * 60]
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t, "doc": str(i)} for i, t in enumerate(texts)])
    names = [n for n in catalog()["models"] if (bundled_dir() / n / "config.json").is_file()]
    assert {zoo.load(n).config["architecture"] for n in names} >= {"lstm", "alstm", "hyperlstm", "pnorm_gru"}
    for name in names:
        model = zoo.load(name)
        score_corpus(name, [str(src)], tmp_path / name, id_field="doc", workers=1, progress=False)
        rows = read_rows(tmp_path / name)
        for i, text in enumerate(texts):
            assert_same_scores(rows[str(i)], model.score(text).texts[0], f"{name}, text {i}")


def test_the_process_pool_writes_the_in_process_files(corpus, reference, tmp_path):
    summary = score_corpus(MODEL, [str(corpus)], tmp_path, id_field="doc", workers=2, progress=False)
    assert shard_files(tmp_path) == shard_files(reference)
    assert summary["run"]["engine"] == "process pool" and len(summary["run"]["workers"]) == 2
    assert summary["errors"]["invalid_json"] == 1 and summary["scored"] == 600


def test_a_pool_worker_killed_mid_shard_is_replaced_and_its_shard_done_once(corpus, reference, tmp_path):
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_first_worker_mid_shard, args=(tmp_path, killed, stop))
    killer.start()
    try:
        summary = score_corpus(MODEL, [str(corpus)], tmp_path, id_field="doc", workers=2, progress=False)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was seen mid-shard"
    assert summary["run"]["shards_scored"] == 4 and summary["documents"] == 601
    assert shard_files(tmp_path) == shard_files(reference)


def test_a_killed_job_rerun_finishes_only_the_missing_shards(corpus, reference, tmp_path):
    """``zoo score-corpus`` killed (SIGKILL) after its first shard; the same command again scores only the rest,
    and the files equal an uninterrupted run's."""
    cmd = [sys.executable, "-m", "zoo.cli", "score-corpus", MODEL, str(corpus), "-o", str(tmp_path), "--id-field",
           "doc", "--workers", "1", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob("*.stats.json")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    done = len(list(tmp_path.glob("*.stats.json")))
    assert 1 <= done < 4, "the kill should land after the first shard and before the last"
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"{4 - done} shard(s) scored, {done} already done" in again.stdout
    assert shard_files(tmp_path) == shard_files(reference)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_the_command_refuses_bad_input_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    (tmp_path / "a.csv").write_text("x\n", encoding="utf-8")
    for args, message in (([str(tmp_path / "missing.jsonl")], "no such file or folder"),
                          ([str(tmp_path / "a.csv")], "not a corpus file"),
                          ([str(tmp_path), "--workers", "0"], "--workers must be a positive integer")):
        proc = subprocess.run([sys.executable, "-m", "zoo.cli", "score-corpus", MODEL, *args, "-o",
                               str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            proc.stderr


@pytest.fixture(scope="module")
def cluster():
    """A real multi-node Ray cluster on loopback: a head and one worker node (a raylet each), one CPU each, small
    object stores."""
    from ray.cluster_utils import Cluster

    small = {"num_cpus": 1, "object_store_memory": 80 << 20}
    c = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    c.add_node(**small)
    c.wait_for_nodes()
    yield c
    import ray

    ray.shutdown()
    c.shutdown()


def _kill_first_worker_mid_shard(folder: Path, killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the first process seen writing a shard (its temporary file names its pid)."""
    while not stop.is_set() and not killed:
        for tmp in folder.glob("*.parquet.tmp-*"):
            pid = int(tmp.name.split(".tmp-")[1].split("-")[0])
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.01)


def test_a_ray_cluster_writes_the_same_files_and_retries_a_killed_actor(cluster, corpus, reference, tmp_path):
    summary = score_corpus(MODEL, [str(corpus)], tmp_path / "ray", id_field="doc", ray_address=cluster.address,
                           progress=False)
    assert summary["run"]["engine"] == "ray" and summary["run"]["shards_scored"] == 4
    assert shard_files(tmp_path / "ray") == shard_files(reference)
    (tmp_path / "killed").mkdir()
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_first_worker_mid_shard, args=(tmp_path / "killed", killed, stop))
    killer.start()
    try:
        again = score_corpus(MODEL, [str(corpus)], tmp_path / "killed", id_field="doc", ray_address=cluster.address,
                             progress=False)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was seen mid-shard"
    assert again["run"]["shards_scored"] == 4 and again["documents"] == 601  # each shard once: no duplicates
    assert shard_tables(tmp_path / "killed") == shard_tables(reference)
    assert all(not w.endswith(f":{killed[0]}") for w in again["run"]["workers"])


def _datatrove_pipeline(src: Path, out: Path, filter_max: float | None) -> list:
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    from zoo.corpus.datatrove_blocks import ZooPerplexityFilter, ZooScorer

    steps = [JsonlReader(str(src), id_key="doc")]
    steps.append(ZooScorer(MODEL, docs_per_batch=64) if filter_max is None else
                 ZooPerplexityFilter(MODEL, max_ppl=filter_max, batch_size=64,
                                     exclusion_writer=JsonlWriter(str(out / "dropped"))))
    return [*steps, JsonlWriter(str(out / "kept"))]


def _datatrove_docs(folder: Path) -> dict[str, dict]:
    docs = {}
    for f in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            docs.update({d["id"]: d for d in map(json.loads, fh)})
    return docs


def _check_metadata(docs: dict[str, dict], rows: dict[str, dict]) -> None:
    for doc_id, doc in docs.items():
        for k in ("nll", "ppl", "bits_per_input_char", "num_tokens", "num_unk"):
            assert_close(doc["metadata"][f"zoo_{k}"], rows[doc_id][k])


def test_datatrove_blocks_in_the_local_and_ray_executors(cluster, corpus, reference, tmp_path):
    """The scorer and the filter give score-corpus's numbers (1e-6 relative) in LocalPipelineExecutor and
    RayPipelineExecutor, read and written by datatrove's own JSONL reader and writer."""
    import ray
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.executor.ray import RayPipelineExecutor

    rows = read_rows(reference)
    LocalPipelineExecutor(_datatrove_pipeline(corpus, tmp_path / "local", None), tasks=2, workers=2,
                          logging_dir=str(tmp_path / "logs-local")).run()
    scored = _datatrove_docs(tmp_path / "local" / "kept")
    assert len(scored) == 600  # (datatrove's reader skips the broken line)
    _check_metadata(scored, rows)
    ppls = sorted(r["ppl"] for r in rows.values() if r["ppl"] is not None)
    cut = (ppls[299] + ppls[300]) / 2  # the median, between two documents
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        RayPipelineExecutor(_datatrove_pipeline(corpus, tmp_path / "ray", cut), tasks=2, workers=2,
                            mem_per_cpu_gb=0.5, logging_dir=str(tmp_path / "logs-ray")).run()
    finally:
        ray.shutdown()
    kept, dropped = _datatrove_docs(tmp_path / "ray" / "kept"), _datatrove_docs(tmp_path / "ray" / "dropped")
    assert set(kept) == {i for i, r in rows.items() if r["ppl"] is not None and r["ppl"] <= cut}
    assert len(kept) == len(dropped) == 300
    _check_metadata({**kept, **dropped}, rows)
