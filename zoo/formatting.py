"""How a number is shown to a person, in one place: the CLI's model list, the model cards and the demo's tables.

A metric can be missing (a model with no test number, a run that has not evaluated yet) or not finite (a diverged
run): it is then shown as ``missing`` (each front end picks its own placeholder) rather than as ``None`` or ``nan``.
"""

from __future__ import annotations

import math
from typing import Any


def format_number(value: Any, digits: int = 2, missing: str = "n/a") -> str:
    """``value`` with ``digits`` decimals, or ``missing`` when it is absent, not a number, or not finite."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return missing
    return f"{value:.{digits}f}"
