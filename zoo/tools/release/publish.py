"""Publishing a bundled model to the Hub (checkout tooling): one commit with the weights, vocabulary, card and
exports, then a release tag; the catalogue's ``repo_id``/``revision`` follow. ``zoo publish --dry-run`` prints
exactly what would be uploaded.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from zoo.catalog import DEFAULT_REVISION, Release, bundled_dir, canonical_name, catalog, catalog_path
from zoo.errors import ConfigError, HubError, ModelNotFoundError
from zoo.export.common import exports_root, read_manifest
from zoo.files import is_leftover, sha256_file
from zoo.hub import EXPORT_FOLDERS, _reason, hub_endpoint, verify_files
from zoo.tools.release.bundle import update_catalog


@dataclass(frozen=True)
class Upload:
    """One file of a publish commit."""

    path_in_repo: str
    local: Path
    size: int
    sha256: str


def _export_path(rel: Path) -> str | None:
    """Where an export file goes in the repo: ``onnx/...`` or ``torchscript/...`` (``None``: not an export, or a
    temporary file an interrupted write left)."""
    if is_leftover(rel):
        return None
    if rel.parts[0] in EXPORT_FOLDERS:
        return rel.as_posix()
    name = rel.name.lower()
    if name.endswith((".onnx", ".onnx.data", ".onnx_data")):
        return f"onnx/{rel.as_posix()}"
    if name.endswith((".pt", ".ts", ".torchscript")):
        return f"torchscript/{rel.as_posix()}"
    return None


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
    exports = Path(exports_dir) if exports_dir else exports_root()
    if (exports / name).is_dir():
        weights = rel.files.get("model.safetensors", {}).get("sha256")
        for manifest in sorted((exports / name).glob("*/export.json")):  # made from other weights: not this release
            made_from = (read_manifest(manifest.parent) or {}).get("checkpoint_sha256")
            if made_from != weights:
                raise HubError(f"{manifest.parent} was exported from other weights ({str(made_from)[:16]}...) than "
                               f"the bundled {name} ({str(weights)[:16]}...): export it again (zoo export {name}) "
                               "or remove it")
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
        raise ConfigError(f"invalid repo id {repo_id!r} (expected ORG/NAME)")
    name = canonical_name(name)
    plan = publish_plan(name, exports_dir)
    entry = catalog()["models"][name]
    tag = tag or entry.get("revision") or DEFAULT_REVISION
    if re.fullmatch(r"[0-9a-f]{40}", tag):
        raise ConfigError(f"tag {tag!r} looks like a commit id; pass --tag NAME (e.g. v1.0)")
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



def cmd_publish(args: argparse.Namespace) -> int:
    repo_id = args.repo_id
    models = catalog().get("models", {})
    if canonical_name(args.model) not in models:
        raise ModelNotFoundError(f"unknown model {args.model!r}: publish takes a bundled catalogue name (known: "
                                 f"{', '.join(sorted(models)) or 'none'})")
    if repo_id is None:  # the catalogue's repository for this model
        repo_id = models[canonical_name(args.model)].get("repo_id")
        if not repo_id:
            raise HubError(f"{args.model}: the catalogue names no Hub repository; give --repo-id ORG/NAME")
    publish(args.model, repo_id, tag=args.tag, dry_run=args.dry_run, exports_dir=args.exports_dir,
            private=args.private or None)
    return 0



def add_cli(subparsers) -> None:
    sp = subparsers.add_parser("publish", help="upload a bundled model (+ exports) to the Hub and tag the release")
    sp.add_argument("model", help="catalogue name of a bundled model")
    sp.add_argument("--repo-id", help="target Hub repository, ORG/NAME (default: the catalogue's repo_id)")
    sp.add_argument("--tag", help="release tag (default: the catalogue's revision, e.g. v1.0)")
    sp.add_argument("--dry-run", action="store_true", help="print exactly what would be uploaded; touch nothing")
    sp.add_argument("--exports-dir", help="folder holding <name>/ exports (default: where `zoo export` writes, "
                    "$ZOO_EXPORTS_DIR: exports/out in a checkout)")
    sp.add_argument("--private", action="store_true", help="create the repository as private")
    sp.set_defaults(func=cmd_publish)
