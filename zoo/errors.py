"""The zoo's user-facing errors: what a caller did wrong, as opposed to a bug in the zoo.

Front ends turn these (and only these) into a one-line message: the CLI exits with status 2, the HTTP server
answers 400 naming the field, the demo shows a readable error. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ZooError(Exception):
    """Base class of the errors a user can fix (bad input, a missing file, an unknown name)."""


class InvalidRequest(ZooError, ValueError):
    """One request field is out of its schema (``zoo.service``): ``field`` names it, ``message`` says why.

    A ``ValueError`` too, so callers of the library that caught ``ValueError`` from the sampling parameters
    before the schema existed still catch it.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message if message.startswith(field) else f"{field} {message}"
        super().__init__(self.message)
