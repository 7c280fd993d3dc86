"""Parity of exported files with eager PyTorch, run right after every export and stored in its manifest.

The shapes differ from the export example (batch 2) on purpose: a graph that silently specialised a
batch or time length (``torch.onnx.export`` and tracing record the example's sizes as constants unless told
otherwise) fails here instead of in production.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

#: (batch, time) shapes of the check; none is the export example's.
SHAPES = ((1, 1), (3, 17), (5, 4))
LOGIT_ATOL = 1e-4     # max |logit difference| against eager
PPL_RTOL = 1e-5       # relative perplexity difference against eager
STEP_ATOL = 1e-5      # stepping the step graph through a text vs. the sequence graph


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1))))


def _max_diff(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


@torch.no_grad()
def compare(lm: Any, runner: Any, shapes=SHAPES, seed: int = 0) -> dict[str, Any]:
    """Eager vs. ``runner`` on random tokens and random (non-zero) start states for each shape."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch, length in shapes:
        tokens = torch.randint(0, lm.vocab_size, (batch, length), generator=gen)
        targets = torch.randint(0, lm.vocab_size, (batch, length), generator=gen)
        state = tuple(torch.randn(s.shape, generator=gen) * 0.5 for s in lm.init_state(batch))
        ref_logits, ref_state = lm(tokens, state)
        logits, new_state = runner.forward(tokens, state)
        stepped, st = [], state
        for t in range(length):
            step_logits, st = runner.step(tokens[:, t], st)
            stepped.append(step_logits)
        ppl_ref, ppl = perplexity(ref_logits, targets), perplexity(logits, targets)
        rows.append({
            "batch": batch, "time": length,
            "max_abs_logit_diff": float((logits - ref_logits).abs().max()),
            "max_abs_state_diff": _max_diff(new_state, ref_state),
            "ppl_rel_diff": abs(ppl - ppl_ref) / ppl_ref,
            "step_vs_sequence_abs_diff": max(float((torch.stack(stepped, 1) - logits).abs().max()),
                                             _max_diff(st, new_state)),
        })
    summary = {key: max(r[key] for r in rows) for key in
               ("max_abs_logit_diff", "max_abs_state_diff", "ppl_rel_diff", "step_vs_sequence_abs_diff")}
    return {"shapes": rows, **summary}


def check_parity(model: Any, fmt: str, directory: Path, int8: bool = False) -> dict[str, Any]:
    """Load the export in ``directory`` and compare it with eager; ``passed`` applies the tolerances."""
    from zoo.export.formats import get_format

    spec = get_format(fmt)
    result = compare(model.lm, spec.open(directory))
    result["passed"] = (result["max_abs_logit_diff"] <= LOGIT_ATOL and result["max_abs_state_diff"] <= LOGIT_ATOL
                        and result["ppl_rel_diff"] <= PPL_RTOL and result["step_vs_sequence_abs_diff"] <= STEP_ATOL)
    result["tolerances"] = {"logit_atol": LOGIT_ATOL, "ppl_rtol": PPL_RTOL, "step_atol": STEP_ATOL}
    if int8 and "int8" in spec.quantizations:
        # int8 changes the numbers by design; recorded for information, judged on real text elsewhere.
        q = compare(model.lm, spec.open(directory, int8=True))
        result["int8"] = {k: q[k] for k in ("max_abs_logit_diff", "ppl_rel_diff", "step_vs_sequence_abs_diff")}
    return result
