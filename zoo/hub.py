"""The Hub: fetch, cache and verify pretrained models with ``huggingface_hub`` (publishing is checkout tooling).

The catalogue (:mod:`zoo.catalog`) pins, for every pretrained name, a Hub repository, a revision and the sha256
and size of every file. Whatever a download delivers must match those hashes; a mismatch or a missing file is
refused and its partial copy removed from the Hub cache, so the cache never holds a half-written or unverified
release.

Resolution of ``zoo.load(name)`` (:func:`resolve`), in order:

1. an explicit local checkpoint directory, loaded as is;
2. ``hf-hub:ORG/NAME[@REVISION]``: any compatible Hub repo. A catalogue repo at its pinned revision keeps its
   sha256 pins; anything else is loaded *unpinned* (``model.source`` and ``zoo info`` say so);
3. a catalogue name: the local Hub cache (``$HF_HUB_CACHE``; no network, hashes checked), then a download
   from ``$HF_ENDPOINT`` (default huggingface.co) when the Hub is asked for (``source="hub"``, ``zoo download``,
   an explicit ``revision``, or ``$HF_ENDPOINT`` / ``ZOO_HUB=1`` in the environment), then the copy bundled in
   a checkout (``zoo/pretrained/<name>/``), and where there is none (a plain ``pip install``) a download.

Why a checkout does not contact the Hub by default: its models are bundled, so a fresh clone works offline,
instantly, with no connection attempts or timeouts. ``HF_HUB_OFFLINE=1`` always means no network.
``HF_TOKEN`` and the other ``huggingface_hub`` settings apply as usual; ``model.source`` (and ``zoo info``) says
which source was used: ``local path``, ``bundled``, ``hub cache``, ``hub download``, or either of the last two
with ``(unpinned)``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from zoo.catalog import (
    CHECKPOINT_FILES,
    Release,
    bundled_dir,
    canonical_name,
    catalog,
    release,
    unknown_model,
)
from zoo.checkpoint import CARD_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, write_tokenizer_config
from zoo.errors import CheckpointError, ConfigError, HubError, IntegrityError, ModelNotFoundError
from zoo.files import sha256_file

SOURCES = ("auto", "hub", "bundled")
EXPORT_FOLDERS = ("onnx", "torchscript")
_TRUE = {"1", "true", "yes", "on"}
#: What every refusal for want of the Hub adds: a checkpoint folder loads with no Hub at all.
FOLDER_ROUTE = ("; or load a checkpoint folder you already have (config.json, model.safetensors, vocab.json): "
                "`zoo.load('path/to/folder')` or `zoo score path/to/folder ...`")


def offline_routes(name: str | None = None) -> str:
    """The tail of every refusal that needed the Hub (offline, refused, unresolvable, down): what works without it.

    One place, so that ``HF_HUB_OFFLINE``, a machine with no network and a Hub that does not answer all name the
    same way out: the copy bundled with a checkout (with the exact call that loads it, whatever ``$HF_ENDPOINT``
    says) where there is one, and the checkpoint-folder route always.
    """
    bundled = bundled_dir() / name if name else None
    if bundled is not None and (bundled / "config.json").is_file():
        return (f"; it is bundled with this checkout, so it loads with no network: "
                f"`zoo.load({name!r}, source='bundled')` or `zoo score {bundled} ...`{FOLDER_ROUTE}")
    return FOLDER_ROUTE


# -- settings, read at call time (huggingface_hub reads its environment once, at import) ----------------------


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def is_offline() -> bool:
    from huggingface_hub import constants

    return _env_true("HF_HUB_OFFLINE") or bool(constants.HF_HUB_OFFLINE)


def hub_requested() -> bool:
    """Whether the environment opts into the Hub for plain ``zoo.load(name)`` calls."""
    return bool(os.environ.get("HF_ENDPOINT")) or _env_true("ZOO_HUB")


def hub_endpoint(endpoint: str | None = None) -> str:
    from huggingface_hub import constants

    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    from huggingface_hub import constants

    if cache_dir:
        return Path(cache_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path(constants.HF_HUB_CACHE)


# -- verification against the catalogue's pins ------------------------------------------------------------
def verify_files(directory: Path, rel: Release, where: str) -> None:
    """Check that ``directory`` holds every file of the release with its catalogue size and sha256."""
    for fname, meta in sorted(rel.files.items()):
        path = directory / fname
        if fname == TOKENIZER_CONFIG_FILE and not path.is_file():  # derived: a release published without it
            write_tokenizer_config(directory)
        if not path.is_file():
            raise HubError(f"{where} has no file {fname!r} (the catalogue lists {', '.join(sorted(rel.files))})")
        size = path.stat().st_size
        digest = sha256_file(path)
        if size != meta["size"] or digest != meta["sha256"]:
            raise IntegrityError(f"sha256 mismatch for {fname} of {rel.name} from {where}: expected "
                                 f"{meta['sha256'][:16]}... ({meta['size']} B), got {digest[:16]}... ({size} B); "
                                 "refused and removed from the cache")


# -- the Hub cache ------------------------------------------------------------------------------------------
def _repo_cache_dir(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def discard_snapshot(cache: Path, repo_id: str, commit: str) -> None:
    """Remove one cached revision: its snapshot, the blobs no other snapshot uses, its refs and tree listing."""
    repo_dir = _repo_cache_dir(cache, repo_id)
    snap = repo_dir / "snapshots" / commit
    if not snap.is_dir():
        return
    others = [s for s in (repo_dir / "snapshots").iterdir() if s.name != commit]
    keep = {p.resolve() for s in others for p in s.rglob("*") if p.is_symlink()}
    blobs = (repo_dir / "blobs").resolve()
    for p in snap.rglob("*"):
        if p.is_symlink():
            blob = p.resolve()  # only this repo's own blobs: a link that points elsewhere is not ours to delete
            if blob not in keep and blob.is_file() and blob.is_relative_to(blobs):
                blob.unlink()
    shutil.rmtree(snap)
    for ref in (repo_dir / "refs").rglob("*") if (repo_dir / "refs").is_dir() else []:
        if ref.is_file() and ref.read_text().strip() == commit:
            ref.unlink()
    tree = repo_dir / "trees" / f"{commit}.json"
    if tree.is_file():
        tree.unlink()
    if not others:
        shutil.rmtree(repo_dir, ignore_errors=True)
        shutil.rmtree(cache / ".locks" / repo_dir.name, ignore_errors=True)


def find_in_cache(rel: Release, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The verified snapshot folder of a release in the Hub cache, or ``None`` (no network).

    A cached copy that fails verification is removed (and ``None`` returned) so that it is fetched again.
    """
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache_dir(cache_dir)
    folders = set()
    for fname in rel.files:
        if fname == TOKENIZER_CONFIG_FILE:  # (derived: a snapshot cached before it was pinned gets it in verify_files)
            continue
        hit = try_to_load_from_cache(rel.repo_id, fname, cache_dir=str(cache), revision=rel.revision)
        if not isinstance(hit, str):
            return None
        folders.add(Path(hit).parents[len(Path(fname).parts) - 1])  # the snapshot folder
    if len(folders) != 1:
        return None
    folder = folders.pop()
    try:
        verify_files(folder, rel, f"the Hub cache ({rel.repo_id}@{rel.revision})")
    except HubError as e:
        print(f"zoo: warning: {e}", file=sys.stderr)
        discard_snapshot(cache, rel.repo_id, folder.name)
        return None
    return folder


# -- downloads ----------------------------------------------------------------------------------------------
def _reason(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__ or exc
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return f"{type(cause).__name__}: {text}"[:200]


def _without_hub(way_out: str, message: str) -> HubError:
    """A refusal for want of the Hub: ``message`` plus the way out, kept apart (``way_out``) for a caller that
    falls back to the bundled copy itself and needs only the reason."""
    err = HubError(message + way_out)
    err.way_out = way_out
    return err


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], cache: Path, endpoint: str,
              token: str | bool | None, force: bool = False, name: str | None = None) -> Path:
    """``snapshot_download`` with every failure turned into a one-line :class:`HubError`.

    This is the one map from Hub failures to messages; every failure that means "no Hub here" (offline, refused,
    DNS, a 5xx) ends with :func:`offline_routes` for ``name`` (the catalogue name, where there is one).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision or 'main'}"
    way_out = offline_routes(name)
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, cache_dir=str(cache),
                                      endpoint=endpoint, token=token, force_download=force))
    except RevisionNotFoundError:
        raise HubError(f"revision {revision!r} not found in {repo_id} at {endpoint}") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise HubError(f"repository {repo_id} (revision {revision or 'main'}) not found at {endpoint}, or not "
                       "readable with your token (set HF_TOKEN for a private repository)") from None
    except OfflineModeIsEnabled:
        raise _without_hub(way_out, f"{where} is not in the Hub cache and HF_HUB_OFFLINE is set") from None
    except LocalEntryNotFoundError as e:
        raise _without_hub(way_out, f"cannot reach the Hub at {endpoint} ({_reason(e)}) and {where} is not in the "
                                    "cache (check the network or HF_ENDPOINT)") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        tail = way_out if status is None or status >= 500 else ""
        raise _without_hub(tail, f"the Hub at {endpoint} answered HTTP {status or '?'} for {where}: "
                                 f"{_reason(e)}") from None
    except OSError as e:
        raise _without_hub(way_out, f"cannot download {where} from {endpoint} ({_reason(e)})") from None


def download(name: str, revision: str | None = None, *, cache_dir: str | os.PathLike | None = None,
             endpoint: str | None = None, token: str | bool | None = None, force: bool = False) -> tuple[Path, str]:
    """Fetch a catalogue model into the Hub cache and verify it; returns ``(folder, "hub cache"|"hub download")``.

    The cache is consulted first (no network); ``force`` downloads again. Raises :class:`HubError`
    (unreachable, not found, offline) or :class:`IntegrityError` with a one-line message.
    """
    rel = release(name, revision)
    cache = hub_cache_dir(cache_dir)
    if not force:
        hit = find_in_cache(rel, cache)
        if hit is not None:
            return hit, "hub cache"
    ep = hub_endpoint(endpoint)
    where = f"{rel.repo_id}@{rel.revision}"
    if is_offline():
        raise HubError(f"{rel.name} ({where}) is not in the Hub cache ({cache}) and HF_HUB_OFFLINE is set: "
                       f"run `zoo download {rel.name}` with network access{offline_routes(rel.name)}")
    folder = _snapshot(rel.repo_id, rel.revision, sorted(rel.files), cache, ep, token, force, name=rel.name)
    try:
        verify_files(folder, rel, f"{where} at {ep}")
    except HubError:
        discard_snapshot(cache, rel.repo_id, folder.name)
        raise
    return folder, "hub download"


def download_to(name: str, target: str | os.PathLike, **kwargs: Any) -> Path:
    """Download (or take from the cache) and copy a verified release into a plain folder, atomically."""
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise HubError(f"{target} already exists and is not empty; choose another --local-dir")
    folder, _ = download(name, **kwargs)
    rel = release(name, kwargs.get("revision"))
    stage = target.with_name(f".{target.name}.partial{os.getpid()}")
    if stage.exists():
        shutil.rmtree(stage)
    try:
        stage.mkdir(parents=True)
        for fname in rel.files:
            (stage / fname).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / fname, stage / fname)
        verify_files(stage, rel, str(target))
        if target.exists():
            target.rmdir()
        os.replace(stage, target)
    finally:
        if stage.exists():
            shutil.rmtree(stage)
    return target


HF_PREFIX = "hf-hub:"
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
#: What an unpinned repo download fetches: the checkpoint, its tokenizer and card (no exports, no extras).
REPO_FILES = (*CHECKPOINT_FILES, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CARD_FILE)


def parse_hf_spec(spec: str) -> tuple[str, str | None]:
    """``hf-hub:ORG/NAME[@REVISION]`` -> ``(repo_id, revision or None)``; a malformed spec is a ConfigError."""
    body = spec[len(HF_PREFIX):]
    repo_id, _, revision = body.partition("@")
    if not _REPO_RE.match(repo_id) or ".." in repo_id or (revision == "" and "@" in body):
        raise ConfigError(f"{spec!r}: expected hf-hub:ORG/NAME or hf-hub:ORG/NAME@REVISION")
    return repo_id, revision or None


def pinned_release(repo_id: str, revision: str | None) -> Release | None:
    """The catalogue release published as ``repo_id`` (at its pinned revision, or the one asked for), if any.

    ``hf-hub:`` names of catalogue repos keep the catalogue's sha256 pins, at the pinned revision only: another
    revision has other files, which the catalogue cannot vouch for.
    """
    for name, entry in catalog().get("models", {}).items():
        if entry.get("repo_id") == repo_id and entry.get("files"):
            rel = release(name)
            if revision is None or revision == rel.revision:
                return rel
    return None


def download_repo(repo_id: str, revision: str | None = None, *, cache_dir: str | os.PathLike | None = None,
                  endpoint: str | None = None, token: str | bool | None = None) -> tuple[Path, str]:
    """Fetch any zoo-compatible Hub repo (not pinned by the catalogue): ``(folder, source)``.

    Uses the Hub cache when offline or when it already holds the revision. Loading then checks every tensor key
    and shape against the repo's ``config.json``, so an incompatible repo fails there with a clear error.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    cache = hub_cache_dir(cache_dir)
    ep = hub_endpoint(endpoint)
    where = f"{repo_id}@{revision or 'main'}"
    kwargs = dict(repo_id=repo_id, revision=revision, allow_patterns=list(REPO_FILES), cache_dir=str(cache),
                  endpoint=ep, token=token)
    source = "hub cache (unpinned)"
    try:
        folder = Path(snapshot_download(**kwargs, local_files_only=True))
        if not all((folder / f).is_file() for f in CHECKPOINT_FILES):
            raise LocalEntryNotFoundError("incomplete snapshot")
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, FileNotFoundError):
        if is_offline():
            raise HubError(f"{where} is not in the Hub cache ({cache}) and HF_HUB_OFFLINE is set"
                           f"{offline_routes()}") from None
        source = "hub download (unpinned)"
        folder = _snapshot(repo_id, revision, list(REPO_FILES), cache, ep, token)
    missing = [f for f in CHECKPOINT_FILES if not (folder / f).is_file()]
    if missing:
        raise ModelNotFoundError(f"{where} is not a zoo checkpoint: it has no {', '.join(missing)} (a zoo repo holds "
                                 f"{', '.join(CHECKPOINT_FILES)})")
    try:
        write_tokenizer_config(folder)  # (transformers' special tokens, where the repo has none)
    except CheckpointError:
        pass  # (loading names what is wrong with the repo)
    return folder, source


def resolve(name_or_path: str | os.PathLike, revision: str | None = None, source: str = "auto",
            cache_dir: str | os.PathLike | None = None, endpoint: str | None = None,
            token: str | bool | None = None) -> tuple[Path, str]:
    """A checkpoint directory for a path, a catalogue name or ``hf-hub:ORG/NAME[@REV]``, and where it came from.

    Catalogue names, in order: the Hub cache (verified, no network); a download when the Hub is asked for
    (``source="hub"``, a ``revision``, ``$HF_ENDPOINT`` or ``ZOO_HUB=1``); the copy bundled in a checkout; and,
    where there is none (a plain ``pip install``: the wheel ships no weights), a verified download.
    """
    if source not in SOURCES:
        raise ConfigError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    text = str(name_or_path)
    if not text.strip():
        raise ModelNotFoundError("no model given: a catalogue name (see `zoo list`), `default`, a checkpoint "
                                 "directory or hf-hub:ORG/NAME")
    if text.startswith(HF_PREFIX):
        repo_id, rev = parse_hf_spec(text)
        if revision is not None and rev is not None and revision != rev:
            raise ConfigError(f"{text}: the spec says revision {rev!r} but revision={revision!r} was passed")
        rev = rev or revision
        rel = pinned_release(repo_id, rev)
        if rel is not None:
            return resolve(rel.name, revision=rev, source="hub", cache_dir=cache_dir, endpoint=endpoint, token=token)
        return download_repo(repo_id, rev, cache_dir=cache_dir, endpoint=endpoint, token=token)
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        if revision is not None:  # (it was ignored)
            raise ConfigError(f"{text} is a local folder: a revision ({revision!r}) applies to Hub models only")
        return path, "local path"
    # A bare catalogue name is the catalogue's model even where the working directory holds a file or folder of
    # that name that is not a checkpoint (`zoo export NAME --out NAME` makes one); a path-like text is a path.
    is_name = text == "default" or text in catalog().get("models", {})
    if os.sep in text or text.startswith(".") or (path.exists() and not is_name):
        raise ModelNotFoundError(f"{text}: not a checkpoint directory (it needs {', '.join(CHECKPOINT_FILES)})")
    name = canonical_name(text)
    entry = catalog().get("models", {}).get(name)
    if entry is None:
        raise unknown_model(name)
    bundled = bundled_dir() / name
    if source == "bundled" or not (entry.get("repo_id") and entry.get("files")):
        if bundled.is_dir():
            return bundled, "bundled"
        raise ModelNotFoundError(f"model {name!r} has no bundled copy" + (
            f"; fetch it with `zoo download {name}`" if source == "bundled" else " and no Hub release"))
    rel = release(name, revision)
    hit = find_in_cache(rel, cache_dir)
    if hit is not None:
        return hit, "hub cache"
    explicit = source == "hub" or revision is not None
    if explicit or hub_requested() or not bundled.is_dir():
        if not is_offline():
            try:
                return download(name, revision, cache_dir=cache_dir, endpoint=endpoint, token=token)
            except IntegrityError:
                raise
            except HubError as e:
                if explicit or not bundled.is_dir():
                    raise
                reason = str(e).removesuffix(getattr(e, "way_out", ""))
                print(f"zoo: warning: {reason}; using the bundled copy", file=sys.stderr)
        elif explicit:
            raise HubError(f"{name} ({rel.repo_id}@{rel.revision}) is not in the Hub cache "
                           f"({hub_cache_dir(cache_dir)}) and HF_HUB_OFFLINE is set: run `zoo download {name}` "
                           f"with network access{offline_routes(name)}")
    if bundled.is_dir():
        return bundled, "bundled"
    raise ModelNotFoundError(f"model {name!r} has no bundled copy and is not in the Hub cache "
                             f"({hub_cache_dir(cache_dir)}): unset HF_HUB_OFFLINE and run `zoo download {name}` "
                             f"to fetch {rel.repo_id}@{rel.revision}{FOLDER_ROUTE}")
