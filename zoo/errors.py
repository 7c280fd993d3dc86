"""The zoo's user-facing errors: what a caller did wrong, as opposed to a bug in the zoo.

Front ends turn these (and only these) into a one-line message: the CLI exits with status 2, the HTTP server
answers 400 naming the field, the demo shows a readable error. Anything else is a bug and keeps its traceback
(the CLI exits 1 with it; ``ZOO_DEBUG=1`` shows the traceback of user errors too).

Each class also derives from the built-in exception a caller would have caught before this hierarchy existed
(``ValueError``, ``LookupError``, ...), so code written against the older names keeps working. This module is
the bottom layer: it imports nothing from the zoo, and every other module may import it.
"""

from __future__ import annotations


class ZooError(Exception):
    """Base class of the errors a user can fix (bad input, a missing file, an unknown name)."""


class UsageError(ZooError):
    """A command line that cannot run as given (conflicting or missing options)."""


class ConfigError(ZooError, ValueError):
    """A value a caller passed (an argument, a recipe field, a checkpoint's config) is out of range or unknown."""


class WrongType(ConfigError, TypeError):
    """An argument of the wrong type (``model.score(42)``); a ``TypeError`` too, as Python's own would be."""


class InvalidRequest(ConfigError):
    """One request field is out of its schema (``zoo.api.service``): ``field`` names it, ``message`` says why.

    A ``ValueError`` too, so callers of the library that caught ``ValueError`` from the sampling parameters
    before the schema existed still catch it.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message if message.startswith(field) else f"{field} {message}"
        super().__init__(self.message)


class RequestTooLarge(InvalidRequest):
    """A well-formed request whose work is over the deployment's budget (its tokens once tokenised): HTTP 413, so
    a client can tell "too much" from "malformed" (the message names the limit and the count)."""

    status = 413


class ModelNotServed(ZooError, LookupError):
    """A request names a model this server does not serve: HTTP 404 (OpenAI's ``model_not_found``)."""

    status = 404
    field = "model"


class ServerBusy(ZooError):
    """A valid request the server cannot start now (every slot it keeps for this kind of work is taken): HTTP 503
    with ``Retry-After``; the same request succeeds later."""

    status = 503

    def __init__(self, message: str, retry_after_s: int = 1):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class UnknownArchitectureError(ConfigError):
    """A config or command named an architecture that is not registered (``zoo.registry``)."""


class UnknownDatasetError(ConfigError):
    """A recipe, checkpoint or command named a dataset that is not registered (``zoo.datasets``)."""


class BackendError(ConfigError):
    """A backend that does not exist, or cannot run this model / in this environment (``zoo.backends``)."""


class DeviceError(ConfigError):
    """A device argument that is not a device, or names one this machine does not have (``zoo.device``)."""


class MissingFileError(ZooError, FileNotFoundError):
    """A file the caller pointed at (a recipe, an export, a checkpoint folder) does not exist."""


class DataError(ZooError, RuntimeError):
    """The data directory or a corpus file is missing or unreadable (``zoo.data``)."""


class CheckpointError(ZooError, RuntimeError):
    """A checkpoint folder is incomplete or does not match its config: a missing key, a wrong shape."""


class ModelNotFoundError(ZooError, LookupError):
    """A model name that is neither a catalogue entry, a local folder, nor a reachable Hub repo."""


class HubError(ModelNotFoundError):
    """The Hub could not provide a model (offline, unreachable, no such repo or revision)."""


class IntegrityError(HubError):
    """Downloaded files do not match the catalogue's sha256 pins: refused, and the snapshot is discarded."""
