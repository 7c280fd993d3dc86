"""Exports of any zoo model: ONNX (whole-sequence ``Scan`` graph + single-step graph, optional int8) and TorchScript.

    from zoo.export import export_model
    from zoo.export.common import exports_root
    model = zoo.load("default")
    # backends look for it under exports_root() / model.name (the resolved name, not "default")
    export_model(model, exports_root() / model.name, formats=("onnx", "torchscript"), quantize="int8")

Layout of an export folder (see exports/README.md): ``onnx/{model_sequence,model_step}[.int8].onnx``,
``torchscript/model.pt``, each format folder with an ``export.json`` manifest (checkpoint hash, opset,
state names, file hashes and the parity check against eager that ran right after the export).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zoo.errors import ConfigError
from zoo.export.common import exports_root, read_manifest, weights_sha256, write_manifest
from zoo.export.formats import format_names, get_format

__all__ = ["FORMATS", "export_model", "exports_root", "read_manifest", "weights_sha256"]

#: The registered export formats (:mod:`zoo.export.formats`), in the order ``--format all`` writes them.
FORMATS = format_names()


def export_model(model: Any, out_dir: str | Path, formats: tuple[str, ...] = FORMATS, quantize: str | None = None,
                 verify: bool = True, progress: bool = False) -> dict[str, dict[str, Any]]:
    """Export ``model`` (a :class:`~zoo.zoo_model.ZooModel`) into ``out_dir/<format>/``.

    With ``verify`` the written files are loaded back and compared with eager PyTorch on (B, T) shapes
    other than the export example; the result is stored in each manifest under ``parity``.
    Returns ``{format: manifest}``.
    """
    from zoo.export.verify import check_parity

    specs = [get_format(f) for f in formats]
    if quantize is not None and not any(quantize in s.quantizations for s in specs):
        raise ConfigError("--quantize applies to the ONNX graphs: add the onnx format")
    out_dir = Path(out_dir)
    sha256 = weights_sha256(model)
    results: dict[str, dict[str, Any]] = {}
    for spec in specs:
        if progress:
            print(f"exporting {spec.name} ...", flush=True)
        target = out_dir / spec.name
        manifest = spec.export(model, target, sha256, quantize=quantize if quantize in spec.quantizations else None)
        if verify:
            manifest["parity"] = check_parity(model, spec.name, target, int8=quantize == "int8")
            write_manifest(target, manifest)
        results[spec.name] = manifest
    return results
