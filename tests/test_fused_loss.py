"""The decoder fused with the training loss (``zoo.models._fused_loss``) equals decode-then-``cross_entropy``:
the loss and the gradients w.r.t. the hidden states, the (tied) decoder weight and bias, with ignored targets
and row counts that are not a multiple of the block size; and the training step really takes that path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import WORDS, tiny_lm
from zoo.models import _fused_loss
from zoo.models._fused_loss import linear_cross_entropy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("rows", [1, 127, 300])
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_decode_then_cross_entropy(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 24, generator=g)
    w = torch.randn(500, 24, generator=g) * 0.3
    b = torch.randn(500, generator=g) if with_bias else None
    y = torch.randint(0, 500, (rows,), generator=g)
    if rows > 1:
        y[::3] = -100                                   # ignored targets count nowhere
    leaves = [t.clone().requires_grad_() for t in (h, w)] + ([b.clone().requires_grad_()] if with_bias else [])
    ref = F.cross_entropy(F.linear(leaves[0], leaves[1], leaves[2] if with_bias else None), y, ignore_index=-100)
    ref.backward()
    fused_leaves = [t.clone().requires_grad_() for t in (h, w)] + ([b.clone().requires_grad_()] if with_bias else [])
    out = linear_cross_entropy(fused_leaves[0], fused_leaves[1], fused_leaves[2] if with_bias else None, y)
    (out * 3.0).backward()                              # the incoming gradient scales every result
    assert float(out.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    for a, r in zip(fused_leaves, leaves, strict=True):
        torch.testing.assert_close(a.grad, 3.0 * r.grad, rtol=1e-5, atol=1e-7)


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    h = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(7, 4, requires_grad=True)
    out = linear_cross_entropy(h, w, None, torch.full((5,), -100))
    out.backward()
    assert out.detach().item() == 0.0 and not h.grad.any() and not w.grad.any()


@pytest.mark.parametrize("variant", ["alstm", "lstm"])
def test_lm_training_loss_matches_the_decoder_path_with_tied_weights(variant):
    lm = tiny_lm(variant, dropoute=0.1, dropouti=0.2, dropouto=0.2).train()
    assert lm.tie_weights
    tokens = torch.randint(len(WORDS), (3, 9), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    grads = []
    for fused in (False, True):
        lm.zero_grad()
        torch.manual_seed(4)
        if fused:
            loss, *_ = lm.training_loss(x, y)
        else:
            logits, *_ = lm.forward_hidden(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        grads.append((float(loss), {k: p.grad.clone() for k, p in lm.named_parameters()}))
    assert grads[1][0] == pytest.approx(grads[0][0], rel=1e-6)
    for k, ref in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][k], ref, rtol=1e-5, atol=1e-7, msg=k)


def test_the_trainer_step_takes_the_fused_path(monkeypatch, tmp_path):
    from tests.conftest import synthetic_corpus
    from tests.test_train import write_recipe
    from zoo.training import Recipe, Trainer

    calls = []
    original = _fused_loss._LinearCrossEntropy.apply
    monkeypatch.setattr(_fused_loss._LinearCrossEntropy, "apply", lambda *a: calls.append(1) or original(*a))
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", arch="lstm"))
    t = Trainer(recipe, tmp_path / "run", progress=False,
                data_dir=str(synthetic_corpus(tmp_path / "data", {"train": 40, "valid": 10, "test": 10})))
    t.train_step(t.train_data[:12].t(), t.train_data[1:13].t(), 12)
    assert calls == [1]


@pytest.mark.parametrize("rows", [5, 300])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bf16_path_is_the_loss_of_bf16_operands(rows, with_bias):
    """Under bf16 autocast the fused loss (whole-batch bf16 backward GEMMs over a bf16 gradient buffer) is
    decode-then-``cross_entropy`` of the bf16-rounded ``h`` and ``W`` up to bf16 rounding of the logits and of
    the gradient: loss within 0.5%, each gradient within 1% (L2; measured 0.06-0.3%). The low precision really
    is applied: the result is not the float32 one, and the gradients are float32."""
    from zoo.precision import autocast

    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 64, generator=g)
    w = torch.randn(3000, 64, generator=g) * 0.2
    b = torch.randn(3000, generator=g) * 0.5 if with_bias else None
    y = torch.randint(0, 3000, (rows,), generator=g)
    y[::4] = -100
    rounded = [t.to(torch.bfloat16).float().requires_grad_() for t in (h, w)] + \
        ([b.clone().requires_grad_()] if with_bias else [])
    ref = F.cross_entropy(F.linear(rounded[0], rounded[1], rounded[2] if with_bias else None), y)
    ref.backward()
    leaves = [t.clone().requires_grad_() for t in (h, w)] + ([b.clone().requires_grad_()] if with_bias else [])
    with autocast("bf16", "cpu"):
        out = linear_cross_entropy(leaves[0], leaves[1], leaves[2] if with_bias else None, y)
    out.backward()
    assert out.dtype == torch.float32
    assert float(out) == pytest.approx(float(ref), rel=5e-3)
    for a, r in zip(leaves, rounded, strict=True):
        assert a.grad.dtype == torch.float32
        err = float((a.grad - r.grad).norm() / r.grad.norm())
        assert err < 0.01, f"bf16 gradient {err:.3%} from the reference"
    f32 = linear_cross_entropy(h, w, b, y)
    assert float(f32) != float(out), "bf16 gave the float32 loss: the low precision was not applied"


@pytest.mark.parametrize("block", [1, 7, 64, 5000])
@pytest.mark.parametrize("with_bias", [True, False])
def test_target_logprobs_equal_decode_then_log_softmax(block, with_bias):
    """Evaluation's fused decoder (vocabulary blocks, running log-sum-exp) gives each target's log-probability as
    decoding then log-softmax does; the target is a term of its own sum, so nothing is above 0; padding is clamped
    (its value is masked by the caller) rather than an index error."""
    from zoo.models._fused_loss import linear_target_logprobs

    g = torch.Generator().manual_seed(block)
    h = torch.randn(130, 24, generator=g)
    w = torch.randn(500, 24, generator=g)
    b = torch.randn(500, generator=g) if with_bias else None
    y = torch.randint(0, 500, (130,), generator=g)
    y[0], y[1] = 0, 499                                 # the first and the last word of the vocabulary
    ref = F.log_softmax(F.linear(h, w, b), -1).gather(1, y[:, None]).squeeze(1)
    out = linear_target_logprobs(h, w, b, y, block=block)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    confident = linear_target_logprobs(h, w * 50, b, F.linear(h, w * 50, b).argmax(1), block=block)
    assert (confident <= 0).all() and confident.max() > -1e-3
    y[5] = -100
    assert torch.isfinite(linear_target_logprobs(h, w, b, y, block=block)).all()


def test_scoring_and_validation_take_the_fused_decoder(monkeypatch):
    """The eager model's corpus evaluation goes through linear_target_logprobs (not the logits) when the
    vocabulary spans several blocks, and a runner without target_logprobs (an export's) scores through its
    logits."""
    from zoo import scoring

    lm = tiny_lm("lstm").eval()
    monkeypatch.setattr("zoo.lm.EVAL_BLOCK", 4)          # the tiny vocabulary in 4 blocks, fused however few
    monkeypatch.setattr("zoo.lm.EVAL_MIN_LOGITS", 0)     # ... however few logits a call has
    calls = []
    real = _fused_loss.linear_target_logprobs
    monkeypatch.setattr("zoo.lm.linear_target_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    stream = torch.randint(0, len(WORDS), (200,), generator=torch.Generator().manual_seed(0))
    fused = scoring.evaluate_stream(lm, stream, batch_size=2, bptt=9, progress=False)
    assert len(calls) == 11                              # one per chunk: 99 steps of 2 columns, bptt 9

    class LogitsOnly:
        def init_state(self, b):
            return lm.init_state(b)

        def forward(self, x, state):
            return lm(x, state)

    plain = scoring.evaluate_stream(LogitsOnly(), stream, batch_size=2, bptt=9, progress=False)
    assert len(calls) == 11 and fused["num_tokens"] == plain["num_tokens"]
    assert fused["ppl"] == pytest.approx(plain["ppl"], rel=1e-6)

    monkeypatch.setattr("zoo.lm.EVAL_MIN_LOGITS", 19 * len(WORDS))  # 18 rows a call: decoded whole
    scoring.evaluate_stream(lm, stream, batch_size=2, bptt=9, progress=False)
    assert len(calls) == 11
