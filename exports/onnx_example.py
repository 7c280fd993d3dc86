"""Score and generate with an exported zoo model using only onnxruntime, tokenizers and numpy (no torch, no zoo).

    python exports/onnx_example.py exports/out/alstm-ptb-5m-long-medium/onnx --text "the company said its profit rose"
    python exports/onnx_example.py DIR --generate "the company said" --tokens 20
Text must already be in the corpus's conventions (PTB: lower case, numbers as N; see the README); each line is
scored as the zoo scores a text: from a zero state, first token conditioned on <eos>, one <eos> per line.
"""
import argparse
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("export_dir", type=Path, help="an ONNX export folder (export.json, graphs, tokenizer.json)")
ap.add_argument("--text", help="text to score (lines separated by \\n)")
ap.add_argument("--generate", help="prompt to continue (greedy; never <unk>, as the zoo's demo, unless --allow-unk)")
ap.add_argument("--tokens", type=int, default=20)
ap.add_argument("--allow-unk", action="store_true", help="let generation produce <unk> (the unknown-word class)")
args = ap.parse_args()
man = json.loads((args.export_dir / "export.json").read_text())
tok = Tokenizer.from_file(str(args.export_dir / man["tokenizer_file"]))
seq = ort.InferenceSession(str(args.export_dir / man["files"]["sequence"]), providers=["CPUExecutionProvider"])
step = ort.InferenceSession(str(args.export_dir / man["files"]["step"]), providers=["CPUExecutionProvider"])
names, eos = man["state_names"], man["eos_id"]


def run(session, feed, array, state):
    out = session.run(None, {feed: np.asarray(array, dtype=np.int64), **dict(zip(names, state, strict=True))})
    return out[0][0], out[1:]


def zero_state():
    return [np.zeros([1, *shape], dtype=np.float32) for shape in man["state_shapes"]]


# A copy, line for line, of zoo.generation.unk_ban (this file imports neither torch nor the zoo; the tests check that
# the two are the same): the one id that may not come next when <unk> is not to be generated.
def unk_ban(context: list[int], unk_id: int | None, spelled: list[int]) -> int | None:
    if unk_id is not None:
        return unk_id
    if spelled and context[len(context) - len(spelled) + 1:] == spelled[:-1]:
        return spelled[-1]
    return None


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


if args.text is not None:  # every line's tokens plus <eos>, the first conditioned on <eos>
    lines = args.text.split("\n")
    lines = lines[:-1] if len(lines) > 1 and lines[-1] == "" else lines  # a final newline ends a line, adds none
    ids = [i for line in lines for i in tok.encode(line).ids]
    logits, _ = run(seq, "tokens", [[eos] + ids[:-1]], zero_state())
    nll = -log_softmax(logits.astype(np.float64))[np.arange(len(ids)), ids].sum()
    print(json.dumps({"num_tokens": len(ids), "nll": float(nll), "ppl": float(np.exp(nll / len(ids)))}))
if args.generate is not None:  # the prompt through the sequence graph, then one step graph call per token
    context = [eos] + tok.encode(args.generate, add_special_tokens=False).ids
    state = run(seq, "tokens", [context[:-1]], zero_state())[1] if len(context) > 1 else zero_state()
    out = [context[-1]]
    for _ in range(args.tokens):
        logits, state = run(step, "token", out[-1:], state)
        banned = None if args.allow_unk else unk_ban(context + out[1:], man["unk_id"], man.get("unk_spelling", []))
        if banned is not None:
            logits[banned] = -np.inf
        out.append(int(logits.argmax()))  # greedy
    text = tok.decode(out[1:], skip_special_tokens=False)  # <unk> kept, <eos> is a line break, as the zoo prints
    print(json.dumps({"ids": out[1:], "text": text.replace(" <eos> ", "\n").replace("<eos>", "\n")}))
