"""Fair sharing of one model between requests: work in bounded steps, round-robin, generations capped.

Why: a server that runs each request (or each batch of requests) to the end lets one client take the model from
everyone else. One score request of 64 long texts held the only worker for ~10 s, and the library's batching
(:func:`zoo.scoring.score_texts` sorts texts by length and pads each group to its longest) made short texts of
other requests run for all of a long text's steps. Here:

* **Bounded steps.** A score request runs as :meth:`zoo.api.service.Service.score_steps` (its texts batched with each
  other only, never padded to another request's), one step = at most ``step_tokens`` tokens (rows x columns:
  its cost, mostly the decoder's, grows with the tokens), the recurrent state carried across steps
  exactly as the library always scores a long text in chunks: the numbers are the Python API's. A generation is
  one token per step, after its prompt is read ``step_tokens`` tokens at a time.
* **Round-robin.** :meth:`Scheduler.run` gives every live job one step per round, score chunks and generation
  steps alike, so a request's latency grows with its own size and with the *number* of requests in progress, not
  with their sizes.
* **Generations are capped** (``max_generations``): a generation holds its place for hundreds of steps, so with no
  cap a few clients generating fill every place the server has (TorchServe's batch: a request stays in it until
  answered) and a score request waits for a generation to end. Over the cap a generation is refused at once with
  :class:`~zoo.errors.ServerBusy` (HTTP 503 + ``Retry-After``), which keeps the rest of the places for scoring.
  Why refuse rather than queue: a queued generation still holds one of those places while it waits (the frontend
  hands a request to the worker only into a free place), so a queue inside the worker would not keep any place
  free; refusing costs the client one retry and never costs another client anything.
* **Long work holds at most** ``max_long`` **places** (requests of more than one step, generations included; the
  handler keeps a quarter of TorchServe's batch places for requests that fit one step). Over it a long request is
  refused at once (503 + ``Retry-After``), so no set of clients sending valid long requests can hold every place
  in which a short request could start, and a short one, given the first turn (:meth:`Scheduler.run`), is
  answered in the call that starts it: 8 clients looping the largest request held all 8 places and moved
  honest clients' p50 37x.

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

    def take_pieces(self) -> list[str]:
        """The generated pieces since the last call (what a stream sends next)."""
        out, self.fresh = self.fresh, []
        return out


class Scheduler:
    """The jobs in progress on one model, by the front end's keys, run round-robin in bounded steps."""

    def __init__(self, service: Service, step_tokens: int = STEP_TOKENS, max_generations: int = 4,
                 max_long: int | None = None):
        self.service = service
        self.step_tokens = max(1, int(step_tokens))
        self.max_generations = max(1, int(max_generations))
        #: jobs of more than one step (generations included) in progress at most: the front end's other places
        #: are kept for requests that fit one step, which finish in the call that starts them, so no set of
        #: clients sending long requests holds every place where a short one could start (None: no bound)
        self.max_long = None if max_long is None else max(1, int(max_long))
        self.jobs: dict[Hashable, Job] = {}
        #: whose turn is next (:meth:`run`): a fresh job at the front, a job that had its turn at the back
        self.turns: deque[Hashable] = deque()

    def generations(self) -> int:
        return sum(1 for j in self.jobs.values() if j.generates and not j.done)

    def admit(self, key: Hashable, request: Any, dialect: Dialect) -> Job:
        """Start ``request`` (parsed by ``dialect``) under ``key``, after its token budget is checked (raises
        :class:`~zoo.errors.RequestTooLarge`) and, for a generation, a free generation place (raises
        :class:`~zoo.errors.ServerBusy`). No model work happens here."""
        work = dialect.work(request, self.step_tokens)
        generates = dialect.generates(request)
        self._place(generates, work.long)
        job = self.jobs[key] = Job(request, work.steps, dialect, generates, long=work.long)
        self.turns.appendleft(key)
        return job

    def _place(self, generates: bool, long: bool = False) -> None:
        """A generation needs a free generation place, a request of more than one step a free place for long
        work (:class:`~zoo.errors.ServerBusy` otherwise: 503 with Retry-After, at once, never queued in a place)."""
        if generates and self.generations() >= self.max_generations:
            raise ServerBusy(f"all {self.max_generations} generation places of this model are in use; retry "
                             "shortly (scoring is not affected)")
        if long and self.max_long is not None and sum(1 for j in self.jobs.values()
                                                      if j.long and not j.done) >= self.max_long:
            raise ServerBusy(f"all {self.max_long} places for long requests of this model are in use; retry "
                             f"shortly (a request of at most {self.step_tokens} tokens is not affected)")

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop jobs (finished and answered, or whose client is gone: their work stops here)."""
        for key in keys:
            if self.jobs.pop(key, None) is not None and key in self.turns:
                self.turns.remove(key)

    def run(self, keys: Iterable[Hashable], budget_s: float) -> None:
        """Advance the live jobs among ``keys`` one step per turn, in :attr:`turns` order, round-robin: the fresh
        jobs' first (a request that fits one step is answered in the call that starts it, however many long jobs
        are in progress: a round of 16 long jobs' steps took 0.4 s before), then the job that waited longest; a job
        that had its turn goes to the back. For ``budget_s`` seconds or until a job finishes (its reply can then
        leave at once), whichever is first, but every fresh job and at least one job in progress get a turn (so a
        stream of short requests never starves the long ones)."""
        live = {k for k in keys if k in self.jobs and not self.jobs[k].done}
        fresh = {k for k in live if self.jobs[k].steps_run == 0}
        waiting = bool(live - fresh)  # a job in progress still owed its turn in this call
        deadline, stop = time.perf_counter() + budget_s, False
        while live:
            key = next((k for k in self.turns if k in live), None)
            if key is None:
                break
            self.turns.remove(key)
            self.turns.append(key)
            job = self.jobs[key]
            job.advance()
            waiting = waiting and key in fresh
            fresh.discard(key)
            if job.done:
                live.discard(key)
            stop = stop or job.done or time.perf_counter() >= deadline
            if stop and not fresh and not (waiting and live):
                break
