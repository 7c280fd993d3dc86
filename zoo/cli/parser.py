"""The argument parser class of the ``zoo`` command line: a usage error is one line, like every other error."""

from __future__ import annotations

import argparse
from typing import NoReturn

#: Exit status of bad input (a usage error, or any :class:`zoo.errors.ZooError`).
EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2) like every other error of the CLI: the usage block it
    prints by default buries the message, and scripts reading stderr get one line to show. The subcommands'
    parsers are of this class too (``add_subparsers`` makes them with the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
