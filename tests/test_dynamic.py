"""Dynamic evaluation (``zoo.dynamic``): each segment scored before the step that uses it, the trained weights
restored afterwards (the same text scores the same twice), lr = 0 equals static scoring, adaptation helps on a
text that repeats, and the API / CLI switches with their errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, WORDS, tiny_lm
from zoo.dynamic import DynamicParams, dynamic_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")


def _seq(n: int = 60, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, len(WORDS), (n,), generator=torch.Generator().manual_seed(seed))


def test_lr_zero_equals_static_scoring_and_weights_are_restored():
    lm = tiny_lm("alstm", init_range=1.0).eval()
    seq = _seq()
    before = [p.detach().clone() for p in lm.parameters()]
    static = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=7, lr=0.0))
    with torch.no_grad():
        logits, _ = lm(seq[:-1][None])
    ref = torch.log_softmax(logits[0], -1).gather(1, seq[1:, None]).squeeze(1).double()
    torch.testing.assert_close(static, ref, rtol=1e-5, atol=1e-6)
    adapted = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=7, lr=0.5, decay=0.01))
    again = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=7, lr=0.5, decay=0.01))
    assert torch.equal(adapted, again), "scoring the same text twice gives the same numbers"
    assert all(torch.equal(a, b) for a, b in zip(before, lm.parameters(), strict=True))
    # the first segment is scored before any step: identical to static there, different after
    torch.testing.assert_close(adapted[:7], static[:7], rtol=0, atol=0)
    assert not torch.allclose(adapted[7:], static[7:])


def test_adaptation_helps_on_a_text_that_repeats():
    lm = tiny_lm("lstm", init_range=1.0).eval()
    part = _seq(40, seed=3)
    seq = torch.cat([part, part, part])
    static = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=5, lr=0.0))
    dyn = dynamic_logprobs(lm, seq[:-1], seq[1:], DynamicParams(segment=5, lr=0.3))
    assert dyn[80:].sum() > static[80:].sum() + 1.0, "the third repetition should score better once adapted"


@pytest.mark.parametrize("bad", [dict(segment=0), dict(lr=-1.0), dict(decay=2.0), dict(lr=float("nan"))])
def test_bad_parameters_are_clear_errors(bad):
    with pytest.raises(ValueError):
        DynamicParams(**bad)


def test_api_and_cli(tiny_checkpoint):
    import zoo

    model = zoo.load(str(tiny_checkpoint))
    text = "the cat sat on the mat\nthe cat sat on the mat"
    a = model.score(text, dynamic=True)[0]
    b = model.score(text, dynamic=DynamicParams(lr=0.0))[0]
    assert a["num_tokens"] == b["num_tokens"] == model.score(text)[0]["num_tokens"]
    assert b["nll"] == pytest.approx(model.score(text)[0]["nll"], rel=1e-5)
    with pytest.raises(ValueError, match="eager backend in fp32"):
        zoo.load(str(tiny_checkpoint), precision="bf16").score(text, dynamic=True)
    cli = [sys.executable, "-m", "zoo.cli", "score", str(tiny_checkpoint), "--text", text, "--json", "--dynamic"]
    ok = subprocess.run(cli, capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([*cli, "--dynamic-lr", "-1"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("zoo: error: --dynamic: lr")
