"""What the commands read from the user: texts from ``--text``, a file or standard input, checked as UTF-8, and
counts checked for range, each refused in one line that names the option (or file) the user gave."""

from __future__ import annotations

import argparse
import codecs
import contextlib
import math
import sys
from collections.abc import Iterator

from zoo.errors import UsageError


def read_bytes(src: str) -> bytes:
    """A file's (``-``: standard input's) bytes. A source whose first MiB is mostly NUL bytes (binary data, or an
    endless one such as /dev/zero) is refused there, not read to the end first; a shorter input, or a stray NUL
    in text, is left to the text check, which names its line."""
    if src == "-" and sys.stdin is None:  # (started with standard input closed)
        raise UsageError("no standard input to read: give --text or a file")
    f = sys.stdin.buffer if src == "-" else open(src, "rb")  # noqa: SIM115 (closed below unless stdin)
    try:
        head = f.read(1 << 20)
        if len(head) == 1 << 20:  # maybe endless (/dev/zero, /dev/urandom): judge it by its first MiB
            if head.count(b"\x00") * 20 > len(head):
                raise UsageError(f"{src} looks like binary data (NUL bytes): give a text file")
            try:
                codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
            except UnicodeDecodeError as e:
                raise UsageError(f"{src}: not valid UTF-8 (byte {e.start})") from None
        return head + f.read()
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def read_texts(args: argparse.Namespace) -> list[str]:
    """The texts of ``--text`` (repeatable) or of the input file / standard input (with ``--per-line``, one per
    line, blank lines kept in place so that line numbers hold)."""
    if args.text is not None and args.input is not None:
        raise UsageError("give either --text or an input file, not both")
    if args.text is not None and args.per_line:
        raise UsageError("--per-line splits an input file (or stdin) at its lines; each --text is already one "
                         "text (repeat --text for several)")
    if args.text is not None:
        texts = list(args.text)
        for n, text in enumerate(texts):
            valid_utf8(text, "--text" if len(texts) == 1 else f"--text #{n + 1}")
    else:
        texts = _read_input(args.input, args.per_line)
    if not texts or all(not t.strip() for t in texts):
        raise UsageError("nothing to score: the input is empty")
    if not args.per_line and any(not t.strip() for t in texts):
        raise UsageError("empty text in the input")
    return texts  # with --per-line, blank lines stay in place (reported as skipped) so that line numbers hold


def _read_input(name: str | None, per_line: bool) -> list[str]:
    """The input file's (``-`` or none: standard input's) text, whole or split at its lines."""
    if name == "":  # (an unset shell variable: not a request to read standard input)
        raise UsageError("empty file name: give a file, - for standard input, or --text")
    src = name or "-"
    # (waiting silently on a terminal looks like a hang)
    if src == "-" and sys.stdin is not None and sys.stdin.isatty():
        print("zoo: reading the text from the terminal until Ctrl-D (or give --text or a file)", file=sys.stderr)
    try:
        raw = read_bytes(src)
    except OSError as e:
        raise UsageError(f"cannot read {src}: {e.strerror}") from None
    try:
        content = raw.decode("utf-8").removeprefix("\ufeff")  # (a byte-order mark is not text: not "dropped")
    except UnicodeDecodeError as e:
        raise UsageError(f"{src}: not valid UTF-8 (byte {e.start})") from None
    # lines end at "\n" only (str.splitlines also splits at \f, \x1c-\x1e, \x85, \u2028/9, which would
    # shift every later line number)
    return [t.removesuffix("\r") for t in content.removesuffix("\n").split("\n")] if per_line else [content]


@contextlib.contextmanager
def in_flags(names: dict[str, str]) -> Iterator[None]:
    """A request-schema error (:class:`InvalidRequest`) in the command line's words: the option (or file) the
    user gave, not the request field ("--max-new-tokens must be ...", not "max_new_tokens must be ...")."""
    from zoo.errors import InvalidRequest

    try:
        yield
    except InvalidRequest as e:
        if e.field not in names:
            raise
        raise UsageError(names[e.field] + e.message[len(e.field):]) from None


def valid_utf8(text: str, flag: str) -> None:
    """Command-line bytes that are not UTF-8 reach Python as lone surrogates (U+DC80..U+DCFF); say so in bytes
    (the schema would call them unpaired UTF-16 surrogates, true of JSON but not of a command line)."""
    try:
        text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError as e:
        raise UsageError(f"{flag} is not valid UTF-8 (byte {e.start})") from None


def require(args: argparse.Namespace, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """Refuse out-of-range counts before anything loads, in one line (argparse's ``type=int`` lets 0 and negatives
    through, and they would fail deep inside: a zero batch size, a zero ``--jobs`` waiting forever)."""
    for flags, low, what in ((positive, 1, "a positive integer"), (non_negative, 0, "at least 0")):
        for flag in flags:
            value = getattr(args, flag.lstrip("-").replace("-", "_"))
            if value is not None and not (math.isfinite(value) and value >= low):  # (NaN compares false)
                raise UsageError(f"{flag} must be {what}, got {value}")
