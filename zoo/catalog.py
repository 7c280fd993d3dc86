"""The catalogue of pretrained models (``zoo/catalog.json``): names, Hub coordinates and sha256 pins.

For every pretrained name the catalogue pins a Hub repository, a revision (a release tag such as ``v1.0``) and
the sha256 and size of every file; whatever a download delivers must match. A checkout also carries bundled
copies of the catalogue's models in ``pretrained/`` beside the catalogue file (the wheel does not: a plain
install fetches them from the Hub, see :mod:`zoo.hub`). ``$ZOO_CATALOG`` points at another catalogue (its
bundled copies in ``pretrained/`` beside it, or in ``$ZOO_PRETRAINED_DIR``), e.g. for tests or a private
registry. Writing the catalogue is checkout tooling (``zoo.tools.release.bundle``); this module only reads it.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from zoo.checkpoint import REQUIRED_FILES as CHECKPOINT_FILES  # noqa: F401 (used by zoo.hub)
from zoo.errors import ConfigError, HubError, ModelNotFoundError, WrongType

CATALOG_FILE = Path(__file__).resolve().parent / "catalog.json"
#: The revision a catalogue entry without one is published under.
DEFAULT_REVISION = "v1.0"


def catalog_path() -> Path:
    """``$ZOO_CATALOG`` when set, else the packaged ``zoo/catalog.json``."""
    return Path(os.environ.get("ZOO_CATALOG") or CATALOG_FILE)


def bundled_dir() -> Path:
    """Where bundled copies live: ``$ZOO_PRETRAINED_DIR``, else ``pretrained/`` beside the catalogue.

    In a checkout that is ``zoo/pretrained/``; a wheel ships no weights, so there the folder does not exist and
    every catalogue name resolves through the Hub.
    """
    env = os.environ.get("ZOO_PRETRAINED_DIR")
    return Path(env) if env else catalog_path().parent / "pretrained"


@lru_cache(maxsize=4)
def _catalog_cached(path: str, mtime_ns: int) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def catalog() -> dict[str, Any]:
    """The catalogue of pretrained models (``zoo/catalog.json`` or ``$ZOO_CATALOG``)."""
    path = catalog_path()
    if path.is_dir():
        raise ConfigError(f"the catalogue {path} is a folder (ZOO_CATALOG names a catalog.json file)")
    if not path.is_file():  # (a package being bundled into for the first time has none yet)
        return {"default": None, "models": {}}
    try:
        cat = _catalog_cached(str(path), path.stat().st_mtime_ns)
    except (ValueError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
        raise ConfigError(f"the catalogue {path} is not valid JSON: {e}") from None
    if not isinstance(cat, dict) or not isinstance(cat.get("models", {}), dict):
        raise ConfigError(f"the catalogue {path} is not a catalogue (a JSON object with a \"models\" object)")
    return cat


def _patterns(value: str | Sequence[str] | None) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if not all(isinstance(v, str) for v in value):
        raise WrongType("a filter is a pattern (str) or a list of patterns")
    return list(value)


def list_models(filter: str | Sequence[str] = "", *, dataset: str | Sequence[str] | None = None,  # noqa: A002
                architecture: str | Sequence[str] | None = None,
                exclude_filters: str | Sequence[str] = "") -> list[str]:
    """The catalogue's model names, sorted, that match every filter given (as ``timm.list_models`` does).

    Each filter is a shell-style pattern (``fnmatch``: ``*``, ``?``, ``[...]``) or a list of them (any may match).

    Args:
        filter: patterns for the name, e.g. ``"alstm-*"`` or ``["*ptbchar*", "*wt2*"]``.
        dataset: patterns for the training corpus (``"ptb"``, ``"ptb-char"``, ``"wikitext-2"``; see
            :mod:`zoo.datasets`).
        architecture: patterns for the architecture (``"alstm"``, ``"lstm"``, ``"hyperlstm"``, ``"pnorm_gru"``;
            see :mod:`zoo.registry`).
        exclude_filters: patterns for names to leave out.

    Returns:
        The matching names, each loadable with :func:`zoo.load`.
    """
    wanted = [(None, _patterns(filter)), ("dataset", _patterns(dataset)),
              ("architecture", _patterns(architecture))]
    excluded = _patterns(exclude_filters)
    names = []
    for name, entry in sorted(catalog().get("models", {}).items()):
        if any(fnmatch.fnmatchcase(name, p) for p in excluded):
            continue
        if all(not pats or any(fnmatch.fnmatchcase(name if key is None else str(entry.get(key, "")), p)
                               for p in pats) for key, pats in wanted):
            names.append(name)
    return names


def canonical_name(name: str) -> str:
    """Resolve the ``default`` alias to a catalogue name."""
    cat = catalog()
    if name == "default":
        if not cat.get("default"):
            raise ModelNotFoundError("no default model is configured in the catalogue")
        return cat["default"]
    return name


@dataclass(frozen=True)
class Release:
    """A Hub release: repository, revision and, for catalogue entries, the sha256 and size of every file.

    ``files`` is empty for a repo loaded by ``hf-hub:ORG/NAME`` that the catalogue does not pin: such a
    release is ``pinned = False`` and ``zoo info`` says so.
    """

    name: str
    repo_id: str
    revision: str
    files: dict[str, dict[str, Any]]

    @property
    def pinned(self) -> bool:
        return bool(self.files)


def unknown_model(name: str) -> ModelNotFoundError:
    models = catalog().get("models", {})
    # a name cut short (one catalogue name starts with it), else a near spelling
    close = [m for m in models if m.startswith(name)] if name else []
    close = close if len(close) == 1 else difflib.get_close_matches(name, list(models), n=1, cutoff=0.8)
    known = ", ".join(sorted(models)) or "none"
    return ModelNotFoundError(f"unknown model {name!r}: " + (f"did you mean {close[0]!r}? It is " if close else "")
                              + f"not a checkpoint directory, not in the catalogue (known: {known}; see `zoo list`) "
                              "and not an hf-hub:ORG/NAME repo")


def release(name: str, revision: str | None = None) -> Release:
    """The pinned release of a catalogue name (``default`` allowed)."""
    name = canonical_name(name)
    models = catalog().get("models", {})
    if name not in models:
        raise unknown_model(name)
    entry = models[name]
    if not entry.get("repo_id") or not entry.get("files"):
        raise HubError(f"catalogue entry {name!r} has no Hub repo_id or file list (re-run `zoo bundle`)")
    return Release(name, entry["repo_id"], revision or entry.get("revision") or DEFAULT_REVISION, entry["files"])


def resolve_local(name_or_path: str | os.PathLike) -> tuple[Path, str]:
    """A checkpoint directory for a path or a bundled catalogue name, and which source it is (no network)."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        return path, "local path"
    name = canonical_name(str(name_or_path))
    if name not in catalog().get("models", {}):
        raise unknown_model(str(name_or_path))
    bundled = bundled_dir() / name
    if bundled.is_dir():
        return bundled, "bundled"
    raise ModelNotFoundError(f"model {name!r} is in the catalogue but has no bundled copy; "
                             f"fetch it with `zoo download {name}`")
