"""A checkpoint packed for TorchServe: ``<model store>/<name>.mar`` holding the weights, the handler
(``serving/handler.py``), the checkpoint's config and vocabulary, and the model-config yaml rendered from
:class:`~zoo.tools.serve.config.ArchiveOptions` (with the ONNX export inside when that backend is asked for).

The templates of ``serving/`` (the model-config yaml here, TorchServe's config.properties at launch) are
rendered by :func:`render`, the one place their ``$names`` are filled in.
"""

from __future__ import annotations

import shutil
import string
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from zoo.tools.serve.config import (
    HANDLER_FILE,
    NAME_RE,
    SERVING_DIR,
    ArchiveOptions,
    ServeError,
    parse_model_spec,
    resolve_checkpoint,
)


def render(template: Path, out: Path, values: dict[str, Any]) -> Path:
    """``template`` with its ``$names`` filled in (booleans as Java's ``true``/``false``), written to ``out``."""
    text = string.Template(template.read_text(encoding="utf-8")).substitute(
        {k: str(v).lower() if isinstance(v, bool) else v for k, v in values.items()})
    out.write_text(text, encoding="utf-8")
    return out


def _archiver() -> list[str]:
    exe = Path(sys.executable).parent / "torch-model-archiver"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("torch-model-archiver")
    if not found:
        raise ServeError("torch-model-archiver not found: pip install 'alstm-zoo[serve]'")
    return [found]


def build_archive(source: str, model_store: Path, name: str | None = None,
                  options: ArchiveOptions | None = None) -> Path:
    """Package a checkpoint (plus the handler and its model-config yaml) as ``<model_store>/<name>.mar``."""
    options = options or ArchiveOptions()
    options.validate()
    if not HANDLER_FILE.is_file():
        raise ServeError(f"{HANDLER_FILE} not found: zoo serve needs the source checkout's serving/ folder")
    name = name or parse_model_spec(source)[0]
    if not NAME_RE.match(name):
        raise ServeError(f"invalid model name {name!r}")
    ckpt = resolve_checkpoint(source)
    from zoo.checkpoint import CONFIG_FILE, VOCAB_FILE, WEIGHTS_FILE, read_config

    read_config(ckpt)  # fail here, with the checkpoint's own message, rather than in a worker
    weights = ckpt / WEIGHTS_FILE
    if not weights.is_file():
        raise ServeError(f"{weights}: missing")
    extra = [ckpt / CONFIG_FILE, ckpt / VOCAB_FILE] + [p for p in (ckpt / "README.md",) if p.is_file()]
    if options.backend != "eager":  # ship the verified ONNX export (found, or made now) inside the archive
        from zoo.backends import ensure_export
        from zoo.zoo_model import ZooModel

        export_dir = ensure_export(ZooModel.from_pretrained(ckpt, name=name), options.backend)
    else:
        export_dir = None
    model_store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zoo-mar-") as tmp:
        yaml_file = render(SERVING_DIR / "model-config.yaml", Path(tmp) / "model-config.yaml", asdict(options))
        if export_dir is not None:  # the archiver flattens a folder's contents: stage <folder>/onnx/ to keep onnx/
            shutil.copytree(export_dir, Path(tmp) / "export" / export_dir.name)
            extra.append(Path(tmp) / "export")
        cmd = _archiver() + [
            "--model-name", name, "--version", "1.0", "--handler", str(HANDLER_FILE),
            "--serialized-file", str(weights), "--extra-files", ",".join(str(p) for p in extra),
            "--config-file", str(yaml_file), "--export-path", str(model_store), "--force"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise ServeError(f"torch-model-archiver failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return model_store / f"{name}.mar"
