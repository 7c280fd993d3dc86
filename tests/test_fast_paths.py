"""The fast sequence paths (aLSTM, HyperLSTM, p-norm GRU) equal the plain reference loop.

For every architecture variant of ``TINY_ARCHS`` (plus the aLSTM with the layer-0 wrap-around on and
off, 3 layers, and every dropout switched on), in training mode (the same dropout draws: the RNG is
seeded identically before each path) and in eval mode: outputs, final state and the gradients w.r.t.
the input, the initial state and every parameter agree to 1e-5 in float32. Also: the reference
switch (``use_reference`` / ``reference_cells`` / ``ZOO_REFERENCE_CELLS=1``) really selects the loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, TINY_ARCHS
from zoo.models.base import RecurrentStack, reference_cells, reference_enabled, use_reference
from zoo.registry import build_stack

TOL = 1e-5
IN, OUT, B, T = 8, 12, 3, 6
#: The fast paths are device-agnostic torch code; on a machine with CUDA they are checked there too
#: (training runs on the GPU when one is lent), skipped elsewhere.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]

#: Dropout rates switched on for the training-mode comparison, per architecture.
DROPOUT = {
    "alstm": {"dropout_hidden": 0.3, "dropout_adapt": 0.2},
    "hyperlstm": {"dropout_hidden": 0.3, "recurrent_dropout": 0.2, "hyper_recurrent_dropout": 0.1},
    "pnorm_gru": {"dropout_hidden": 0.3},
    "lstm": {},
}

VARIANTS: dict[str, tuple[str, dict]] = {name: spec for name, spec in TINY_ARCHS.items() if spec[0] != "lstm"}
_alstm = TINY_ARCHS["alstm"][1]
VARIANTS.update({
    "alstm-wrap-3layers": ("alstm", dict(_alstm, num_layers=3, layer0_wraparound=True)),
    "alstm-nowrap": ("alstm", dict(_alstm, layer0_wraparound=False)),
    "alstm-nowrap-lstm-output-nobias": ("alstm", dict(_alstm, layer0_wraparound=False, adaptation_model="lstm",
                                                      policy="output", adaptive_bias=False)),
    "alstm-1layer": ("alstm", dict(_alstm, num_layers=1)),
    "pnorm_gru-p3-1layer": ("pnorm_gru", dict(TINY_ARCHS["pnorm_gru"][1], p=3.0, num_layers=1)),
})


pytestmark = pytest.mark.usefixtures("one_thread")


def forward_path(out: torch.Tensor) -> str:
    """Which path produced ``out``: the fast paths are one autograd node (``*SequenceBackward``)."""
    return "fast" if type(out.grad_fn).__name__.endswith("SequenceBackward") else "reference"


def make(variant: str, train: bool, device: str = "cpu") -> RecurrentStack:
    arch, args = VARIANTS[variant]
    args = dict(args, **(DROPOUT[arch] if train else {}))
    torch.manual_seed(0)
    stack = build_stack(arch, input_size=IN, output_size=OUT, **args).to(device)
    with torch.no_grad():   # move away from the structured init (zeros, ones) so every path matters
        for p in stack.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return stack.train(train)


def run(stack: RecurrentStack, x: torch.Tensor, state: tuple, reference: bool) -> tuple[list, list]:
    """Forward + backward of a random linear function of the output and final state.

    The cotangents are ``N(0, 0.5^2)``: float32 gradients of magnitude ~10 (layer norm) already differ
    by ~1e-5 between two correct summation orders, which is the reference's own rounding error too."""
    x = x.clone().requires_grad_()
    state = tuple(s.clone().requires_grad_() for s in state)
    stack.zero_grad(set_to_none=True)
    torch.manual_seed(123)      # identical dropout draws in both paths
    with reference_cells(reference):
        out, new = stack(x, state)
        path = forward_path(out)
    gen = torch.Generator().manual_seed(7)
    loss = (out * torch.randn(out.shape, generator=gen).to(out.device)).sum()
    for s in new:
        loss = loss + (s * torch.randn(s.shape, generator=gen).to(s.device)).sum()
    loss = 0.5 * loss
    loss.backward()
    values = [out.detach(), *(s.detach() for s in new)]
    grads = [x.grad, *(s.grad for s in state)] + [p.grad for p in stack.parameters()]
    return values + grads, [path]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fast_equals_reference(variant: str, train: bool, device: str) -> None:
    stack = make(variant, train, device)
    torch.manual_seed(1)
    x = torch.randn(B, T, IN).to(device)
    state = tuple(0.5 * torch.randn(s.shape).to(device) for s in stack.init_state(B))
    fast, (fast_path,) = run(stack, x, state, reference=False)
    ref, (ref_path,) = run(stack, x, state, reference=True)
    assert fast_path == "fast" and ref_path == "reference"
    names = ["out"] + [f"state:{n}" for n in stack.state_names()] + ["d x"] + [
        f"d state:{n}" for n in stack.state_names()] + [f"d {n}" for n, _ in stack.named_parameters()]
    assert len(fast) == len(ref) == len(names)
    for name, a, b in zip(names, fast, ref, strict=True):
        assert a is not None and b is not None, name
        diff = (a - b).abs().max().item()
        # CUDA reduces in another order than the CPU: its float32 rounding grows with the values'
        # magnitude (measured on an H100: 1.9e-5 on layer-norm gradients of size ~10), so there the
        # bound is relative to the reference's largest entry; on the CPU it is the plain 1e-5.
        tol = TOL * max(1.0, b.abs().max().item()) if device == "cuda" else TOL
        assert diff <= tol, f"{variant} {name}: max abs diff {diff:.2e}"
    if train:   # dropout really was on: a different seed changes the output
        torch.manual_seed(99)
        other, _ = stack(x, state)
        assert not torch.allclose(other, fast[0])


def check_inference(variant: str, x: torch.Tensor) -> None:
    """No-grad forward equals the reference: eval mode with the state carried across two calls, and
    training mode with the same dropout draws."""
    stack = make(variant, train=False)
    with torch.no_grad():
        out, st = stack(x[:, :4])
        out2, st2 = stack(x[:, 4:], st)
        ref, ref_st = stack.forward_reference(x)
    torch.testing.assert_close(torch.cat((out, out2), 1), ref, atol=TOL, rtol=0)
    for a, b in zip(st2, ref_st, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    stack = make(variant, train=True)
    with torch.no_grad():
        torch.manual_seed(5)
        out, st = stack(x)
        torch.manual_seed(5)
        ref, ref_st = stack.forward_reference(x)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    for a, b in zip(st, ref_st, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_inference_path_equals_reference(variant: str) -> None:
    """The no-grad path (no autograd node, ring buffers) gives the same outputs and carried state."""
    check_inference(variant, torch.randn(2, 9, IN))


def test_reference_switch() -> None:
    stack = make("alstm", train=True)
    x = torch.randn(B, T, IN, requires_grad=True)
    assert not reference_enabled()
    assert forward_path(stack(x)[0]) == "fast"
    use_reference(True)
    try:
        assert reference_enabled()
        assert forward_path(stack(x)[0]) == "reference"
    finally:
        use_reference(False)
    assert forward_path(stack(x)[0]) == "fast"
    with reference_cells():
        assert forward_path(stack(x)[0]) == "reference"
    assert not reference_enabled()


def test_reference_switch_by_environment() -> None:
    code = ("import torch; from zoo.models.base import reference_enabled; "
            "from zoo.registry import build_stack; "
            "s = build_stack('pnorm_gru', input_size=3, output_size=4, hidden_size=4); "
            "x = torch.randn(2, 3, 3, requires_grad=True); "
            "print(reference_enabled(), type(s(x)[0].grad_fn).__name__)")
    env = dict(os.environ, ZOO_REFERENCE_CELLS="1")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "StackBackward0"]   # torch.stack of the loop, not GRUSequenceBackward


def test_tracing_uses_the_reference_loop() -> None:
    """Exporters trace plain tensor ops: under ``torch.jit.trace`` the fast path steps aside."""
    stack = make("hyperlstm", train=False)
    x = torch.randn(1, 3, IN)
    with torch.no_grad():
        traced = torch.jit.trace(stack, (x,), check_trace=False)
        graph = str(traced.inlined_graph)
        out = traced(x)[0]
        ref = stack.forward_reference(x)[0]
    assert "aten::einsum" in graph and "aten::baddbmm" not in graph   # the reference's ops, not the fast path's
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)


ALSTM_VARIANTS = sorted(v for v, (arch, _) in VARIANTS.items() if arch == "alstm")
HYPER_VARIANTS = sorted(v for v, (arch, _) in VARIANTS.items() if arch == "hyperlstm")


@pytest.mark.parametrize("name", ["alstm_infer", "hyper_infer"])
def test_the_compiled_inference_loops_build(name: str) -> None:
    """The C++ loops are part of the product (``make`` builds them): a source that does not compile fails
    here, instead of every caller silently falling back to the Python loop."""
    from zoo.models import _compiled

    assert _compiled.load(name) is not None, _compiled.status()
    assert _compiled.status()[name]["available"] is True


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("variant", ALSTM_VARIANTS)
def test_compiled_alstm_inference_equals_reference(variant: str, batch: int) -> None:
    """No-grad aLSTM inference runs the C++ loop (the Python loop is made to fail) and equals the reference,
    in eval mode and in training mode (dropout masks passed to the C++ loop)."""
    from unittest import mock

    from zoo.models import _alstm_fast

    with mock.patch.object(_alstm_fast, "_infer", side_effect=AssertionError("the Python loop ran")):
        check_inference(variant, torch.randn(batch, 9, IN))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("variant", HYPER_VARIANTS)
def test_compiled_hyperlstm_inference_equals_reference(variant: str, batch: int) -> None:
    """Eval-mode HyperLSTM inference (with and without layer norm) runs the C++ loop and equals the reference,
    the state carried across calls."""
    from unittest import mock

    from zoo.models import _hyper_fast

    stack = make(variant, train=False)
    x = torch.randn(batch, 9, IN)
    with torch.no_grad(), mock.patch.object(_hyper_fast, "_forward", side_effect=AssertionError("Python loop")):
        out, st = stack(x[:, :4])
        out2, st2 = stack(x[:, 4:], st)
    with torch.no_grad():
        ref, ref_st = stack.forward_reference(x)
    torch.testing.assert_close(torch.cat((out, out2), 1), ref, atol=TOL, rtol=0)
    for a, b in zip(st2, ref_st, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_without_the_extension_the_python_loop_gives_the_same_numbers() -> None:
    """``ZOO_NO_EXTENSIONS=1`` (or no compiler): the Python loop runs, says why, and agrees."""
    code = ("import torch; from zoo.models import _compiled; from zoo.registry import build_stack; "
            "torch.manual_seed(0); s = build_stack('alstm', input_size=4, output_size=5, hidden_size=5, "
            "adapt_size=3).eval(); x = torch.randn(2, 6, 4)\n"
            "with torch.no_grad(): y = s(x)[0]\n"
            "print(_compiled.status()['alstm_infer'].get('reason', 'compiled loop'))\n"
            "print(repr(y.flatten().tolist()))")
    outs = []
    for flag in ("1", "0"):
        env = dict(os.environ, ZOO_NO_EXTENSIONS=flag)
        res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        outs.append(res.stdout.splitlines())
    assert outs[0][0] == "disabled by ZOO_NO_EXTENSIONS"
    assert outs[1][0] == "compiled loop"
    torch.testing.assert_close(torch.tensor(eval(outs[0][1])), torch.tensor(eval(outs[1][1])), atol=TOL, rtol=0)


@pytest.mark.parametrize("variant", ["alstm", "hyperlstm"])
def test_compiled_weights_follow_parameter_updates(variant: str) -> None:
    """The C++ loops' transposed weights are cached per stack: an in-place update (an optimiser step,
    ``load_state_dict``) must invalidate them."""
    stack = make(variant, train=False)
    x = torch.randn(2, 5, IN)
    with torch.no_grad():
        before = stack(x)[0]
        for p in stack.parameters():
            p.mul_(1.5)
        after, ref = stack(x)[0], stack.forward_reference(x)[0]
        stack.load_state_dict(make(variant, train=False).state_dict())
        restored = stack(x)[0]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, ref, atol=TOL, rtol=0)
    torch.testing.assert_close(restored, before, atol=TOL, rtol=0)


def test_a_build_lock_left_by_a_killed_build_is_cleared(tmp_path):
    """torch's build lock file outlives a process killed mid-build, and every later load then waited for it
    forever (seen: a test hung on `zoo eval`). Under the zoo's own flock (released by the kernel when its holder
    dies) a torch lock file can only be such a leftover, so it is removed before torch looks for it."""
    import subprocess
    import sys

    from zoo.models._compiled import _build_lock

    (tmp_path / "lock").write_text("")
    with _build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    # a second process cannot enter while this one holds the lock, and can once it is released
    probe = ("import fcntl, sys; f = open(sys.argv[1], 'w'); "
             "sys.exit(0 if fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB) is None else 1)")
    with _build_lock(tmp_path):
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "zoo-build.lock")], capture_output=True)
    free = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "zoo-build.lock")], capture_output=True)
    assert held.returncode != 0 and free.returncode == 0


def test_a_built_loop_is_loaded_without_the_build_tool(tmp_path):
    """Ready means ready: once `zoo build-ext` built the loops, a process loads them without asking ninja (torch's
    `load` ran it every time, and two ninja versions each consider the other's build stale: every switch rebuilt
    the loop, once inside a server's first request, 26-38 s). Here `ninja` on PATH is a stand-in that records
    being run and fails: the loops still load, nothing is compiled, and it never ran."""
    from zoo.models import _compiled

    for name in _compiled.SOURCES:
        assert _compiled.load(name) is not None, _compiled.status()  # built (as `make venv` does)
    marker = tmp_path / "ninja-ran"
    fake = tmp_path / "bin" / "ninja"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    probe = ("import json; from zoo.models import _compiled; "
             "print(json.dumps({n: (_compiled.load(n) is not None, _compiled.status()[n].get('compiled_now')) "
             "for n in _compiled.SOURCES}))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(ok and not compiled for ok, compiled in loaded.values()), loaded
    assert not marker.exists(), marker.read_text()


def test_the_cache_key_names_the_compiler_not_the_build_tool(monkeypatch):
    """What changes the binary (the compiler) changes the folder; the build tool is not in the key."""
    from zoo.models import _compiled

    folder, _ = _compiled._build_dir("alstm_infer")
    monkeypatch.setattr(_compiled, "compiler_id", lambda: "c++ (some other compiler) 99.0")
    assert _compiled._build_dir("alstm_infer")[0] != folder
