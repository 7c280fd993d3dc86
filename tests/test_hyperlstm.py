"""HyperLSTM: paper parameter counts, supercell init, step/sequence agreement, gradients, LSTM limit."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from zoo.models.hyperlstm import GATES, SCALE_BLOCKS, HyperLSTMStack

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(dtype: torch.dtype = torch.float32, **kw) -> HyperLSTMStack:
    torch.manual_seed(0)
    args = dict(input_size=3, output_size=5, hidden_size=4, num_layers=2, hyper_size=3, hyper_embedding_size=2)
    args.update(kw)
    return HyperLSTMStack(**args).to(dtype)


def randomise_(model: nn.Module, scale: float = 0.5) -> None:
    """Move every parameter off its (partly constant) init so every path carries gradient."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- parameter counts (Ha et al. 2017, table 2) ------------------------------------------------------

@pytest.mark.parametrize("use_layer_norm, stack_count", [(False, 4_861_824), (True, 4_873_104)])
def test_char_ptb_parameter_count(use_layer_norm: bool, stack_count: int) -> None:
    # char-PTB: one-hot input V = 50 (no embedding), 1 layer of 1000, N_h^ = 128, N_z = 4.
    model = HyperLSTMStack(50, 1000, hidden_size=1000, num_layers=1, hyper_size=128,
                           hyper_embedding_size=4, use_layer_norm=use_layer_norm)
    assert n_params(model) == stack_count
    # Plus an untied 1000 -> 50 softmax with bias (50,050) this is the paper's 4.91M / 4.92M row:
    # 4,911,874 without LN and 4,923,154 with LN.
    decoder = 1000 * 50 + 50
    assert n_params(model) + decoder == (4_923_154 if use_layer_norm else 4_911_874)


# -- initialisation (supercell table, 2.2) -----------------------------------------------------------

def test_init_values() -> None:
    torch.manual_seed(0)
    model = HyperLSTMStack(6, 8, hidden_size=7, num_layers=2, hyper_size=5, hyper_embedding_size=4,
                           use_layer_norm=True)
    # Arbitrary hyper states: at init d must not depend on h^ (W_zw = 0, b_zw = 1, W_alpha = 0.1/N_z).
    state = tuple(torch.randn_like(s) for s in model.init_state(3))
    signals = model.adaptation_signals(state)
    assert len(signals) == 2 * (8 + 4)
    for layer, n_h in enumerate(model.sizes):
        for name in SCALE_BLOCKS:
            d = signals[f"layer{layer}.d_{name}"]
            assert d.shape == (3, n_h)
            torch.testing.assert_close(d, torch.full_like(d, 0.1), rtol=0, atol=1e-7)
        for gate in GATES:
            assert torch.equal(signals[f"layer{layer}.beta_{gate}"], torch.zeros(3, n_h))
    for cell in model.layers:
        for c in (cell, cell.hyper):
            n_h, n_in = c.hidden_size, c.input_size
            for block in c.weight_hh.detach().view(4, n_h, n_h):  # orthogonal per gate block
                torch.testing.assert_close(block @ block.T, torch.eye(n_h))
            assert c.weight_xh.abs().max() <= math.sqrt(6.0 / (n_in + 4 * n_h))  # Glorot uniform
            assert torch.all(c.bias == 0)
            assert torch.all(c.ln_gamma == 1) and torch.all(c.ln_beta == 0)
            assert torch.all(c.ln_c_gamma == 1) and torch.all(c.ln_c_beta == 0)
        assert torch.all(cell.hyper_zw_weight == 0) and torch.all(cell.hyper_zw_bias == 1)
        assert torch.all(cell.hyper_beta == 0)
    big = HyperLSTMStack(4, 64, hidden_size=64, hyper_size=64, hyper_embedding_size=16).layers[0]
    assert abs(big.hyper_zb_weight.std().item() - 0.01) < 0.001  # W_zb ~ N(0, 0.01)


# -- step / sequence agreement ------------------------------------------------------------------------

@pytest.mark.parametrize("use_layer_norm", [False, True])
def test_step_matches_sequence(use_layer_norm: bool) -> None:
    model = tiny(use_layer_norm=use_layer_norm, recurrent_dropout=0.3, dropout_hidden=0.3).eval()
    randomise_(model)
    x = torch.randn(2, 6, 3)
    out, state = model(x)
    assert out.shape == (2, 6, 5) and len(state) == 8 == len(model.state_names())
    s = model.init_state(2)
    for t in range(6):
        o, s = model.step(x[:, t], s)
        torch.testing.assert_close(o, out[:, t])
    for a, b in zip(s, state, strict=True):
        torch.testing.assert_close(a, b)
    # Carrying the state across two forward calls gives the same result as one call.
    out1, s1 = model(x[:, :3])
    out2, _ = model(x[:, 3:], s1)
    torch.testing.assert_close(torch.cat([out1, out2], 1), out)


def test_dropout_only_in_training() -> None:
    model = tiny(recurrent_dropout=0.5, hyper_recurrent_dropout=0.5, dropout_hidden=0.5)
    x = torch.randn(2, 4, 3)
    model.eval()
    assert torch.equal(model(x)[0], model(x)[0])
    model.train()
    assert not torch.equal(model(x)[0], model(x)[0])
    # Recurrent (candidate) dropout alone also switches the per-step masks on.
    only_rec = tiny(recurrent_dropout=0.5).train()
    assert only_rec.draw_masks(2, x.device, x.dtype) is not None
    assert not torch.equal(only_rec(x)[0], only_rec(x)[0])


# -- gradients ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_layer_norm", [False, True])
def test_gradcheck(use_layer_norm: bool) -> None:
    model = tiny(torch.float64, num_layers=2, use_layer_norm=use_layer_norm).eval()
    randomise_(model)
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in model.parameters())
    x = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        out, state = functional_call(model, dict(zip(names, ps, strict=True)), (x,))
        return torch.cat([out.flatten(), state[-3].flatten(), state[-1].flatten()])

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5)


# -- the LSTM limit: d = 1, beta = 0 ---------------------------------------------------------------------

def neutralise_hypernetwork_(model: HyperLSTMStack) -> None:
    with torch.no_grad():
        for cell in model.layers:
            n_z = cell.hyper_embedding_size
            cell.hyper_zw_weight.zero_()
            cell.hyper_zw_bias.fill_(1.0)
            cell.hyper_alpha.fill_(1.0 / n_z)
            cell.hyper_beta.zero_()


def test_equals_plain_lstm_when_hypernetwork_is_neutral() -> None:
    model = tiny(torch.float64, forget_bias=0.7).eval()
    randomise_(model)
    neutralise_hypernetwork_(model)
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    out, _ = model(x)

    # Reference: torch.nn.LSTMCell per layer. Its gate order is (i, f, g, o), ours is (i, j, f, o),
    # and the run-time forget bias goes into its bias.
    inp = x
    for cell in model.layers:
        n_h = cell.hidden_size
        ref = nn.LSTMCell(cell.input_size, n_h).double()
        order = [0, 2, 1, 3]
        with torch.no_grad():
            ref.weight_ih.copy_(cell.weight_xh.view(4, n_h, -1)[order].reshape(4 * n_h, -1))
            ref.weight_hh.copy_(cell.weight_hh.view(4, n_h, n_h)[order].reshape(4 * n_h, n_h))
            b = cell.bias.view(4, n_h)[order].clone()
            b[1] += 0.7
            ref.bias_ih.copy_(b.flatten())
            ref.bias_hh.zero_()
        h = c = torch.zeros(2, n_h, dtype=torch.float64)
        outs = []
        for t in range(x.shape[1]):
            h, c = ref(inp[:, t], (h, c))
            outs.append(h)
        inp = torch.stack(outs, 1)
    torch.testing.assert_close(out, inp, rtol=1e-12, atol=1e-12)


def test_equals_layer_norm_lstm_when_hypernetwork_is_neutral() -> None:
    model = tiny(torch.float64, num_layers=1, use_layer_norm=True).eval()
    randomise_(model)
    neutralise_hypernetwork_(model)
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    out, _ = model(x)

    # Reference LN-LSTM written out (supercell): LN per gate after the bias, LN on c before tanh.
    cell = model.layers[0]
    n_h = cell.hidden_size

    def ln(v: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        mu = v.mean(-1, keepdim=True)
        var = ((v - mu) ** 2).mean(-1, keepdim=True)
        return (v - mu) / torch.sqrt(var + 1e-3) * g + b

    h = c = torch.zeros(2, n_h, dtype=torch.float64)
    gam, bet = cell.ln_gamma.view(4, n_h), cell.ln_beta.view(4, n_h)
    for t in range(x.shape[1]):
        pre = x[:, t] @ cell.weight_xh.T + h @ cell.weight_hh.T + cell.bias
        i, j, f, o = (ln(v, gam[k], bet[k]) for k, v in enumerate(pre.split(n_h, -1)))
        c = torch.sigmoid(f + 1.0) * c + torch.sigmoid(i) * torch.tanh(j)
        h = torch.sigmoid(o) * torch.tanh(ln(c, cell.ln_c_gamma, cell.ln_c_beta))
        torch.testing.assert_close(out[:, t], h, rtol=1e-12, atol=1e-12)


def test_adaptation_signals_follow_hyper_state() -> None:
    model = tiny().eval()
    randomise_(model)
    _, state = model(torch.randn(2, 3, 3))
    signals = model.adaptation_signals(state)
    cell = model.layers[1]
    h_hat = state[4 + 2]
    z = h_hat @ cell.hyper_zw_weight[SCALE_BLOCKS.index("fh")].T + cell.hyper_zw_bias[SCALE_BLOCKS.index("fh")]
    torch.testing.assert_close(signals["layer1.d_fh"], z @ cell.hyper_alpha[SCALE_BLOCKS.index("fh")].T)
    zb = h_hat @ cell.hyper_zb_weight[GATES.index("o")].T
    torch.testing.assert_close(signals["layer1.beta_o"], zb @ cell.hyper_beta[GATES.index("o")].T)
    assert signals["layer1.d_fh"].shape == (2, 5) and signals["layer0.d_ix"].shape == (2, 4)

