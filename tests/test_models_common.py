"""Properties every registered architecture must have, checked through the shared protocol."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_ARCHS, tiny_lm
from zoo.registry import architecture_names, build_stack


def test_every_registered_architecture_has_a_tiny_variant():
    assert set(architecture_names()) == {arch for arch, _ in TINY_ARCHS.values()}


def test_state_protocol(variant):
    lm = tiny_lm(variant)
    state = lm.init_state(3)
    assert len(state) == len(lm.state_names()) == len(set(lm.state_names()))
    assert all(s.shape[0] == 3 and not s.any() for s in state)


def test_step_equals_sequence_forward(variant):
    lm = tiny_lm(variant).double().eval()
    tokens = torch.randint(0, lm.vocab_size, (3, 9))
    with torch.no_grad():
        seq_logits, seq_state = lm(tokens)
        state = lm.init_state(3)
        steps = []
        for t in range(tokens.shape[1]):
            logits, state = lm.step(tokens[:, t], state)
            steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, 1), seq_logits, rtol=0, atol=1e-10)
    for a, b in zip(state, seq_state, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_state_carry_equals_one_pass(variant):
    lm = tiny_lm(variant).double().eval()
    tokens = torch.randint(0, lm.vocab_size, (2, 10))
    with torch.no_grad():
        full, _ = lm(tokens)
        a, st = lm(tokens[:, :4])
        b, _ = lm(tokens[:, 4:], st)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=0, atol=1e-10)


def test_gradcheck_float64(variant):
    arch, args = TINY_ARCHS[variant]
    args = dict(args, hidden_size=3)
    if "adapt_size" in args:
        args["adapt_size"] = 2
    if "hyper_size" in args:
        args.update(hyper_size=2, hyper_embedding_size=2)
    torch.manual_seed(0)
    stack = build_stack(arch, input_size=3, output_size=2, **args).double().eval()
    x = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    state = tuple(torch.randn_like(s).requires_grad_() for s in stack.init_state(2, dtype=torch.float64))

    def fn(x, *state):
        out, new = stack(x, tuple(state))
        return (out,) + tuple(new)

    assert torch.autograd.gradcheck(fn, (x, *state), eps=1e-6, atol=1e-5)


def test_training_forward_is_stochastic_and_eval_is_not(variant):
    arch, args = TINY_ARCHS[variant]
    lm = tiny_lm(variant, dropouti=0.3, dropouto=0.3, dropoute=0.1)
    tokens = torch.randint(0, lm.vocab_size, (2, 6))
    lm.train()
    assert not torch.equal(lm(tokens)[0], lm(tokens)[0])
    lm.eval()
    assert torch.equal(lm(tokens)[0], lm(tokens)[0])


@pytest.mark.parametrize("variant_name", sorted(TINY_ARCHS))
def test_overfits_a_tiny_corpus(variant_name):
    """Every model memorises a short repeated sequence: evidence that gradients reach every part."""
    torch.manual_seed(0)
    lm = tiny_lm(variant_name, emb_size=16)
    seq = torch.tensor([[2, 3, 4, 5, 2, 6, 0, 7, 8, 9, 5, 2, 6, 0, 10, 11, 12, 0]])
    opt = torch.optim.Adam(lm.parameters(), lr=0.03)
    lm.train()
    for _ in range(300):
        logits, _ = lm(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, lm.vocab_size), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.15, f"{variant_name} did not overfit: loss {loss.item():.3f}"


def test_tied_weights_are_shared():
    lm = tiny_lm("lstm")
    assert lm.decoder.weight is lm.embedding.weight
    assert lm.num_parameters() == sum(p.numel() for p in lm.parameters())


def test_awd_lstm_ptb_parameter_count():
    """AWD-LSTM PTB: 3 layers 400-1150-1150-400, tied embedding 10k x 400 (reference spec 3.1)."""
    with torch.device("meta"):
        lm = torch.nn.Module()
        stack = build_stack("lstm", 400, 400, hidden_size=1150, num_layers=3)
    assert sum(p.numel() for p in stack.parameters()) + 10000 * 400 + 10000 == 24_221_600
    del lm


def test_lstm_baseline_equals_torch_lstm():
    stack = build_stack("lstm", 5, 7, hidden_size=7, num_layers=2).eval()
    ref = torch.nn.LSTM(5, 7, 2, batch_first=True)
    with torch.no_grad():
        for layer in range(2):
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(ref, f"{name}_l{layer}").copy_(getattr(stack, f"{name}_l{layer}"))
    x = torch.randn(3, 6, 5)
    torch.testing.assert_close(stack(x)[0], ref(x)[0])


def test_weight_drop_changes_only_training():
    stack = build_stack("lstm", 5, 7, hidden_size=7, num_layers=2, weight_drop=0.5)
    x = torch.randn(2, 4, 5)
    stack.train()
    assert not torch.equal(stack(x)[0], stack(x)[0])
    stack.eval()
    assert torch.equal(stack(x)[0], stack(x)[0])
