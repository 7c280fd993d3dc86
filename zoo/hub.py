"""The Hub: fetch, cache, verify and publish pretrained models with ``huggingface_hub``.

The catalogue (``zoo/catalog.json``) is the registry: for every pretrained name it pins a Hub
repository, a revision (a release tag such as ``v1.0``) and the sha256 and size of every file.
Whatever a download delivers must match those hashes, whichever revision was asked for; a
mismatch or a missing file is refused and its partial copy removed from the Hub cache, so the
cache never holds a half-written or unverified release.

Resolution of ``zoo.load(name)`` (:func:`resolve`), in order:

1. an explicit local checkpoint directory, loaded as is;
2. the Hub: first the local Hub cache (``$HF_HUB_CACHE``; no network, hashes checked), then a
   download from ``$HF_ENDPOINT`` (default huggingface.co), but only when the Hub is asked for:
   ``source="hub"``, ``zoo download``, an explicit ``revision``, or ``$HF_ENDPOINT`` / ``ZOO_HUB=1``
   set in the environment;
3. the copy bundled in the package (``zoo/pretrained/<name>/``).

Why the Hub is not contacted by default: the default models ship inside the package, so a fresh
clone must work offline, instantly, with no connection attempts or timeouts; the Hub is for
models that are not bundled, newer releases and mirrors, which the user opts into. ``HF_HUB_OFFLINE=1``
always means no network (cache, then bundled copy). ``HF_TOKEN`` and the other ``huggingface_hub``
settings apply as usual; ``model.source`` (and ``zoo info``) says which source was used:
``local path``, ``hub cache``, ``hub download`` or ``bundled``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from zoo.bundle import DEFAULT_REVISION, sha256_file, update_catalog
from zoo.pretrained import ModelNotFoundError, bundled_dir, canonical_name, catalog, catalog_path

SOURCES = ("auto", "hub", "bundled")
EXPORT_FOLDERS = ("onnx", "torchscript")
_TRUE = {"1", "true", "yes", "on"}


class HubError(ModelNotFoundError):
    """A model could not be obtained from the Hub (unreachable, not found, offline)."""


class IntegrityError(HubError):
    """Downloaded or bundled files do not match the catalogue's sha256: refused."""


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


# -- the catalogue's view of a release ------------------------------------------------------------------------
@dataclass(frozen=True)
class Release:
    """A catalogue entry's Hub coordinates and the files it pins."""

    name: str
    repo_id: str
    revision: str
    files: dict[str, dict[str, Any]]


def release(name: str, revision: str | None = None) -> Release:
    name = canonical_name(name)
    models = catalog().get("models", {})
    if name not in models:
        known = ", ".join(sorted(models)) or "none"
        raise ModelNotFoundError(f"unknown model {name!r}: not a checkpoint directory and not in the catalogue "
                                 f"(known: {known}; see `zoo list`)")
    entry = models[name]
    if not entry.get("repo_id") or not entry.get("files"):
        raise HubError(f"catalogue entry {name!r} has no Hub repo_id or file list (re-run `zoo bundle`)")
    return Release(name, entry["repo_id"], revision or entry.get("revision") or DEFAULT_REVISION, entry["files"])


def verify_files(directory: Path, rel: Release, where: str) -> None:
    """Check that ``directory`` holds every file of the release with its catalogue size and sha256."""
    for fname, meta in sorted(rel.files.items()):
        path = directory / fname
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
    for p in snap.rglob("*"):
        if p.is_symlink():
            blob = p.resolve()
            if blob not in keep and blob.is_file():
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


def download(name: str, revision: str | None = None, *, cache_dir: str | os.PathLike | None = None,
             endpoint: str | None = None, token: str | bool | None = None, force: bool = False) -> tuple[Path, str]:
    """Fetch a catalogue model into the Hub cache and verify it; returns ``(folder, "hub cache"|"hub download")``.

    The cache is consulted first (no network); ``force`` downloads again. Raises :class:`HubError`
    (unreachable, not found, offline) or :class:`IntegrityError` with a one-line message.
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

    rel = release(name, revision)
    cache = hub_cache_dir(cache_dir)
    if not force:
        hit = find_in_cache(rel, cache)
        if hit is not None:
            return hit, "hub cache"
    ep = hub_endpoint(endpoint)
    where = f"{rel.repo_id}@{rel.revision}"
    if is_offline():
        bundled = bundled_dir() / rel.name
        hint = (f"; it is bundled with this checkout ({bundled}), so `zoo.load({rel.name!r})` works offline "
                "without downloading") if (bundled / "config.json").is_file() else ""
        raise HubError(f"{rel.name} ({where}) is not in the Hub cache ({cache}) and HF_HUB_OFFLINE is set: "
                       f"run `zoo download {rel.name}` with network access{hint}")
    try:
        folder = Path(snapshot_download(rel.repo_id, revision=rel.revision, allow_patterns=sorted(rel.files),
                                        cache_dir=str(cache), endpoint=ep, token=token, force_download=force))
    except RevisionNotFoundError:
        raise HubError(f"revision {rel.revision!r} not found in {rel.repo_id} at {ep}") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise HubError(f"repository {rel.repo_id} (revision {rel.revision}) not found at {ep}, or not readable "
                       "with your token (set HF_TOKEN for a private repository)") from None
    except OfflineModeIsEnabled:
        raise HubError(f"{rel.name} is not in the Hub cache and HF_HUB_OFFLINE is set") from None
    except LocalEntryNotFoundError as e:
        raise HubError(f"cannot reach the Hub at {ep} ({_reason(e)}) and {rel.name} is not in the cache; check the "
                       "network or HF_ENDPOINT") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise HubError(f"the Hub at {ep} answered HTTP {status} for {where}: {_reason(e)}") from None
    except OSError as e:
        raise HubError(f"cannot download {where} from {ep} ({_reason(e)})") from None
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


def resolve(name_or_path: str | os.PathLike, revision: str | None = None, source: str = "auto",
            cache_dir: str | os.PathLike | None = None, endpoint: str | None = None,
            token: str | bool | None = None) -> tuple[Path, str]:
    """A checkpoint directory for a path or a catalogue name, and which source it came from (see the module doc)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        return path, "local path"
    text = str(name_or_path)
    if os.sep in text or text.startswith(".") or path.exists():
        raise ModelNotFoundError(f"{text}: not a checkpoint directory (it needs config.json, model.safetensors, "
                                 "vocab.json)")
    name = canonical_name(text)
    entry = catalog().get("models", {}).get(name)
    if entry is None:
        release(name)  # raises the "unknown model" error
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
    if explicit or hub_requested():
        if not is_offline():
            try:
                return download(name, revision, cache_dir=cache_dir, endpoint=endpoint, token=token)
            except IntegrityError:
                raise
            except HubError as e:
                if explicit or not bundled.is_dir():
                    raise
                print(f"zoo: warning: {e}; using the bundled copy", file=sys.stderr)
        elif explicit:
            raise HubError(f"{name} ({rel.repo_id}@{rel.revision}) is not in the Hub cache "
                           f"({hub_cache_dir(cache_dir)}) and HF_HUB_OFFLINE is set: run `zoo download {name}` "
                           "with network access")
    if bundled.is_dir():
        return bundled, "bundled"
    how = (f"unset HF_HUB_OFFLINE and run `zoo download {name}`" if is_offline()
           else f"run `zoo download {name}` (set HF_ENDPOINT for a mirror)")
    raise ModelNotFoundError(f"model {name!r} has no bundled copy and is not in the Hub cache "
                             f"({hub_cache_dir(cache_dir)}): {how} to fetch {rel.repo_id}@{rel.revision}")


# -- publishing ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Upload:
    """One file of a publish commit."""

    path_in_repo: str
    local: Path
    size: int
    sha256: str


def _export_path(rel: Path) -> str | None:
    """Where an export file goes in the repo: ``onnx/...`` or ``torchscript/...`` (``None``: not an export)."""
    if rel.parts[0] in EXPORT_FOLDERS:
        return rel.as_posix()
    name = rel.name.lower()
    if name.endswith((".onnx", ".onnx.data", ".onnx_data")):
        return f"onnx/{rel.as_posix()}"
    if name.endswith((".pt", ".ts", ".torchscript")):
        return f"torchscript/{rel.as_posix()}"
    return None


def default_exports_dir() -> Path:
    return Path(os.environ.get("ZOO_EXPORTS_DIR") or Path(__file__).resolve().parent.parent / "exports" / "out")


def publish_plan(name: str, exports_dir: str | os.PathLike | None = None) -> list[Upload]:
    """Every file a publish commit holds: the bundled model (verified against the catalogue) and its exports."""
    name = canonical_name(name)
    entry = catalog().get("models", {}).get(name)
    if entry is None:
        raise ModelNotFoundError(f"unknown model {name!r} (see `zoo list`)")
    src = bundled_dir() / name
    if not src.is_dir():
        raise ModelNotFoundError(f"model {name!r} has no bundled copy in {bundled_dir()}: run `zoo bundle` first")
    rel = Release(name, entry.get("repo_id", ""), entry.get("revision", DEFAULT_REVISION), entry.get("files", {}))
    if not rel.files:
        raise HubError(f"catalogue entry {name!r} has no file list (re-run `zoo bundle`)")
    verify_files(src, rel, f"the bundled copy {src} (re-run `zoo bundle` if it was changed on purpose)")
    plan = [Upload(f, src / f, meta["size"], meta["sha256"]) for f, meta in sorted(rel.files.items())]
    exports = Path(exports_dir) if exports_dir else default_exports_dir()
    if (exports / name).is_dir():
        for p in sorted((exports / name).rglob("*")):
            dest = _export_path(p.relative_to(exports / name)) if p.is_file() else None
            if dest:
                plan.append(Upload(dest, p, p.stat().st_size, sha256_file(p)))
    return plan


def publish(name: str, repo_id: str, *, tag: str | None = None, dry_run: bool = False,
            exports_dir: str | os.PathLike | None = None, token: str | bool | None = None,
            endpoint: str | None = None, private: bool | None = None, commit_message: str | None = None,
            out: TextIO | None = None) -> dict[str, Any]:
    """Upload a bundled model (and its exports) to ``repo_id`` as one commit, then tag it.

    ``dry_run`` prints exactly what would be uploaded and touches nothing. After a real publish the
    catalogue's ``repo_id``/``revision`` point at the new release.
    """
    out = out or sys.stdout
    if not re.match(r"^[\w.-]+/[\w.-]+$", repo_id):
        raise ValueError(f"invalid repo id {repo_id!r} (expected ORG/NAME)")
    name = canonical_name(name)
    plan = publish_plan(name, exports_dir)
    entry = catalog()["models"][name]
    tag = tag or entry.get("revision") or DEFAULT_REVISION
    if re.fullmatch(r"[0-9a-f]{40}", tag):
        raise ValueError(f"tag {tag!r} looks like a commit id; pass --tag NAME (e.g. v1.0)")
    message = commit_message or f"{name} {tag}: weights, vocabulary, model card" + (
        ", exports" if any(u.path_in_repo.split("/")[0] in EXPORT_FOLDERS for u in plan) else "")
    total = sum(u.size for u in plan)
    print(f"{'would upload' if dry_run else 'uploading'} {len(plan)} files ({total:,} bytes) to "
          f"{repo_id} as one commit ({message!r}), then tag {tag!r}:", file=out)
    for u in plan:
        print(f"  {u.path_in_repo:40s} {u.size:>12,}  sha256 {u.sha256}  <- {u.local}", file=out)
    result = {"repo_id": repo_id, "tag": tag, "files": [u.path_in_repo for u in plan], "dry_run": dry_run}
    if dry_run:
        return result

    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    import zoo

    ep = hub_endpoint(endpoint)
    api = HfApi(endpoint=ep, token=token, library_name="alstm-zoo", library_version=zoo.__version__)
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True, private=private)
        ops = [CommitOperationAdd(path_in_repo=u.path_in_repo, path_or_fileobj=str(u.local)) for u in plan]
        commit = api.create_commit(repo_id, operations=ops, commit_message=message, repo_type="model")
        api.create_tag(repo_id, tag=tag, revision=commit.oid, tag_message=f"{name} release {tag}",
                       repo_type="model")
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        hint = " (does the tag exist already? pass --tag)" if status == 409 else ""
        raise HubError(f"publishing to {repo_id} at {ep} failed: HTTP {status}{hint}: {_reason(e)}") from None
    except OSError as e:
        raise HubError(f"cannot reach the Hub at {ep} ({_reason(e)})") from None

    def change(cat: dict[str, Any]) -> None:
        cat["models"][name]["repo_id"] = repo_id
        cat["models"][name]["revision"] = tag

    if entry.get("repo_id") != repo_id or entry.get("revision") != tag:
        update_catalog(catalog_path(), change)
        print(f"catalogue: {name} now points at {repo_id}@{tag}", file=out)
    print(f"published {repo_id}@{tag} (commit {commit.oid})", file=out)
    return dict(result, commit=commit.oid, commit_url=str(commit.commit_url))


# -- command line -------------------------------------------------------------------------------------------
def cmd_download(args: argparse.Namespace) -> int:
    if args.local_dir:
        target = download_to(args.model, args.local_dir, revision=args.revision, force=args.force)
        print(f"{args.model}: verified {len(release(args.model, args.revision).files)} files -> {target}")
        return 0
    folder, source = download(args.model, args.revision, force=args.force)
    rel = release(args.model, args.revision)
    print(f"{rel.name}: {rel.repo_id}@{rel.revision} from the {source.replace('hub ', '')}, sha256 verified for "
          f"{len(rel.files)} files -> {folder}")
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    repo_id = args.repo_id
    if repo_id is None:  # the catalogue's repository for this model
        repo_id = catalog().get("models", {}).get(canonical_name(args.model), {}).get("repo_id")
        if not repo_id:
            raise HubError(f"{args.model}: the catalogue names no Hub repository; give --repo-id ORG/NAME")
    publish(args.model, repo_id, tag=args.tag, dry_run=args.dry_run, exports_dir=args.exports_dir,
            private=args.private or None)
    return 0


def add_cli(subparsers) -> None:
    sp = subparsers.add_parser("download", help="fetch a pretrained model from the Hub into the cache (verified)")
    sp.add_argument("model", help="catalogue name (see `zoo list`) or `default`")
    sp.add_argument("--revision", help="Hub revision (tag, branch or commit; default: the catalogue's pinned tag)")
    sp.add_argument("--local-dir", help="also copy the verified files into this (new or empty) folder")
    sp.add_argument("--force", action="store_true", help="download again even if the cache holds it")
    sp.set_defaults(func=cmd_download)

    sp = subparsers.add_parser("publish", help="upload a bundled model (+ exports) to the Hub and tag the release")
    sp.add_argument("model", help="catalogue name of a bundled model")
    sp.add_argument("--repo-id", help="target Hub repository, ORG/NAME (default: the catalogue's repo_id)")
    sp.add_argument("--tag", help="release tag (default: the catalogue's revision, e.g. v1.0)")
    sp.add_argument("--dry-run", action="store_true", help="print exactly what would be uploaded; touch nothing")
    sp.add_argument("--exports-dir", help="folder holding <name>/ exports (default: exports/out)")
    sp.add_argument("--private", action="store_true", help="create the repository as private")
    sp.set_defaults(func=cmd_publish)
