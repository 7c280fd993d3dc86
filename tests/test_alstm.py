"""Tests of the adaptive LSTM stack (zoo.models.alstm).

All tests use tiny sizes, except the parameter counts, which build the full-size models on the
``meta`` device (shapes only, no memory, no init cost) and never run them.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.func import functional_call

from zoo.models.alstm import ALSTMStack

B, T, IN, HID, OUT, ADAPT = 2, 5, 3, 4, 3, 2

VARIANTS = [
    dict(adaptation_model=m, policy=p, layer0_wraparound=w, adaptive_bias=b)
    for m, p, w, b in itertools.product(("lstm_rhn", "lstm", "feedforward"), ("io", "output"),
                                        (True, False), (True, False))
]


def ids(v: dict) -> str:
    wrap, bias = int(v["layer0_wraparound"]), int(v["adaptive_bias"])
    return f"{v['adaptation_model']}-{v['policy']}-wrap{wrap}-bias{bias}"


def tiny(num_layers: int = 2, dtype: torch.dtype = torch.float64, seed: int = 0, **kw) -> ALSTMStack:
    torch.manual_seed(seed)
    kw.setdefault("dropout_hidden", 0.0)
    kw.setdefault("dropout_adapt", 0.0)
    model = ALSTMStack(IN, OUT, hidden_size=HID, num_layers=num_layers, adapt_size=ADAPT, **kw)
    return model.to(dtype)


def random_state(model: ALSTMStack, batch: int = B) -> tuple[torch.Tensor, ...]:
    """A non-zero state, so that every state entry matters."""
    return tuple(0.5 * torch.randn_like(s) for s in model.init_state(batch))


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- parameter counts (reference-models.md 1.8) --------------------------------------------------------
@pytest.mark.parametrize("hidden, vocab, rnn_total, total", [
    (1150, 10_000, 13_187_800, 17_197_800),   # PTB 17M
    (1500, 33_278, 18_789_200, 32_133_678),   # WT2 README command, 32M
    (1150, 33_278, 13_187_800, 26_532_278),   # WT2 27M
])
def test_parameter_counts(hidden: int, vocab: int, rnn_total: int, total: int) -> None:
    with torch.device("meta"):
        model = ALSTMStack(400, 400, hidden_size=hidden, num_layers=2, adapt_size=100,
                           adaptation_model="lstm_rhn", policy="io", adaptive_bias=True)
    assert n_params(model) == rnn_total
    # The LM wrapper adds a tied embedding (vocab x 400, shared with the decoder) + decoder bias (vocab).
    assert n_params(model) + vocab * 400 + vocab == total


def test_parameter_count_per_layer_ptb() -> None:
    with torch.device("meta"):
        model = ALSTMStack(400, 400)
    expected = [(700_800, 1_535_000, 7_134_600), (700_800, 635_000, 2_481_600)]
    for layer, (adapt, proj, cell) in zip(model.layers, expected, strict=True):
        assert n_params(layer.adapt) == adapt
        assert n_params(layer.project) == proj
        assert layer.weight_ih.numel() + layer.weight_hh.numel() + layer.bias.numel() == cell


def test_sizes_and_variant_shapes() -> None:
    m = tiny(num_layers=3)
    assert m.layer_sizes() == [(IN, HID), (HID, HID), (HID, OUT)]
    assert tiny(num_layers=1).layer_sizes() == [(IN, OUT)]
    # wrap-around: layer 0's adaptation LSTM reads [x; h; z_top]; off: [x; h].
    assert tiny(layer0_wraparound=True).layers[0].adapt.input_size == IN + HID + ADAPT
    assert tiny(layer0_wraparound=False).layers[0].adapt.input_size == IN + HID
    assert tiny(adaptation_model="lstm").layers[1].adapt.input_size == HID + OUT
    assert tiny(adaptation_model="lstm_rhn").layers[1].adapt.input_size == HID + OUT + ADAPT
    # a single layer has no z from below (reference), so lstm_rhn == lstm in shape
    assert tiny(num_layers=1).layers[0].adapt.input_size == IN + OUT
    # projection size P
    assert tiny(policy="io").layers[0].project.out_features == IN + HID + 12 * HID
    assert tiny(policy="io", adaptive_bias=False).layers[0].project.out_features == IN + HID + 8 * HID
    assert tiny(policy="output").layers[0].project.out_features == 12 * HID
    with pytest.raises(ValueError):
        ALSTMStack(IN, OUT, adaptation_model="hyper")
    with pytest.raises(ValueError):
        ALSTMStack(IN, OUT, policy="input")


def test_init() -> None:
    layer = tiny(dtype=torch.float32).layers[0]
    for w in (layer.weight_ih, layer.weight_hh):   # orthogonal columns on the whole [4n_h, n] matrix
        torch.testing.assert_close(w.t() @ w, torch.eye(w.shape[1]), atol=1e-5, rtol=0)
    expected = torch.zeros(4 * HID)
    expected[HID:2 * HID] = 1.0
    assert torch.equal(layer.bias.detach(), expected)
    assert layer.project.bias is None


# -- state -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_kind, per_layer", [("lstm_rhn", 4), ("lstm", 4), ("feedforward", 2)])
def test_state_layout(model_kind: str, per_layer: int) -> None:
    m = tiny(num_layers=3, adaptation_model=model_kind)
    state = m.init_state(B)
    names = m.state_names()
    assert len(names) == len(state) == 3 * per_layer
    assert names[:per_layer] == ["h0", "c0", "z0", "zc0"][:per_layer]
    assert all(s.shape[0] == B and s.dtype == torch.float64 for s in state)
    assert state[0].shape == (B, HID) and state[-per_layer].shape == (B, OUT)
    if per_layer == 4:
        assert state[2].shape == (B, ADAPT)


# -- step-by-step == sequence forward -------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS, ids=ids)
def test_step_equals_forward(variant: dict) -> None:
    m = tiny(**variant).eval()
    x = torch.randn(B, T, IN, dtype=torch.float64)
    s0 = random_state(m)
    out, s_seq = m(x, s0)
    assert out.shape == (B, T, OUT)
    s = s0
    for t in range(T):
        y, s = m.step(x[:, t], s)
        torch.testing.assert_close(y, out[:, t], atol=1e-10, rtol=0)
    for a, b in zip(s, s_seq, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    # carrying the state across two segments equals one long segment
    out1, s1 = m(x[:, :2], s0)
    out2, s2 = m(x[:, 2:], s1)
    torch.testing.assert_close(torch.cat((out1, out2), 1), out, atol=1e-10, rtol=0)


def test_wraparound_reads_top_z_of_previous_step() -> None:
    """Layer 0's output at step 0 depends on the top layer's initial z only with the wrap-around."""
    x = torch.randn(B, 1, IN, dtype=torch.float64)
    for wrap in (True, False):
        m = tiny(layer0_wraparound=wrap).eval()
        s0 = random_state(m)
        s1 = list(s0)
        s1[6] = s1[6] + 1.0                      # z1: top layer's adaptation hidden
        _, a = m(x, s0)
        _, b = m(x, tuple(s1))
        changed = not torch.allclose(a[0], b[0])  # h0 after one step
        assert changed == wrap


def test_one_layer_runs() -> None:
    for kind in ("lstm_rhn", "lstm", "feedforward"):
        m = tiny(num_layers=1, adaptation_model=kind).eval()
        out, state = m(torch.randn(B, T, IN, dtype=torch.float64))
        assert out.shape == (B, T, OUT) and len(state) == len(m.state_names())


# -- identity adaptation == plain LSTM ------------------------------------------------------------------
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v["layer0_wraparound"]], ids=ids)
def test_identity_adaptation_is_lstm(variant: dict) -> None:
    m = tiny(num_layers=3, **variant).eval()
    x = torch.randn(B, T, IN, dtype=torch.float64)
    s0 = random_state(m)
    with m.identity_adaptation():
        out, state = m(x, s0)
        assert all(torch.equal(v, torch.ones_like(v)) for v in m.adaptation_signals(state).values())
    assert not any(layer.identity for layer in m.layers)

    n = len(s0) // 3
    cells = []
    for layer in m.layers:
        cell = torch.nn.LSTMCell(layer.input_size, layer.hidden_size).double()
        with torch.no_grad():   # the aLSTM has ONE bias: put it in bias_ih, zero bias_hh
            cell.weight_ih.copy_(layer.weight_ih)
            cell.weight_hh.copy_(layer.weight_hh)
            cell.bias_ih.copy_(layer.bias)
            cell.bias_hh.zero_()
        cells.append(cell)
    hc = [(s0[l * n], s0[l * n + 1]) for l in range(3)]
    ref = []
    for t in range(T):
        inp = x[:, t]
        for l, cell in enumerate(cells):
            hc[l] = cell(inp, hc[l])
            inp = hc[l][0]
        ref.append(inp)
    torch.testing.assert_close(out, torch.stack(ref, 1), atol=1e-12, rtol=0)
    for l in range(3):
        torch.testing.assert_close(state[l * n], hc[l][0], atol=1e-12, rtol=0)
        torch.testing.assert_close(state[l * n + 1], hc[l][1], atol=1e-12, rtol=0)

    # and against torch's fused multi-step kernel for a single layer
    m1 = tiny(num_layers=1, **variant).eval()
    lstm = torch.nn.LSTM(IN, OUT, batch_first=True).double()
    layer = m1.layers[0]
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(layer.weight_ih)
        lstm.weight_hh_l0.copy_(layer.weight_hh)
        lstm.bias_ih_l0.copy_(layer.bias)
        lstm.bias_hh_l0.zero_()
    m1.set_identity_adaptation(True)
    out1, _ = m1(x)
    ref1, _ = lstm(x)
    torch.testing.assert_close(out1, ref1, atol=1e-12, rtol=0)


def test_adaptation_actually_adapts() -> None:
    """Without the identity switch the outputs differ from the identity ones."""
    m = tiny().eval()
    x = torch.randn(B, T, IN, dtype=torch.float64)
    out, state = m(x)
    with m.identity_adaptation():
        out_id, _ = m(x)
    assert not torch.allclose(out, out_id)


def test_adaptation_signals() -> None:
    m = tiny().eval()
    _, state = m(torch.randn(B, T, IN, dtype=torch.float64))
    sig = m.adaptation_signals(state)
    assert sig["layer0.pi_x"].shape == (B, IN)
    assert sig["layer0.pi_h"].shape == (B, HID)
    assert sig["layer1.pi_x"].shape == (B, HID)
    for key in ("pi_ih", "pi_hh", "pi_b"):
        assert sig[f"layer1.{key}"].shape == (B, 4 * OUT)
    assert all(v.abs().max() < 1 for v in sig.values())     # tanh range
    assert set(tiny(policy="output", adaptive_bias=False).adaptation_signals(state)) == {
        "layer0.pi_ih", "layer0.pi_hh", "layer1.pi_ih", "layer1.pi_hh"}
    assert tiny(adaptation_model="feedforward").adaptation_signals(state) == {}


# -- gradients -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [
    dict(adaptation_model="lstm_rhn", policy="io"),
    dict(adaptation_model="lstm", policy="output", adaptive_bias=False),
    dict(adaptation_model="feedforward", policy="io"),
], ids=lambda v: f"{v['adaptation_model']}-{v['policy']}")
def test_gradcheck(variant: dict) -> None:
    """float64 gradcheck of the training-mode forward (dropout on, masks re-drawn from a fixed seed)
    w.r.t. the input, the initial state and every parameter."""
    m = tiny(dropout_hidden=0.3, dropout_adapt=0.3, **variant).train()
    x = torch.randn(B, 3, IN, dtype=torch.float64, requires_grad=True)
    state = tuple(s.requires_grad_() for s in random_state(m))
    names = [k for k, _ in m.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in m.named_parameters())

    def run(x: torch.Tensor, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s, p = flat[:len(state)], flat[len(state):]
        torch.manual_seed(1)   # the same dropout masks at every evaluation
        out, s = functional_call(m, dict(zip(names, p, strict=True)), (x, s), strict=True)
        return (out, *s)

    assert torch.autograd.gradcheck(run, (x, *state, *params))


# -- dropout -----------------------------------------------------------------------------------------------
def test_training_dropout_masks_shared_across_time() -> None:
    m = tiny(dropout_hidden=0.5, dropout_adapt=0.5).train()
    x = torch.randn(B, T, IN, dtype=torch.float64)
    s0 = random_state(m)
    torch.manual_seed(7)
    out_a, s_a = m(x, s0)
    torch.manual_seed(7)
    out_b, s_b = m(x, s0)
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)   # deterministic under a fixed seed
    torch.manual_seed(8)
    out_c, _ = m(x, s0)
    assert not torch.allclose(out_a, out_c)                    # and dropout is really on

    # forward == a step loop that reuses ONE set of masks drawn once for the whole call
    torch.manual_seed(7)
    masks = m.draw_masks(B, x.device, x.dtype)
    assert masks is not None and len(masks) == 2
    (mh0, mz0), (mh1, mz1) = masks
    assert mh0.shape == (B, HID) and mh1.shape == (B, OUT) and mz0.shape == mz1.shape == (B, ADAPT)
    s = s0
    for t in range(T):
        y, s = m.step_with_masks(x[:, t], s, masks)
        torch.testing.assert_close(y, out_a[:, t], atol=1e-12, rtol=0)
    # the stack output is the UNDROPPED last h; the state holds the DROPPED h and z
    torch.testing.assert_close(s_a[4], out_a[:, -1] * mh1, atol=1e-12, rtol=0)
    assert torch.equal(s_a[2] == 0, mz0 == 0) and torch.equal(s_a[6] == 0, mz1 == 0)


def test_eval_has_no_randomness() -> None:
    m = tiny(dropout_hidden=0.5, dropout_adapt=0.5).eval()
    x = torch.randn(B, T, IN, dtype=torch.float64)
    torch.manual_seed(1)
    out_a, _ = m(x)
    torch.manual_seed(2)
    out_b, _ = m(x)
    assert torch.equal(out_a, out_b)
    # eval == training with dropout rates 0
    m0 = tiny().train()
    assert m0.draw_masks(B, x.device, x.dtype) is None
    torch.testing.assert_close(m0(x)[0], out_a, atol=0, rtol=0)


def test_float32_step_matches_forward() -> None:
    m = tiny(dtype=torch.float32).eval()
    x = torch.randn(B, T, IN)
    out, _ = m(x)
    s = m.init_state(B)
    for t in range(T):
        y, s = m.step(x[:, t], s)
        torch.testing.assert_close(y, out[:, t], atol=1e-6, rtol=0)


def reference_chunk_rows(sizes: tuple[int, ...]) -> set[int]:
    """The rows of W_pi the reference code's ``utils.chunk`` reads: slice k starts at the size of slice k-1 (not at
    the running offset, as consecutive slices would)."""
    rows: set[int] = set()
    for k, size in enumerate(sizes):
        start = sizes[k - 1] if k else 0
        rows.update(range(start, start + size))
    return rows


def test_reference_code_slicing_leaves_930k_parameters_unread():
    """The number zoo/models/alstm.py's docstring states, from the paper model's own slice sizes."""
    from zoo.registry import build_stack

    stack = build_stack("alstm", 400, 400, hidden_size=1150, num_layers=2, adapt_size=100, adaptation_model="lstm_rhn",
                        policy="io", layer0_wraparound=True)
    unread = 0
    for layer in stack.layers:
        total, n_z = layer.project.weight.shape
        assert total == sum(layer.pi_sizes) and layer.project.bias is None
        unread += (total - len(reference_chunk_rows(layer.pi_sizes))) * n_z
        # the zoo's own slices are consecutive and cover every row exactly once
        assert [t.shape[1] for t in layer.policy(torch.zeros(1, n_z))] == list(layer.pi_sizes)
    assert unread == 930_000
