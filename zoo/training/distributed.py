"""The processes of one run: which device each uses, the process group, and the decisions they must share.

Under ``torchrun`` every process is one rank. Decisions, in one place:

* device: a CUDA run uses ``cuda:LOCAL_RANK`` (``set_device`` before the process group, ``device_ids`` for DDP);
* seeds: the model is built from the recipe seed on every rank (and DDP broadcasts rank 0's weights anyway);
  the random streams every rank must agree on (variable BPTT lengths, sentence order) are numpy generators
  seeded by the recipe seed alone; dropout must differ between ranks (a single process draws independent masks
  for every row of the batch, and each rank holds different rows), so rank r > 0 reseeds torch from
  (seed, rank) after building the model, and from (seed, rank, step) after a resume (a checkpoint carries
  rank 0's generator state). Rank 0 keeps the single-process stream, so one process trains as before;
* agreement: a checkpoint, a stop (a signal reaches the ranks at different steps), the time budget and a divergence
  are decided by all ranks together (one small all-reduce), since saving gathers every rank's carried state and a
  rank that saved or stopped alone would wait forever on the others;
* teardown: the trainer destroys the process group it created when its run ends, also on error;
* at the end of training the ranks compare a checksum of their weights and the run fails if they differ.

A single process takes every decision alone, with no collective.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from zoo.device import resolve_device


def parse_device(name: str | None) -> torch.device:
    """``--device``: cpu or cuda[:N] (default: cuda when there is one), refused in one line by
    :func:`zoo.device.resolve_device` when it is not a device or not one this machine has. An index is kept only
    when given (:func:`local_device` picks ``cuda:LOCAL_RANK`` under torchrun)."""
    device = resolve_device("auto" if name is None else name, "--device")
    return device if device.type == "cpu" or ":" in (name or "") else torch.device("cuda")


def local_device(device: torch.device) -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` under torchrun when no index was given."""
    if device.type == "cuda":
        if device.index is None and "LOCAL_RANK" in os.environ:
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        if device.index is None:   # torch 2.11 refuses set_device("cuda") without an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The torch seed of rank ``rank`` > 0 (see the decisions above): distinct per rank, per resume point."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


class Ranks:
    """This process's place in the run (``rank`` of ``world`` on ``device``) and the collectives the trainer
    needs; joins the process group torchrun describes, and remembers whether it created it (to tear it down)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.owns_group = False
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            self.owns_group = True
        initialized = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` under DistributedDataParallel when there are several ranks."""
        if self.world < 2:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)

    def agree(self, due: bool, stop_signal: int) -> tuple[bool, int]:
        """Every rank's decision to checkpoint now (``due``: the wall-clock trigger fires on each rank's own clock)
        and to stop (the signal number, 0: none): the maximum over ranks."""
        if self.world < 2:
            return due, stop_signal
        flags = torch.tensor([int(due), int(stop_signal)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), int(flags[1])

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (a rank sees only its own columns' loss)."""
        if self.world < 2:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t[0])

    def gather_carry(self, state: tuple[torch.Tensor, ...] | None) -> list[tuple[torch.Tensor, ...]] | None:
        """Every rank's carried state, by rank (rank r trains on its own columns of the batch, so its state is its
        own): collective, so every rank calls it at the same point. None when no state is carried."""
        if state is None:
            return None
        mine = tuple(s.detach().contiguous() for s in state)
        if self.world < 2:
            return [mine]
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for s in mine:
            bufs = [torch.empty_like(s) for _ in range(self.world)]
            dist.all_gather(bufs, s)
            for r, b in enumerate(bufs):
                per_rank[r].append(b)
        return [tuple(x) for x in per_rank]

    def check_in_sync(self, model: torch.nn.Module) -> bool:
        """DDP keeps the replicas equal; a checksum per rank proves it before rank 0 evaluates and writes. True
        when proven (several ranks), False with one process (nothing to prove); raises when they differ."""
        if self.world < 2:
            return False
        mine = torch.tensor([sum(float(p.detach().double().sum()) for p in model.parameters())],
                            dtype=torch.float64, device=self.device)
        sums = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(sums, mine)
        values = [float(t) for t in sums]
        if max(values) - min(values) > 1e-6 * max(1.0, abs(values[0])):
            raise RuntimeError(f"DDP replicas diverged: weight checksums per rank {values}")
        return True

    def barrier(self) -> None:
        """No rank goes on before all are here (a rank's exit makes torchrun SIGTERM the others)."""
        if self.world > 1:
            dist.barrier()

    def teardown(self) -> None:
        """Destroy the process group if this object created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def device_name(device: torch.device) -> str:
    """The machine a run (or an epoch of it: a run trained in pieces may change machines) trained on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
