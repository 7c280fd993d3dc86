"""Atomic file writes, in one place.

Why: a reader (a server loading a checkpoint, a resumed run, the README generator) must see a file's old bytes or
its new ones, never half of either, whatever stops the writer midway: a crash, Ctrl-C, a full disk, SIGTERM at the
end of a session. The bytes go to a new temporary file beside the target (``.NAME.XXXX.tmp``, unique per call) and
``os.replace`` swaps it in; on failure the temporary file is removed and the old file is untouched. Only a process
killed outright (SIGKILL, power cut) between the two can leave a temporary file: :func:`is_leftover` names those,
so that nothing that lists a folder (bundling, publishing) ships one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def cache_home() -> Path:
    """The zoo's cache of things remade on demand (exports made on first use, dynamic evaluation's gradient
    statistics): ``$ZOO_CACHE_DIR``, else ``$XDG_CACHE_HOME/alstm-zoo`` (``~/.cache/alstm-zoo``). Deleting it costs
    only time."""
    env = os.environ.get("ZOO_CACHE_DIR")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "alstm-zoo"


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file's bytes, read 1 MiB at a time (checkpoints and exports are hundreds of MB): the one
    digest the catalogue's pins, the Hub's verification, export manifests, bundles and ferry packs all compare."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path | str, data: str | bytes, *, fsync: bool = False) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` atomically. ``fsync`` flushes the bytes and then the folder's
    entry to disk: for files that must survive a power cut (checkpoints), not for reports that can be remade."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # (mkstemp makes it 0600: the file is meant to be read like any other)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def is_leftover(path: Path) -> bool:
    """Whether ``path`` is a temporary file :func:`write_atomic` left behind when its process was killed."""
    return path.name.startswith(".") and path.name.endswith(".tmp")
