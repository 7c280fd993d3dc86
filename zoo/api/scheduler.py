"""Fair sharing of one model between clients: work in bounded steps, fresh requests together, turns fair between
clients, long work and generations capped.

Why: a server that runs each request (or each batch of requests) to the end lets one client take the model from
everyone else. One score request of 64 long texts held the only worker for ~10 s, and the library's batching
(:func:`zoo.scoring.score_texts` sorts texts by length and pads each group to its longest) made short texts of
other requests run for all of a long text's steps. Here:

* **Bounded steps.** A score request runs as :meth:`zoo.api.service.Service.score_steps` (its texts batched with each
  other only, never padded to another request's), one step = at most ``step_tokens`` tokens (rows x columns:
  its cost, mostly the decoder's, grows with the tokens), the recurrent state carried across steps
  exactly as the library always scores a long text in chunks: the numbers are the Python API's. A generation is
  one token per step, after its prompt is read ``step_tokens`` tokens at a time.
* **Fresh requests first, together.** The requests new in a call run first; those that fit one step and that
  their dialect can run with others (:attr:`zoo.api.dialects.Work.together`) share one model call per dialect
  (:meth:`zoo.api.dialects.Dialect.run_together`): 8 one-sentence requests are one model call, not 8, and each is
  answered in the call that starts it, however many long jobs are in progress. Computed alone (issue 52's
  measurement), each cost ~2.2 ms more and the served throughput was 0.62 of the in-process ceiling.
* **Turns fair between clients.** Then :meth:`Scheduler.run` gives turns, one step each, round-robin between
  *clients* (the front door names each request's client: its connection's peer address), and within a client
  between its jobs: a client sending 8 long requests at once gets, over time, the steps of one sending 1, and a
  request's latency grows with its own size and the number of clients in progress, not with their sizes.
* **Generations are capped** (``max_generations``): a generation holds its place for hundreds of steps, so with no
  cap a few clients generating fill every place the server has (TorchServe's batch: a request stays in it until
  answered) and a score request waits for a generation to end. Over the cap a generation is refused at once with
  :class:`~zoo.errors.ServerBusy` (HTTP 503 + ``Retry-After``), which keeps the rest of the places for scoring.
  Why refuse rather than queue: a queued generation still holds one of those places while it waits (the frontend
  hands a request to the worker only into a free place), so a queue inside the worker would not keep any place
  free; refusing costs the client one retry and never costs another client anything.
* **Long work holds at most** ``max_long`` **places** (requests of more than one step, generations included; the
  handler keeps a quarter of TorchServe's batch places for requests that fit one step), **and one client at most**
  ``client_long`` **of them** (half, at least one). Over either a long request is refused at once (503 +
  ``Retry-After``): no set of clients sending valid long requests can hold every place in which a short request
  could start (8 clients looping the largest request held all 8 places and moved honest clients' p50 37x), and no
  one client can hold every place in which another client's long request could start. A request that fits one
  step needs no share: it leaves in the call that starts it.

Nothing here knows the wire format: a request comes with its dialect (:class:`zoo.api.dialects.Dialect`), and
:meth:`Scheduler.admit` asks the dialect whether the request generates and for its work
(:class:`zoo.api.dialects.Work`: its steps, and whether it needs more than one); it tests no types. The
front end formats each :class:`Job`'s progress (what its steps yielded, its result or error) through the same
dialect. Framework-free: no TorchServe imports.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zoo.api.http import error_status
from zoo.errors import ServerBusy, ZooError

if TYPE_CHECKING:
    from zoo.api.dialects import Dialect
    from zoo.api.service import Service

log = logging.getLogger(__name__)

#: Tokens per step (rows x columns): a one-sentence request is one step, and a step of a long request costs what
#: ``benchmarks/results/request_cost.json`` says (``step_seconds``) on the default model.
STEP_TOKENS = 64


@dataclass
class Job:
    """One request's work in progress: its steps (from its dialect), what they yielded, and the outcome."""

    request: Any  # the dialect's own request object (it has ``task``, for logs)
    steps: Iterator[Any]
    dialect: Dialect
    #: whether it holds a generation place (the dialect's answer at admission)
    generates: bool = False
    pieces: list[Any] = field(default_factory=list)  # what its steps yielded so far (a generation's pieces)
    fresh: list[Any] = field(default_factory=list)  # ... those not yet taken by the front end (take_pieces)
    result: Any = None  # what its steps returned (the reply), once done without error
    error: Exception | None = None  # a ZooError (the client's own: its status) or a bug (500)
    done: bool = False
    steps_run: int = 0
    #: whether it needs more than one step (it holds one of the places for long work: :meth:`Scheduler.admit`)
    long: bool = False
    #: who sent it (:meth:`Scheduler.admit`): turns are fair between clients
    client: Hashable = None
    #: what its dialect needs to run its one step with other requests' (:attr:`zoo.api.dialects.Work.together`)
    together: Any = None

    @property
    def status(self) -> int:
        """The HTTP status of the outcome so far: 200, the error's own status, or 500 for a bug."""
        return 200 if self.error is None else error_status(self.error)

    def advance(self) -> None:
        """One step (a failure ends this job alone and is kept, never raised)."""
        self.steps_run += 1
        try:
            out = next(self.steps)
        except StopIteration as finished:
            self.done, self.result = True, finished.value
            return
        except ZooError as e:  # the caller's own problem
            self.done, self.error = True, e
            return
        except Exception as e:  # a bug, not bad input: this job alone fails
            log.exception("%s failed", self.request.task)
            self.done, self.error = True, e
            return
        if out is not None:
            self.pieces.append(out)
            self.fresh.append(out)

    def settle(self, outcome: Any) -> None:
        """Its one step, run with others' (:meth:`Scheduler.run`): the result, or the exception it alone raised."""
        self.steps_run += 1
        self.done = True
        if isinstance(outcome, Exception):
            self.error = outcome
        else:
            self.result = outcome

    def take_pieces(self) -> list[str]:
        """The generated pieces since the last call (what a stream sends next)."""
        out, self.fresh = self.fresh, []
        return out


class Scheduler:
    """The jobs in progress on one model, by the front end's keys, run in bounded steps with turns fair between
    clients (and between each client's requests)."""

    def __init__(self, service: Service, step_tokens: int = STEP_TOKENS, max_generations: int = 4,
                 max_long: int | None = None, client_long: int | None = None):
        self.service = service
        self.step_tokens = max(1, int(step_tokens))
        self.max_generations = max(1, int(max_generations))
        #: jobs of more than one step (generations included) in progress at most: the front end's other places
        #: are kept for requests that fit one step, which finish in the call that starts them, so no set of
        #: clients sending long requests holds every place where a short one could start (None: no bound)
        self.max_long = None if max_long is None else max(1, int(max_long))
        #: long jobs of one client in progress at most (None: half of ``max_long``, at least one): a client cannot
        #: take every place for long work, so another client's long request always finds one
        self.client_long = max(1, int(client_long) if client_long is not None else (self.max_long or 2) // 2)
        self.jobs: dict[Hashable, Job] = {}
        #: the clients with jobs, in turn order (the one that had its turn goes to the back), and each one's jobs in
        #: turn order: a client sending 8 requests at once gets, over time, the turns of one sending 1
        self.turns: deque[Hashable] = deque()
        self.queues: dict[Hashable, deque[Hashable]] = {}

    def generations(self) -> int:
        return sum(1 for j in self.jobs.values() if j.generates and not j.done)

    def admit(self, key: Hashable, request: Any, dialect: Dialect, client: Hashable = None) -> Job:
        """Start ``request`` (parsed by ``dialect``) under ``key`` for ``client`` (None: the request is a client of
        its own), after its token budget is checked (raises :class:`~zoo.errors.RequestTooLarge`) and, for long
        work and generations, a free place (raises :class:`~zoo.errors.ServerBusy`). No model work happens here."""
        client = ("request", key) if client is None else client
        work = dialect.work(request, self.step_tokens)
        generates = dialect.generates(request)
        self._place(generates, work.long, client)
        job = self.jobs[key] = Job(request, work.steps, dialect, generates, long=work.long, client=client,
                                   together=work.together)
        if client not in self.queues:
            self.queues[client] = deque()
            self.turns.append(client)
        self.queues[client].append(key)
        return job

    def _place(self, generates: bool, long: bool, client: Hashable) -> None:
        """A generation needs a free generation place, a request of more than one step a free place for long
        work, and its client fewer than ``client_long`` long ones (:class:`~zoo.errors.ServerBusy` otherwise: 503
        with Retry-After, at once, never queued in a place)."""
        if generates and self.generations() >= self.max_generations:
            raise ServerBusy(f"all {self.max_generations} generation places of this model are in use; retry "
                             "shortly (scoring is not affected)")
        if not long:
            return
        running = [j for j in self.jobs.values() if j.long and not j.done]
        if self.max_long is not None and len(running) >= self.max_long:
            raise ServerBusy(f"all {self.max_long} places for long requests of this model are in use; retry "
                             f"shortly (a request of at most {self.step_tokens} tokens is not affected)")
        if sum(1 for j in running if j.client == client) >= self.client_long:
            raise ServerBusy(f"you have {self.client_long} long request(s) in progress on this model, the most one "
                             f"client may; retry when one is answered (a request of at most {self.step_tokens} "
                             "tokens is not affected)")

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop jobs (finished and answered, or whose client is gone: their work stops here)."""
        for key in keys:
            job = self.jobs.pop(key, None)
            if job is None:
                continue
            queue = self.queues.get(job.client)
            if queue is not None and key in queue:
                queue.remove(key)
                if not queue:
                    del self.queues[job.client]
                    self.turns.remove(job.client)

    def run(self, keys: Iterable[Hashable], budget_s: float) -> None:
        """Advance the live jobs among ``keys``: first the fresh ones (each answered in this call if it fits one
        step: those that can share a model call run together, :meth:`_together`), then turns, one step each,
        round-robin between clients and between each client's jobs, for ``budget_s`` seconds; at least one job in
        progress always gets a turn (so a stream of short requests never starves the long ones).

        When fresh work ran, the turns after it get at most as long as it took (and at most ``budget_s``): its
        replies leave when the call ends, so they wait at most about as long again, and the jobs in progress still
        get a share of the time proportional to the fresh work's (one turn per call gave 4 generations beside 4
        clients scoring 40 tokens/s in all). A job in progress that finishes ends the turns (its reply leaves at
        once)."""
        t0 = time.perf_counter()
        live = {k for k in keys if k in self.jobs and not self.jobs[k].done}
        started = {k for k in live if self.jobs[k].steps_run}  # jobs in progress: one of them is owed a turn
        ran = self._together(live)
        for key in [k for k in self.jobs if k in live and self.jobs[k].steps_run == 0]:  # in admission order
            self.jobs[key].advance()
            ran = True
        now = time.perf_counter()
        deadline = now + min(budget_s, now - t0) if ran else t0 + budget_s
        live = {k for k in live if not self.jobs[k].done}
        while live:
            key = self._next(live)
            job = self.jobs[key]
            job.advance()
            started = set() if key in started else started
            if job.done:
                live.discard(key)
            if (job.done or time.perf_counter() >= deadline) and not (started & live):
                break

    def _next(self, live: set[Hashable]) -> Hashable:
        """Whose turn it is among ``live``: the first client in turn order with a live job, its live job that
        waited longest; both go to the back."""
        client = next(c for c in self.turns if any(k in live for k in self.queues[c]))
        self.turns.remove(client)
        self.turns.append(client)
        queue = self.queues[client]
        key = next(k for k in queue if k in live)
        queue.remove(key)
        queue.append(key)
        return key

    def _together(self, live: set[Hashable]) -> bool:
        """Run the fresh jobs that fit one step and can share a model call, one call per dialect
        (:meth:`zoo.api.dialects.Dialect.run_together`); whether any finished. If a whole call fails, its jobs are
        left to run alone, step by step."""
        groups: dict[int, list[Job]] = {}
        for key in live:
            job = self.jobs[key]
            if job.steps_run == 0 and job.together is not None:
                groups.setdefault(id(job.dialect), []).append(job)
        settled = False
        for jobs in groups.values():
            try:
                outcomes = jobs[0].dialect.run_together([j.together for j in jobs])
                if len(outcomes) != len(jobs):
                    raise RuntimeError(f"{len(outcomes)} outcomes for {len(jobs)} requests")
            except Exception:
                log.exception("running %d requests together failed; each runs alone", len(jobs))
                continue
            for job, outcome in zip(jobs, outcomes, strict=True):
                job.settle(outcome)
            settled = True
        return settled
