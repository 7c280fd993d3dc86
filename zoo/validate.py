"""Field checkers shared by every request path (library, CLI, HTTP, demo): one type rule and one message each.

Why one module: the sampling parameters, the HTTP handler and the demo used to check the same values three
times, three ways (a temperature of 1e-40 passed two of them and crashed the sampler). Every checker either
returns the clean value or raises :class:`zoo.errors.InvalidRequest` naming the field.
"""

from __future__ import annotations

import json
import math
import unicodedata
from typing import Any

from zoo.errors import InvalidRequest

#: A text with more than this share of control characters (tab, newline, carriage return excepted) is taken
#: for binary data pasted by mistake rather than text: scoring it would report a meaningless number.
CONTROL_SHARE_LIMIT = 0.05


def as_int(value: Any, field: str, lo: int, hi: int | None = None) -> int:
    """An integer in ``[lo, hi]``; integral floats (``3.0``, as sliders send) count, booleans do not."""
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            (isinstance(value, float) and (not math.isfinite(value) or value != int(value))):
        raise InvalidRequest(field, f"must be an integer, got {_show(value)}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise InvalidRequest(field, f"must be an integer {bounds}, got {_show(value)}")
    return value


def as_float(value: Any, field: str, lo: float, hi: float, lo_open: bool = False) -> float:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            (isinstance(value, int) and abs(value) > 2**1023) or not math.isfinite(value):  # int: float() overflows
        raise InvalidRequest(field, f"must be a finite number, got {_show(value)}")
    value = float(value)
    if value > hi or value < lo or (lo_open and value == lo):
        raise InvalidRequest(field, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value:g}")
    return value


def as_bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(field, f"must be true or false, got {_show(value)}")
    return value


def check_text(value: Any, field: str, max_chars: int | None = None, *, allow_empty: bool = False,
               truncate: bool = False) -> tuple[str, list[str]]:
    """A text fit to tokenise, and the warnings to pass on (a truncation).

    Refused: non-strings, empty or blank text (unless ``allow_empty``), unpaired UTF-16 surrogates (they are
    not characters and cannot be encoded as UTF-8, so no reply could echo them), NUL, and text that is mostly
    control characters (binary data). Over ``max_chars`` the text is refused, or cut with a warning when
    ``truncate`` (the demo's choice: a pasted article is still worth scoring).
    """
    if not isinstance(value, str):
        raise InvalidRequest(field, f"must be a string, got {json_type(value)}")
    if not value.strip():
        if allow_empty:
            return "", []
        raise InvalidRequest(field, "is empty: give some text")
    pos = surrogate_position(value)
    if pos is not None:
        raise InvalidRequest(field, f"contains an unpaired UTF-16 surrogate (U+{ord(value[pos]):04X}) at "
                                    f"character {pos}: not text")
    if looks_binary(value):
        raise InvalidRequest(field, "looks like binary data (NUL or many control characters): send plain text")
    warnings = []
    if max_chars is not None and len(value) > max_chars:
        if not truncate:
            raise InvalidRequest(field, f"is {len(value):,} characters long; the limit is {max_chars:,}")
        warnings.append(f"{field} has {len(value):,} characters; only the first {max_chars:,} were used")
        value = value[:max_chars]
    return value, warnings


def surrogate_position(text: str) -> int | None:
    """Index of the first unpaired surrogate code point in ``text``, or None (the common case, checked fast)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def looks_binary(text: str, sample: int = 20_000) -> bool:
    """NUL anywhere, or more than :data:`CONTROL_SHARE_LIMIT` control/replacement characters in the sample."""
    if "\x00" in text:
        return True
    head = text[:sample]
    bad = sum(1 for ch in head if ch == "\ufffd" or (unicodedata.category(ch) == "Cc" and ch not in "\t\n\r"))
    return bad > CONTROL_SHARE_LIMIT * len(head)


def json_type(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words (a client sent JSON, not Python: ``null``, not NoneType)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _show(value: Any) -> str:
    """A short, ASCII-safe rendering of a client's value for an error message."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    text = ascii(value) if isinstance(value, str) else repr(value) if isinstance(value, int | float) \
        else json_type(value)
    return text if len(text) <= 40 else text[:37] + "..."
