"""A corpus job from end to end: the shards, the settings a rerun must share, which shards are still to do, the
engine that runs them, the progress bar, the summary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from zoo.corpus import engines
from zoo.corpus.output import SUFFIX, atomic_write_text, check_job, finished_stats, remove_leftovers
from zoo.corpus.records import count_records, find_shards
from zoo.corpus.summary import ProgressBar, summarize_job
from zoo.errors import UsageError

TEXT_UNITS = ("file", "line")


def _check_options(fmt: str, text_unit: str, workers: int | None, batch_size: int, cpus_per_worker: float,
                   gpus_per_worker: float | None) -> None:
    if fmt not in SUFFIX:
        raise UsageError(f"format must be one of {', '.join(SUFFIX)}, got {fmt!r}")
    if text_unit not in TEXT_UNITS:
        raise UsageError(f"text_unit must be one of {', '.join(TEXT_UNITS)}, got {text_unit!r}")
    for name, value in (("workers", workers), ("batch_size", batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    if cpus_per_worker <= 0 or (gpus_per_worker is not None and gpus_per_worker < 0):
        raise UsageError("cpus_per_worker must be positive and gpus_per_worker not negative")


def score_corpus(model: str | os.PathLike, inputs: str | list[str], output: str | os.PathLike, *,
                 text_field: str = "text", id_field: str | None = None, text_unit: str = "file",
                 keep_columns: bool = False, format: str = "parquet", workers: int | None = None,
                 ray_address: str | None = None, cpus_per_worker: float = 1.0, gpus_per_worker: float | None = None,
                 batch_size: int = 16, backend: str = "eager", precision: str = "fp32", device: str = "cpu",
                 revision: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Score every document of a corpus with ``model`` (what :func:`zoo.load` takes) and write, into the folder
    ``output``, one file per input shard with each document's scores (exactly the per-text fields of
    ``zoo.load(model).score(text)``), or its error, and ``summary.json`` (see the guide "Score a corpus").

    ``inputs``: JSONL, Parquet or plain-text files (``text_unit``: a file is one document, or each line is),
    folders and globs, local or fsspec URLs. ``workers``: processes on this machine (default: one per core), or
    with ``ray_address`` (``"auto"`` or ``HOST:PORT`` of an existing cluster) Ray actors with
    ``cpus_per_worker``/``gpus_per_worker`` each (GPUs default to 1 with a CUDA ``device``). Rerun with the same
    arguments after an interruption: finished shards are kept, the others done. Returns the summary.
    """
    _check_options(format, text_unit, workers, batch_size, cpus_per_worker, gpus_per_worker)
    try:  # (the corpus extra's readers and writers: refused in one line where a plain install lacks them)
        import fsspec  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError as e:
        raise UsageError(f"scoring a corpus needs {e.name}: pip install 'alstm-zoo[corpus]'") from None
    inputs = [inputs] if isinstance(inputs, str | os.PathLike) else list(inputs)
    shards = find_shards([str(i) for i in inputs])
    names = [s.name for s in shards]
    if len(set(names)) != len(names):
        raise UsageError("two inputs map to the same output name")
    spec = {"model": str(model), "backend": backend, "precision": precision, "revision": revision,
            "device": device}
    here = engines.load_model({**spec, "device": "cpu"})  # the driver's copy: its fingerprint and tokenizer
    from zoo.zoo_model import _weights_fingerprint

    settings = {"text_field": text_field, "id_field": id_field, "text_unit": text_unit,
                "keep_columns": keep_columns, "format": format, "batch_size": batch_size}
    folder = Path(output)
    check_job(folder, {"model": here.name, "weights": _weights_fingerprint(here.lm), "backend": backend,
                       "precision": precision, **settings})
    remove_leftovers(folder)
    done = {s.name: st for s in shards if (st := finished_stats(folder, s.name, format)) is not None}
    todo = [s for s in shards if s.name not in done]
    total = None
    if progress:
        counts = [count_records(s, text_unit) for s in todo]
        total = None if None in counts else sum(counts)  # type: ignore[arg-type]
    bar = ProgressBar(total, progress and bool(todo))
    started = time.perf_counter()
    run_stats: list[dict[str, Any]] = []
    engine = _engine(todo, workers, ray_address, cpus_per_worker, gpus_per_worker, device)
    try:
        for stats in _run(engine, here, spec, todo, folder, settings, bar.update):
            run_stats.append(stats)
    finally:
        bar.close()
        remove_leftovers(folder)
    wall = time.perf_counter() - started
    all_stats = list(done.values()) + run_stats
    summary = summarize_job(all_stats, run_stats, here.tokenizer, wall, engine)
    summary = {"model": here.name, "inputs": [str(i) for i in inputs], "output": str(folder), **settings, **summary}
    atomic_write_text(folder / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _engine(todo: list[Any], workers: int | None, ray_address: str | None, cpus: float, gpus: float | None,
            device: str) -> dict[str, Any]:
    """Which engine runs the shards, and with how many workers (recorded in the summary)."""
    gpus = (1.0 if device.startswith("cuda") else 0.0) if gpus is None else gpus
    if ray_address:
        return {"engine": "ray", "ray_address": ray_address, "workers_requested": workers, "cpus_per_worker": cpus,
                "gpus_per_worker": gpus}
    n = workers if workers is not None else engines.default_workers(len(todo))
    # one thread per worker: workers, not threads, use the cores (a small recurrent model's batch does not keep
    # two threads busy; processes scale, benchmarks/results/corpus.json)
    return {"engine": "local" if n == 1 else "process pool", "workers_requested": n, "threads_per_worker": 1}


def _run(engine: dict[str, Any], here: Any, spec: dict[str, Any], todo: list[Any], folder: Path,
         settings: dict[str, Any], progress: Any):
    if not todo:
        return iter(())
    if engine["engine"] == "ray":
        return engines.run_ray(engine["ray_address"], spec, todo, folder, settings, engine["workers_requested"],
                               engine["cpus_per_worker"], engine["gpus_per_worker"], progress)
    if engine["engine"] == "local":
        model = here if spec["device"] == "cpu" else here.to(spec["device"])
        return engines.run_here(model, todo, folder, settings, progress, engine["threads_per_worker"])
    return engines.run_pool(spec, todo, folder, settings, engine["workers_requested"],
                            engine["threads_per_worker"], progress)
