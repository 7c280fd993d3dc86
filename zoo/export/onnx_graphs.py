"""ONNX export: a single-step graph and a whole-sequence graph (one ``Scan`` node over the step).

Why the sequence graph is assembled from the step graph rather than traced:

* A Python time loop exports silently at the example's fixed length (the exporter unrolls it, with
  no error). The sequence needs a real ONNX loop.
* ``torch._higher_order_ops.scan`` does export to a ``Scan`` node, but in torch 2.13 the ONNX
  exporter's decomposition of the scan body fails for cells whose step slices or reshapes along the
  (dynamic) batch dimension (HyperLSTM, p-norm GRU: "'SymInt' object has no attribute 'unsqueeze'")
  and for ``torch.lstm`` inside the body (LSTM: "trying to pop from empty mode stack").
* So only the step is captured by ``torch.onnx.export`` (dynamo exporter, dynamic batch), and the
  sequence graph is one ONNX ``Scan`` whose body *is* that step graph, scanning ``tokens`` along axis 1
  and stacking the logits along axis 1. The batch and time axes are both symbolic, the step and the
  sequence graph compute exactly the same thing, and nothing depends on the architecture.

I/O names: ``token`` [B] / ``tokens`` [B, T] (int64) and one input per state tensor named by
``lm.state_names()``; outputs ``logits`` ([B, V] / [B, T, V]) and ``<state name>_out``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint import TOKENIZER_FILE
from zoo.export.common import EXAMPLE_BATCH, StepModule, base_manifest, write_manifest
from zoo.files import sha256_file
from zoo.generation import unk_spelling
from zoo.lm import LanguageModel

#: ONNX opset of the exported graphs (the dynamo exporter's default in torch 2.13, pinned for reproducibility).
OPSET = 20
STEP_FILE, SEQUENCE_FILE = "model_step.onnx", "model_sequence.onnx"
STEP_INT8_FILE, SEQUENCE_INT8_FILE = "model_step.int8.onnx", "model_sequence.int8.onnx"
BODY_PREFIX = "step."


class OnnxExportError(RuntimeError):
    """The exporter produced a graph that does not have the expected I/O contract."""


def out_name(state_name: str) -> str:
    return f"{state_name}_out"


@contextlib.contextmanager
def quiet_exporters() -> Iterator[None]:
    """Silence the exporter's and the quantizer's chatter (torchvision notices, pre-processing hints)."""
    names = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript", "root")
    loggers = [logging.getLogger(n if n != "root" else None) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_step_graph(lm: LanguageModel, opset: int = OPSET):
    """``LanguageModel.step`` as an ONNX model with a dynamic batch axis."""
    lm = lm.eval()
    names = lm.state_names()
    state = lm.init_state(EXAMPLE_BATCH)
    token = torch.zeros(EXAMPLE_BATCH, dtype=torch.long)
    batch = torch.export.Dim("batch")
    with quiet_exporters(), torch.no_grad():
        program = torch.onnx.export(
            StepModule(lm), (token, *state), dynamo=True, opset_version=opset, optimize=True, verbose=False,
            input_names=["token", *names], output_names=["logits", *map(out_name, names)],
            dynamic_shapes=({0: batch}, tuple({0: batch} for _ in state)),
        )
    model = program.model_proto
    got_in = [i.name for i in model.graph.input]
    got_out = [o.name for o in model.graph.output]
    if got_in != ["token", *names] or got_out != ["logits", *map(out_name, names)]:
        raise OnnxExportError(f"step graph I/O {got_in} -> {got_out} does not match the state names {names}")
    return model


def _rename_in_graph(graph, mapping: dict[str, str]) -> None:
    """Rename value references in ``graph`` and, for outer-scope references, in nested subgraphs."""
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        vi.name = mapping.get(vi.name, vi.name)
    for node in graph.node:
        for k, name in enumerate(node.input):
            node.input[k] = mapping.get(name, name)
        for k, name in enumerate(node.output):
            node.output[k] = mapping.get(name, name)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _rename_in_graph(sub, mapping)


def build_sequence_graph(step_model, state_names: list[str]):
    """Wrap a step graph into ``Scan``: ``(tokens [B, T], *state) -> (logits [B, T, V], *state_out)``.

    The step graph becomes the Scan body unchanged except for names: its initializers move to the
    outer graph (a subgraph may read outer-scope values) and its I/O values are prefixed so that no
    body name shadows an outer one, which ONNX forbids.
    """
    import onnx
    from onnx import TensorProto, helper

    step_graph = step_model.graph
    body = onnx.GraphProto()
    body.CopyFrom(step_graph)
    body.name = "lm_step"
    del body.initializer[:]
    outer_names = {"tokens", "logits", *state_names, *map(out_name, state_names)}
    io_names = [v.name for v in [*step_graph.input, *step_graph.output]]
    internal = {n for node in step_graph.node for n in node.output} - set(io_names)
    mapping = {n: BODY_PREFIX + n for n in io_names}
    mapping.update({n: BODY_PREFIX + n for n in internal & outer_names})
    _rename_in_graph(body, mapping)
    # Scan body order: carried state first, then the scanned token; outputs: new state, then the logits.
    ins, outs = list(body.input), list(body.output)
    del body.input[:]
    del body.output[:]
    body.input.extend(ins[1:] + ins[:1])
    body.output.extend(outs[1:] + outs[:1])

    def dims(vi) -> list[Any]:
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    state_inputs = list(step_graph.input[1:])
    logits_info = step_graph.output[0]
    scan = helper.make_node(
        "Scan", [*state_names, "tokens"], [*map(out_name, state_names), "logits"], name="time_scan",
        num_scan_inputs=1, scan_input_axes=[1], scan_output_axes=[1], body=body)
    inputs = [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", "time"])]
    inputs += [helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type, ["batch", *dims(vi)[1:]])
               for vi in state_inputs]
    outputs = [helper.make_tensor_value_info("logits", logits_info.type.tensor_type.elem_type,
                                             ["batch", "time", *dims(logits_info)[1:]])]
    outputs += [helper.make_tensor_value_info(out_name(vi.name), vi.type.tensor_type.elem_type,
                                              ["batch", *dims(vi)[1:]]) for vi in state_inputs]
    graph = helper.make_graph([scan], "lm_sequence", inputs, outputs, initializer=list(step_graph.initializer))
    model = helper.make_model(graph, opset_imports=list(step_model.opset_import), ir_version=step_model.ir_version)
    model.functions.extend(step_model.functions)
    onnx.checker.check_model(model)
    return model


def set_metadata(model, meta: dict[str, Any]) -> None:
    """Named metadata (opset, checkpoint hash, state names, ...) readable with any ONNX tool."""
    from onnx import helper

    from zoo.version import __version__

    model.producer_name = "alstm-zoo"
    model.producer_version = __version__
    props = {f"zoo.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    helper.set_model_props(model, props)


def _unshare_matmul_weights(model) -> None:
    """Give every Gemm/MatMul its own copy of a weight that other nodes also read.

    Why: ``quantize_dynamic`` rewrites ``Gemm`` as ``MatMul`` by transposing the weight initializer in
    place; with tied embeddings the same initializer feeds the embedding ``Gather``, which would then
    read a transposed matrix (silently wrong logits, or a shape-inference failure).
    """
    uses = Counter(name for node in model.graph.node for name in node.input)
    inits = {init.name: init for init in model.graph.initializer}
    for k, node in enumerate(model.graph.node):
        if node.op_type not in ("Gemm", "MatMul"):
            continue
        for j, name in enumerate(node.input):
            if name in inits and uses[name] > 1:
                copy = model.graph.initializer.add()
                copy.CopyFrom(inits[name])
                copy.name = f"{name}.{node.op_type.lower()}{k}"
                node.input[j] = copy.name
                uses[name] -= 1


def quantize_step_int8(step_path: Path, out_path: Path) -> None:
    """Dynamic int8 quantisation of the step graph (weights int8, activations quantised at run time)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(step_path))
    _unshare_matmul_weights(model)
    # The quantizer transposes weights in place but not their shape annotations; stale value_info
    # entries then fail its shape inference. They are only hints, so drop them and let it re-infer.
    del model.graph.value_info[:]
    with quiet_exporters():
        quantize_dynamic(model, str(out_path), weight_type=QuantType.QInt8, per_channel=True)


def export_onnx(model: Any, out_dir: Path, sha256: str, quantize: str | None = None,
                opset: int = OPSET) -> dict[str, Any]:
    """Write the step and sequence graphs (and their int8 versions with ``quantize="int8"``) plus
    ``export.json``; returns the manifest."""
    import onnx

    if quantize not in (None, "int8"):
        raise ValueError(f"unknown quantisation {quantize!r} (supported: int8)")
    out_dir.mkdir(parents=True, exist_ok=True)
    lm: LanguageModel = model.lm
    names = lm.state_names()
    manifest = base_manifest(model, "onnx", sha256)
    manifest.update(opset=opset, onnx_version=onnx.__version__)
    meta = {k: manifest[k] for k in ("checkpoint_sha256", "state_names", "state_shapes", "vocab_size",
                                     "architecture", "model_name", "export_version")}
    meta["opset"] = str(opset)
    step = export_step_graph(lm, opset)
    graphs = {"step": (step, STEP_FILE), "sequence": (build_sequence_graph(step, names), SEQUENCE_FILE)}
    for kind, (graph, fname) in graphs.items():
        set_metadata(graph, {**meta, "graph": kind, "quantization": "none"})
        onnx.save(graph, str(out_dir / fname))
    if quantize == "int8":
        quantize_step_int8(out_dir / STEP_FILE, out_dir / STEP_INT8_FILE)
        step_q = onnx.load(str(out_dir / STEP_INT8_FILE))
        seq_q = build_sequence_graph(step_q, names)
        for kind, graph, fname in (("step", step_q, STEP_INT8_FILE), ("sequence", seq_q, SEQUENCE_INT8_FILE)):
            set_metadata(graph, {**meta, "graph": kind, "quantization": "int8-dynamic"})
            onnx.save(graph, str(out_dir / fname))
        graphs["step_int8"] = (step_q, STEP_INT8_FILE)
        graphs["sequence_int8"] = (seq_q, SEQUENCE_INT8_FILE)
    manifest["files"] = {kind: fname for kind, (_, fname) in graphs.items()}
    manifest["file_sha256"] = {fname: sha256_file(out_dir / fname) for _, fname in graphs.values()}
    # what a deployment without torch or the zoo needs besides the graphs (exports/onnx_example.py uses them)
    (out_dir / TOKENIZER_FILE).write_text(json.dumps(model.tokenizer.to_hf_json(), ensure_ascii=False),
                                          encoding="utf-8")
    manifest.update(tokenizer_file=TOKENIZER_FILE, eos_id=model.tokenizer.eos_id, unk_id=model.tokenizer.unk_id,
                    unk_spelling=unk_spelling(model.tokenizer), normalization=model.tokenizer.normalization)
    manifest["io"] = {
        "sequence": {"inputs": ["tokens", *names], "outputs": ["logits", *map(out_name, names)]},
        "step": {"inputs": ["token", *names], "outputs": ["logits", *map(out_name, names)]},
    }
    write_manifest(out_dir, manifest)
    return manifest
