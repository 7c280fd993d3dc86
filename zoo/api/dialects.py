"""The wire formats (dialects) the server speaks: the one contract they keep and the one registry that holds them.

Why a declared contract: the scheduler runs every request the same way (bounded steps, round-robin, generation
places) and must not know which wire format a request came in: it asks the request's dialect whether it generates
and for its work, and the handler asks the same dialect for the reply's bytes. A new wire format is a module with a
:class:`Dialect` class, one entry in :data:`DIALECTS`, and the front door's route that sets the ``X-Zoo-Api`` header
to its name (``serving/haproxy.cfg``); no scheduler or handler change (``docs/develop/extending.md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any, Protocol

from zoo.errors import InvalidRequest

if TYPE_CHECKING:
    from zoo.api.service import Limits, Service

#: The wire formats, by the ``X-Zoo-Api`` request header's value (absent: :data:`DEFAULT`): ``"module:Class"``,
#: imported when a worker loads its model.
DIALECTS: dict[str, str] = {
    "zoo": "zoo.api.native:NativeDialect",
    "openai": "zoo.api.completions:OpenAIDialect",
}
DEFAULT = "zoo"


@dataclass(frozen=True)
class Work:
    """A request's work as the scheduler runs it: a generator of bounded steps (at most ``step_tokens`` tokens
    each), each yielding ``None`` or something the client is sent as it comes (see :meth:`Dialect.chunk`), returning
    the result; and whether it needs more than one step (``long``: it then holds one of the scheduler's places for
    long work, so requests that fit one step always find a place).

    ``together``: for work that fits one step, what :meth:`Dialect.run_together` needs to run it in one model call
    with other requests' (``None``: it runs alone, through ``steps``). Why: a server that computes each short
    request alone makes 8 model calls for 8 one-sentence requests, and a model call costs about as much for one row
    as for eight (fusing them is what brought the served throughput back to its in-process ceiling)."""

    steps: Iterator[Any]
    long: bool
    together: Any = None


class Dialect(Protocol):
    """One wire format over one loaded model (``service``), named ``served`` to its clients.

    A request object is the dialect's own (it has ``task``, a name for logs); the scheduler holds it in a
    :class:`~zoo.api.scheduler.Job` and never looks inside."""

    def __init__(self, service: Service, served: str) -> None: ...

    def parse(self, raw: Any, content_type: str, limits: Limits) -> Any:
        """A request body -> a validated request (:class:`~zoo.errors.ZooError` naming what is wrong)."""

    def generates(self, request: Any) -> bool:
        """Whether the request holds one of the scheduler's generation places while it runs."""

    def work(self, request: Any, step_tokens: int) -> Work:
        """The request's work (:class:`Work`), checked against the deployment's token budgets now (raises
        :class:`~zoo.errors.RequestTooLarge`, before any model work)."""

    def run_together(self, items: list[Any]) -> list[Any]:
        """The results of several requests' one-step work (their :attr:`Work.together`), in order, computed in as
        few model calls as their size allows; an item that fails alone is its exception in the list (never raised).
        The results are what each request's ``steps`` would have returned (the numbers to float tolerance: rows
        batched together, as the Python API batches a call's texts). Called only for work whose
        :attr:`Work.together` is set: a dialect that never sets it needs no such method."""

    def content_type(self, request: Any) -> str:
        """The media type of a successful reply."""

    def chunk(self, job: Any, fresh: list[Any]) -> bytes:
        """The bytes a call sends for a job (a :class:`zoo.api.scheduler.Job`: typed ``Any`` because the scheduler
        imports this module) once its status line went out: what its steps yielded since the last call
        (``fresh``), and the rest of the reply when the job is done (its error, if it failed)."""

    def error(self, err: Exception | None, what: str = "request") -> tuple[int, dict[str, Any]]:
        """The HTTP status and body of a request's error (``None`` or a non-zoo exception: a bug, 500)."""


def dialect_names() -> list[str]:
    return sorted(DIALECTS)


def load_dialects(service: Service, served: str) -> dict[str, Dialect]:
    """Every registered dialect over ``service``'s model, by name."""
    out = {}
    for name, target in DIALECTS.items():
        module, cls = target.split(":")
        out[name] = getattr(import_module(module), cls)(service, served)
    return out


def choose(dialects: dict[str, Dialect], header: str) -> Dialect:
    """The dialect an ``X-Zoo-Api`` header names (empty: :data:`DEFAULT`; unknown: a 400 naming the header)."""
    name = header.strip().lower() or DEFAULT
    if name not in dialects:
        raise InvalidRequest("X-Zoo-Api", f"unknown API {name[:40]!r}; known: {', '.join(sorted(dialects))}")
    return dialects[name]
