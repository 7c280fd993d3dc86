"""``zoo download``: fetch a pretrained model from the Hub into the cache, sha256-verified."""

from __future__ import annotations

import argparse
from pathlib import Path

from zoo.errors import HubError, UsageError


def register(subparsers) -> None:
    sp = subparsers.add_parser("download", help="fetch a pretrained model from the Hub into the cache (verified)")
    sp.add_argument("model", help="catalogue name (see `zoo list`), `default`, or hf-hub:ORG/NAME[@REVISION]")
    sp.add_argument("--revision", help="Hub revision (tag, branch or commit; default: the catalogue's pinned tag)")
    sp.add_argument("--local-dir", help="also copy the verified files into this (new or empty) folder")
    sp.add_argument("--force", action="store_true", help="download again even if the cache holds it")
    sp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zoo.catalog import release
    from zoo.hub import HF_PREFIX, download, download_to, resolve

    if Path(args.model).is_dir():
        raise UsageError(f"{args.model} is a local folder: download takes a catalogue name or hf-hub:ORG/NAME (the "
                         "other commands take a checkpoint folder as it is)")
    if args.model.startswith(HF_PREFIX):
        if args.local_dir or args.force:
            raise UsageError("--local-dir and --force apply to catalogue names; hf-hub: repos go to the Hub cache")
        folder, source = resolve(args.model, revision=args.revision, source="hub")
        print(f"{args.model}: {source} -> {folder}")
        return 0
    if args.local_dir:
        target = download_to(args.model, args.local_dir, revision=args.revision, force=args.force)
        print(f"{args.model}: verified {len(release(args.model, args.revision).files)} files -> {target}")
        return 0
    folder, source = download(args.model, args.revision, force=args.force)
    rel = release(args.model, args.revision)
    if not rel.files:
        raise HubError(f"{rel.name}: the catalogue pins no files")
    print(f"{rel.name}: {rel.repo_id}@{rel.revision} from the {source.replace('hub ', '')}, sha256 verified for "
          f"{len(rel.files)} files -> {folder}")
    return 0
