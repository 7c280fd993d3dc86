"""Tests for :mod:`zoo.models.adaptive_linear` (tiny sizes: CPU-only, well under a few seconds)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck
from torch.func import functional_call

from zoo.models.adaptive_linear import ADAPTATION_MODELS, POLICIES, AdaptiveLinear

IN, OUT, K = 5, 3, 4


def make(policy: str, **kw) -> AdaptiveLinear:
    torch.manual_seed(0)
    return AdaptiveLinear(IN, OUT, policy=policy, adapt_size=K, **kw)


def reference(layer: AdaptiveLinear, x: torch.Tensor) -> torch.Tensor:
    """The policy equations written out per example with explicit diagonal matrices (slow, for tests)."""
    d = layer.adaptation(x)
    eye = lambda v: torch.diag_embed(v)  # noqa: E731
    if layer.policy == "sva":
        w = layer.weight2 @ eye(d["sv"]) @ layer.weight1
    else:
        w = layer.weight.expand(*x.shape[:-1], OUT, IN)
        if "in" in d:
            w = w @ eye(d["in"])
        if "out" in d:
            w = eye(d["out"]) @ w
    y = (w @ x.unsqueeze(-1)).squeeze(-1)
    if layer.bias is not None:
        y = y + (d["bias"] * layer.bias if layer.adapt_bias else layer.bias)
    return y


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", [(7, IN), (2, 6, IN), (IN,)])
def test_shapes_like_linear_and_match_equations(policy: str, shape: tuple[int, ...]) -> None:
    layer = make(policy)
    lin = nn.Linear(IN, OUT)
    x = torch.randn(*shape)
    y = layer(x)
    assert y.shape == lin(x).shape == (*shape[:-1], OUT)
    d = layer.adaptation(x)
    sizes = {"in": IN, "out": OUT, "sv": layer.rank}
    expected_keys = {"input": {"in"}, "output": {"out"}, "io": {"in", "out"}, "sva": {"sv"}}[policy]
    assert set(d) == expected_keys
    for name, v in d.items():
        assert v.shape == (*shape[:-1], sizes[name])
        assert v.abs().max() < 1  # tanh policy
    torch.testing.assert_close(y, reference(layer, x))
    # per-example: each row depends only on its own input (the adaptation is per example)
    if len(shape) >= 2:
        torch.testing.assert_close(layer(x[..., :1, :]), y[..., :1, :])


@pytest.mark.parametrize("policy", POLICIES)
def test_adapt_bias_and_no_bias(policy: str) -> None:
    x = torch.randn(4, IN)
    layer = make(policy, adapt_bias=True)
    assert set(layer.adaptation(x)) >= {"bias"}
    torch.testing.assert_close(layer(x), reference(layer, x))
    nb = make(policy, bias=False)
    assert nb.bias is None
    torch.testing.assert_close(nb(x), reference(nb, x))
    with pytest.raises(ValueError):
        make(policy, bias=False, adapt_bias=True)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", [(7, IN), (2, 6, IN)])
def test_identity_adaptation_equals_linear(policy: str, shape: tuple[int, ...]) -> None:
    layer = make(policy)
    x = torch.randn(*shape)
    lin = nn.Linear(IN, OUT)
    with torch.no_grad():
        lin.weight.copy_(layer.effective_weight())
        lin.bias.copy_(layer.bias)
    adapted = layer(x)
    with layer.identity_adaptation():
        assert all(torch.equal(v, torch.ones_like(v)) for v in layer.adaptation(x).values())
        y = layer(x)
        assert "force_identity=True" in repr(layer)
    assert not layer.force_identity
    if policy == "sva":  # W2 (W1 x) vs (W2 W1) x: same map, different rounding
        torch.testing.assert_close(y, lin(x))
    else:
        assert torch.equal(y, lin(x))
    assert not torch.allclose(adapted, y)
    layer.force_identity = True
    assert torch.equal(layer(x), y)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("adaptation_model", ADAPTATION_MODELS)
@pytest.mark.parametrize("adapt_bias", [False, True])
def test_gradcheck_float64(policy: str, adaptation_model: str, adapt_bias: bool) -> None:
    layer = make(policy, adaptation_model=adaptation_model, adapt_bias=adapt_bias).double()
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters())
    x = torch.randn(2, 3, IN, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return functional_call(layer, dict(zip(names, ps, strict=True)), (x,))

    assert gradcheck(f, (x, *params), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("adaptation_model", ADAPTATION_MODELS)
@pytest.mark.parametrize("bias", [True, False])
def test_parameter_count_formula(policy: str, adaptation_model: str, bias: bool) -> None:
    for n, m, k, rank, adapt_bias in [(5, 3, 4, None, False), (7, 11, 2, 2, bias), (1, 1, 1, None, bias)]:
        kw = {"rank": rank} if policy == "sva" else {}
        layer = AdaptiveLinear(n, m, bias=bias, policy=policy, adapt_size=k,
                               adaptation_model=adaptation_model, adapt_bias=adapt_bias, **kw)
        r = (rank or min(n, m)) if policy == "sva" else None
        c, a = int(bias), int(adapt_bias)
        main = r * n + m * r + c * m if policy == "sva" else m * n + c * m
        latent = (2 if adaptation_model == "glu" else 1) * (k * n + k)
        p = {"input": n, "output": m, "io": n + m, "sva": r}[policy]
        expected = main + latent + k * (p + a * m)
        actual = sum(t.numel() for t in layer.parameters())
        assert actual == expected == layer.num_parameters_formula()


def test_extra_repr_and_validation() -> None:
    s = repr(AdaptiveLinear(4, 2, policy="sva", adapt_size=3, rank=2, adapt_bias=True))
    for part in ("in_features=4", "out_features=2", "bias=True", "policy='sva'", "adapt_size=3",
                 "adaptation_model='relu'", "rank=2", "adapt_bias=True"):
        assert part in s
    for bad in ({"policy": "diag"}, {"adaptation_model": "lstm"}, {"policy": "io", "rank": 2}):
        with pytest.raises(ValueError):
            AdaptiveLinear(4, 2, **bad)
    with pytest.raises(ValueError):
        AdaptiveLinear(4, 2)(torch.randn(3, 5))


def test_sva_factors_start_semi_orthogonal() -> None:
    layer = AdaptiveLinear(6, 4, policy="sva", rank=3)
    eye = torch.eye(3)
    torch.testing.assert_close(layer.weight1 @ layer.weight1.T, eye)
    torch.testing.assert_close(layer.weight2.T @ layer.weight2, eye)


def _fit(model: nn.Module, steps: int = 200) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(256, 2, generator=g) * 4 - 2
    y = x[:, :1] * x[:, 1:]  # continuous XOR: sign(y) = sign(x1) xor sign(x2); no linear signal
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    first = None
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return first, ((model(x) - y) ** 2).mean().item()


@pytest.mark.parametrize("policy", POLICIES)
def test_single_layer_fits_xor_product(policy: str) -> None:
    torch.manual_seed(0)
    first, last = _fit(AdaptiveLinear(2, 1, policy=policy, adapt_size=16))
    assert last < first / 5, (first, last)


def test_static_linear_cannot_fit_xor_product() -> None:
    torch.manual_seed(0)
    first, last = _fit(nn.Linear(2, 1))
    assert last > first / 2
