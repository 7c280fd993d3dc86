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

Nothing here knows the wire format: a request comes with its dialect (:class:`zoo.api.dialects.Dialect`), and
:meth:`Scheduler.admit` asks the dialect whether the request generates and for its steps; it tests no types. The
front end formats each :class:`Job`'s progress (what its steps yielded, its result or error) through the same
dialect. Framework-free: no TorchServe imports.
"""

from __future__ import annotations

import logging
import time
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

    def __init__(self, service: Service, step_tokens: int = STEP_TOKENS, max_generations: int = 4):
        self.service = service
        self.step_tokens = max(1, int(step_tokens))
        self.max_generations = max(1, int(max_generations))
        self.jobs: dict[Hashable, Job] = {}

    def generations(self) -> int:
        return sum(1 for j in self.jobs.values() if j.generates and not j.done)

    def admit(self, key: Hashable, request: Any, dialect: Dialect) -> Job:
        """Start ``request`` (parsed by ``dialect``) under ``key``, after its token budget is checked (raises
        :class:`~zoo.errors.RequestTooLarge`) and, for a generation, a free generation place (raises
        :class:`~zoo.errors.ServerBusy`). No model work happens here."""
        steps = dialect.steps(request, self.step_tokens)
        generates = dialect.generates(request)
        self._place(generates)
        job = self.jobs[key] = Job(request, steps, dialect, generates)
        return job

    def _place(self, generates: bool) -> None:
        """A generation needs a free generation place (:class:`~zoo.errors.ServerBusy` otherwise)."""
        if generates and self.generations() >= self.max_generations:
            raise ServerBusy(f"all {self.max_generations} generation places of this model are in use; retry "
                             "shortly (scoring is not affected)")

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop jobs (finished and answered, or whose client is gone: their work stops here)."""
        for key in keys:
            self.jobs.pop(key, None)

    def run(self, keys: Iterable[Hashable], budget_s: float) -> None:
        """Advance the live jobs among ``keys`` round-robin, one step each per round, for ``budget_s`` seconds or
        until a job finishes (its reply can then leave at once), whichever is first; at least one round, so each
        makes progress whatever the budget."""
        live = [self.jobs[k] for k in keys if k in self.jobs and not self.jobs[k].done]
        deadline = time.perf_counter() + budget_s
        while live:
            for job in live:
                job.advance()
            if any(j.done for j in live) or time.perf_counter() >= deadline:
                break
