"""``python -m zoo.cli``: the ``zoo`` command (the package is imported as ``zoo.cli``, not run as ``__main__``, so
its error classes are the library's own)."""

import sys

from zoo.cli import main

sys.exit(main())
