"""Atomic file writes, in one place.

Why: a reader (a server loading a checkpoint, a resumed run, the README generator) must see a file's old bytes or
its new ones, never half of either, whatever kills the writer midway: a crash, Ctrl-C, a full disk, SIGTERM at the
end of a session. The bytes go to a sibling temporary file (named for the writing process, so two writers never
share one) and ``os.replace`` swaps it in; on failure the temporary file is removed and the old file is untouched.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path | str, data: str | bytes, *, fsync: bool = False) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` atomically. ``fsync`` flushes the bytes to disk before the swap:
    for files that must survive a power cut (checkpoints), not for reports that can be regenerated."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
