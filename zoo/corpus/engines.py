"""Where a corpus job's shards run: this process, a pool of processes on this machine, or a Ray cluster through Ray
Data. Each runs :func:`zoo.corpus.shard.score_shard` on a model it loaded once, so all give the same files.

Why the default is a plain process pool, not a local Ray: a pool of spawned processes starts in about the time one
``import torch`` takes, needs nothing beyond the library, and runs exactly the code Ray's actors run (the shard
function); a local Ray would add several seconds of start-up, a dashboard, an object store and a large dependency
to every run for no gain on one machine. ``ray_address`` (an existing cluster, or ``"auto"``) is where Ray pays:
many machines, GPU actors, node failures.
"""

from __future__ import annotations

import json
import os
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from zoo.corpus.records import Shard
from zoo.corpus.shard import score_shard
from zoo.errors import UsageError

#: How often a local pool whose worker died is started again for the shards still to do.
POOL_RESTARTS = 2

Progress = Callable[[int, int], None]


def load_model(spec: dict[str, Any], threads: int | None = None) -> Any:
    """The job's model, as ``zoo.load`` gives it (``spec``: model, backend, precision, revision, device); ``threads``:
    torch's intra-op threads in this process (one worker per core: 1)."""
    import torch

    from zoo.zoo_model import load

    if threads:
        torch.set_num_threads(threads)
    kwargs = {"revision": spec["revision"]} if spec.get("revision") else {}
    return load(spec["model"], backend=spec["backend"], precision=spec["precision"], device=spec["device"],
                **kwargs)


def run_here(model: Any, shards: list[Shard], folder: Path, settings: dict[str, Any], progress: Progress,
             threads: int) -> Iterator[dict[str, Any]]:
    """One worker: this process, the model already loaded, with ``threads`` torch threads while it runs (the
    caller's setting is restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shard in shards:
            yield score_shard(model, shard, folder, settings, progress)
    finally:
        torch.set_num_threads(before)


# -- a pool of processes on this machine ---------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(spec: dict[str, Any], threads: int, updates: Any) -> None:
    _WORKER["model"] = load_model(spec, threads)
    _WORKER["updates"] = updates


def _pool_shard(shard: dict[str, str], folder: str, settings: dict[str, Any]) -> dict[str, Any]:
    updates = _WORKER["updates"]
    return score_shard(_WORKER["model"], Shard(**shard), Path(folder), settings,
                       lambda docs, tokens: updates.put((docs, tokens)))


def run_pool(spec: dict[str, Any], shards: list[Shard], folder: Path, settings: dict[str, Any], workers: int,
             threads: int, progress: Progress) -> Iterator[dict[str, Any]]:
    """``workers`` spawned processes, each loading the model once and scoring whole shards. A worker that dies
    (killed, out of memory) breaks the pool: it is started again for the shards not yet done (a shard is written
    atomically, so a half-done one is simply done again), at most :data:`POOL_RESTARTS` times."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    todo = list(shards)
    for attempt in range(POOL_RESTARTS + 1):
        updates = ctx.Queue()
        pool = ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx, initializer=_init_worker,
                                   initargs=(spec, threads, updates))
        futures = {pool.submit(_pool_shard, s.to_dict(), str(folder), settings): s for s in todo}
        broken = False
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(updates, progress)
                for fut in done:
                    try:
                        stats = fut.result()
                    except BrokenProcessPool:
                        broken = True
                        continue
                    todo.remove(futures[fut])
                    yield stats
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            _drain(updates, progress)
        if not broken:
            return
        if attempt == POOL_RESTARTS:
            raise RuntimeError(f"a worker process died {POOL_RESTARTS + 1} times; {len(todo)} shards are not done "
                               "(rerun the same command to finish them)")


def _drain(updates: Any, progress: Progress) -> None:
    while True:
        try:
            docs, tokens = updates.get_nowait()
        except (queue.Empty, OSError, ValueError):
            return
        progress(docs, tokens)


# -- a Ray cluster, through Ray Data -------------------------------------------------------------------------
class ShardScorer:
    """Ray Data's callable class: one actor per worker, the model loaded once in ``__init__``; each call scores
    one shard (a batch of one shard descriptor) and returns its statistics."""

    def __init__(self, spec: dict[str, Any], folder: str, settings: dict[str, Any], threads: int):
        self.model = load_model(spec, threads)
        self.folder = Path(folder)
        self.settings = settings

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        out = [json.dumps(score_shard(self.model, Shard(**json.loads(s)), self.folder, self.settings))
               for s in batch["shard"]]
        return {"stats": np.array(out, dtype=object)}


def run_ray(address: str, spec: dict[str, Any], shards: list[Shard], folder: Path, settings: dict[str, Any],
            workers: int | None, cpus: float, gpus: float, progress: Progress) -> Iterator[dict[str, Any]]:
    """The shards as a Ray dataset of descriptors (one block each), ``map_batches`` over an actor pool of
    ``workers`` :class:`ShardScorer` actors (``cpus`` CPUs and ``gpus`` GPUs each); an actor that dies is restarted
    and its shard done again (Ray Data's default for actors: ``max_restarts=-1``, ``max_task_retries=-1``; atomic
    writes: no duplicates). The output folder must be one every node sees (a
    shared filesystem) and the library installed on every node."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise UsageError("--ray-address needs Ray: pip install 'alstm-zoo[corpus]'") from None
    owned = not ray.is_initialized()
    if owned:
        try:
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        except ConnectionError as e:
            raise UsageError(f"cannot reach the Ray cluster at {address!r}: {e}") from None
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        if workers is None:
            workers = max(1, int(ray.cluster_resources().get("GPU" if gpus else "CPU", 1) // (gpus or cpus)))
        ds = ray.data.from_items([{"shard": json.dumps(s.to_dict())} for s in shards],
                                 override_num_blocks=len(shards))
        ds = ds.map_batches(ShardScorer, batch_size=1, batch_format="numpy",
                            compute=ray.data.ActorPoolStrategy(size=min(workers, len(shards))),
                            fn_constructor_kwargs={"spec": spec, "folder": str(folder.resolve()),
                                                   "settings": settings, "threads": max(1, int(cpus))},
                            num_cpus=cpus, num_gpus=gpus or None)  # (Ray Data's actors: restarted, tasks retried)
        for row in ds.iter_rows():
            stats = json.loads(row["stats"])
            progress(stats["docs"], stats["num_tokens"])
            yield stats
    finally:
        if owned:
            ray.shutdown()


def default_workers(n_shards: int) -> int:
    """One worker per core this process may use, never more than there are shards."""
    return max(1, min(len(os.sched_getaffinity(0)), n_shards))
