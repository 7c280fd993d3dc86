"""bf16 mixed precision (``zoo.precision``): gradients close to fp32 for every architecture on both paths,
float32 where it must be, and the user-facing switches (recipe key, ``zoo train/score --precision``, ``zoo.load``).

The tolerances: the whole gradient (every parameter's, concatenated) is within ``ALL_TOL`` = 3% of the fp32
gradient (relative, L2), and each parameter's within ``PARAM_TOL`` = 10%. bfloat16 keeps 8 mantissa bits
(relative rounding 2^-9 = 0.2% per GEMM output); through the stack and six recurrent steps this measured
0.2-1.8% for the whole gradient and up to 5% for single small-gradient parameters (the HyperLSTM + LN's
reference loop, where autocast also rounds the layer-norm inputs). A wrong gradient (a missing term, a wrong
sign or scale) is off by far more. The test also fails if bf16 was not applied at all (gradients identical).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_ARCHS, WORDS, tiny_lm
from zoo.models.base import reference_cells
from zoo.precision import autocast

ALL_TOL, PARAM_TOL = 0.03, 0.10
DROPOUTS = dict(dropoute=0.1, dropouti=0.2, dropouto=0.2)


pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(variant: str, precision: str, reference: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, tuple]:
    lm = tiny_lm(variant, **DROPOUTS).train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(len(WORDS), (4, 7), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(5)   # the same dropout draws in both precisions
    with reference_cells(reference), autocast(precision, "cpu"):
        logits, raw, dropped, state = lm.forward_hidden(x)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss = loss + 0.5 * dropped.pow(2).mean()     # AR, as the trainer adds it
    loss.backward()
    return {k: p.grad.clone() for k, p in lm.named_parameters()}, raw, state


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
@pytest.mark.parametrize("variant", sorted(TINY_ARCHS))
def test_bf16_gradients_match_fp32(variant, reference):
    g32, raw32, state32 = _grads(variant, "fp32", reference)
    g16, raw16, state16 = _grads(variant, "bf16", reference)
    assert raw16.dtype == torch.float32 and all(s.dtype == torch.float32 for s in state16), \
        "the stack's output and carried state stay float32 under bf16"
    for name, ref in g32.items():
        err = float((g16[name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < PARAM_TOL, f"{name}: bf16 gradient {err:.3%} from fp32 (tolerance {PARAM_TOL:.0%})"
    a = torch.cat([g.flatten() for g in g32.values()])
    b = torch.cat([g16[k].flatten() for k in g32])
    err = float((b - a).norm() / a.norm())
    assert err < ALL_TOL, f"whole gradient {err:.3%} from fp32 (tolerance {ALL_TOL:.0%})"
    differs = err > 0
    assert differs, "bf16 gave bit-identical gradients: the low precision was not applied"


def test_fast_path_takes_bf16_gemms():
    """The fused paths' own GEMMs run in bf16 under autocast (not only the decoder), forward and backward."""
    from zoo.models import _gemm

    seen: list[torch.dtype | None] = []
    original = _gemm.mm

    def spy(a, b, out=None):
        seen.append(_gemm.current())
        return original(a, b, out=out)

    _gemm.mm = spy
    try:
        for variant in ("alstm", "hyperlstm", "pnorm_gru"):
            seen.clear()
            _grads(variant, "bf16", reference=False)
            assert seen and set(seen) == {torch.bfloat16}, variant
            seen.clear()
            _grads(variant, "fp32", reference=False)
            assert seen and set(seen) == {None}, variant
    finally:
        _gemm.mm = original


@pytest.fixture
def informative_checkpoint(tmp_path):
    """A tiny aLSTM whose outputs are far from uniform (embedding / tied decoder U(-1, 1)), so that bf16 rounding
    shows in its scores (an untrained default-init tiny model predicts ~uniformly in either precision)."""
    from tests.conftest import tiny_tokenizer
    from zoo.checkpoint import save_checkpoint

    lm = tiny_lm("alstm", init_range=1.0).eval()
    return save_checkpoint(tmp_path / "tiny-informative", lm, tiny_tokenizer(), {"name": "tiny", "dataset": "ptb"})


def test_load_bf16_scores_and_generates_close_to_fp32(informative_checkpoint):
    import zoo

    tiny_checkpoint = informative_checkpoint

    text = "the cat sat on the mat\na dog ran"
    a = zoo.load(str(tiny_checkpoint)).score(text)[0]
    model = zoo.load(str(tiny_checkpoint), precision="bf16")
    assert model.precision == "bf16"
    b = model.score(text)[0]
    assert b["num_tokens"] == a["num_tokens"]
    assert b["ppl"] != a["ppl"], "bf16 scoring gave fp32's exact number: the low precision was not applied"
    assert b["ppl"] == pytest.approx(a["ppl"], rel=0.01)
    # greedy generation picks the same words (this checkpoint's top choices are far apart next to bf16's error)
    greedy = model.generate("the cat", max_new_tokens=8, temperature=0)
    assert greedy == zoo.load(str(tiny_checkpoint)).generate("the cat", max_new_tokens=8, temperature=0)
    assert model.set_precision("fp32").score(text)[0]["ppl"] == a["ppl"]


def test_precision_errors_are_clear(tiny_checkpoint):
    import subprocess
    import sys

    import zoo
    from tests.conftest import REPO

    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        zoo.load(str(tiny_checkpoint), precision="fp16")
    with pytest.raises(ValueError, match="eager backend only"):
        zoo.load(str(tiny_checkpoint), backend="torchscript", precision="bf16")
    cli = [sys.executable, "-m", "zoo.cli", "score", str(tiny_checkpoint), "--text", "the cat sat"]
    ok = subprocess.run([*cli, "--precision", "bf16", "--json"], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([*cli, "--precision", "bf16", "--backend", "torchscript"], capture_output=True, text=True,
                         cwd=REPO)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "eager backend only" in bad.stderr
