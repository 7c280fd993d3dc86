"""Adaptive feed-forward layer (Flennerhag et al., NeurIPS 2018, section 2), a drop-in ``nn.Linear``.

The paper's adaptive feed-forward layer (eq. 2) replaces the fixed affine map ``W x + b`` by

    f(x) = D^(q) W^(q-1) ... W^(1) D^(1) x + D^(0) b,        D^(j) = diag(pi^(j)(x)),

where the *adaptation policy* ``pi`` is produced by a small adaptation model trained jointly with
the layer. Section 2.2 names four low-order policies, all implemented here (with the static bias
``b`` by default, or the paper's adaptive ``D^(0) b`` with ``adapt_bias=True``):

==========  =======================================  ===========================================
policy      paper                                    implemented as (``d_* = pi_*(x)``)
==========  =======================================  ===========================================
``input``   ``f(x) = W D^(1) x + D^(0) b``           ``y = W (d_in * x) + b``
``output``  ``f(x) = D^(1) W x + D^(0) b``           ``y = d_out * (W x) + b``
``io``      ``f(x) = D^(2) W D^(1) x + D^(0) b``     ``y = d_out * (W (d_in * x)) + b``  (eq. 3)
``sva``     ``f(x) = W^(2) D W^(1) x + D^(0) b``     ``y = W2 (d_sv * (W1 x)) + b``      (eq. 4)
==========  =======================================  ===========================================

``*`` is the elementwise (Hadamard) product, broadcast over any leading dimensions. Every
``D`` is applied as an elementwise product on an activation vector, so no per-example weight
matrix is ever formed: the cost over ``nn.Linear`` is the small adaptation model plus O(n)
elementwise work per example.

SVA ("singular value adaptation"): ``W1`` is ``[rank, in]`` and ``W2`` is ``[out, rank]``. With
``W1 = V^T A`` and ``W2 = B U`` (``U``, ``V`` orthogonal) eq. 4 reads ``B (U D V^T) A x``: the
adaptation rescales the singular values of the inner ``U D V^T``. As in the paper, both factors
are *initialised* semi-orthogonal (Saxe et al., 2013) and orthogonality is not enforced after
initialisation. ``rank`` defaults to ``min(in, out)``; the paper notes that for large inputs the
rank must be kept small to control the parameter count.

Adaptation model (``pi``). Section 2 leaves ``pi`` open ("we parameterize pi as a neural network
trained jointly with the main model"). We use the concrete form of section 3: a latent variable
``z`` from a small network, mapped to *every* sub-policy by a projection and tanh,
``pi^(j)(z) = tanh(U^(j) z)``. As in the reference aLSTM code, all sub-policies come from **one**
bias-free projection ``U = [U^(in); U^(out) | U^(sv); U^(b)]`` whose output is sliced by views.
Latent models (``adaptation_model``):

* ``"relu"`` (default): ``z = ReLU(W_z x + b_z)``, the static adaptation model of eq. 6 with
  summary variable ``v = x``;
* ``"tanh"``: ``z = tanh(W_z x + b_z)``;
* ``"glu"``: ``z = (W_a x + b_a) * sigmoid(W_g x + b_g)``, a gated linear unit (Dauphin et al.,
  2017), the adaptation model of the paper's extreme-tail-regression experiment (section 5.1).

Because ``tanh`` lies in ``(-1, 1)``, adaptations start small and may flip the sign of a
connection, exactly as in the reference code (no ``1 +`` offset).

Parameter count (``n = in_features``, ``m = out_features``, ``k = adapt_size``, ``r = rank``,
``c = 1`` if ``bias`` else ``0``, ``a = 1`` if ``adapt_bias`` else ``0``)::

    main       = m n + c m                      (input / output / io)
               = r n + m r + c m                (sva)
    latent     = k n + k                        (relu, tanh)
               = 2 (k n + k)                    (glu)
    projection = k (P + a m),  P = n (input), m (output), n + m (io), r (sva)
    total      = main + latent + projection

:meth:`AdaptiveLinear.num_parameters_formula` evaluates it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

POLICIES = ("input", "output", "io", "sva")
ADAPTATION_MODELS = ("relu", "tanh", "glu")

__all__ = ["ADAPTATION_MODELS", "POLICIES", "AdaptiveLinear"]


class AdaptiveLinear(nn.Module):
    """Drop-in replacement for ``nn.Linear(in_features, out_features, bias)`` with an input-adaptive
    parameterization (Flennerhag et al., 2018, section 2; see the module docstring for equations).

    Args:
        in_features, out_features, bias: as for :class:`torch.nn.Linear`.
        policy: ``"input"``, ``"output"``, ``"io"`` (default, eq. 3) or ``"sva"`` (eq. 4).
        adapt_size: size ``k`` of the latent adaptation variable ``z``.
        adaptation_model: ``"relu"`` (default, eq. 6), ``"tanh"`` or ``"glu"`` (section 5.1).
        rank: inner dimension ``r`` of the SVA factorisation ``W = W2 W1`` (``policy="sva"`` only;
            default ``min(in_features, out_features)``).
        adapt_bias: use the paper's adaptive bias ``D^(0) b`` instead of the static ``b``
            (requires ``bias=True``).

    Parameter count::

        total = main + latent + projection
        main       = m n + c m   (input/output/io)    |  r n + m r + c m   (sva)
        latent     = k n + k     (relu/tanh)          |  2 (k n + k)       (glu)
        projection = k (P + a m),  P = n | m | n + m | r   for input | output | io | sva

    with ``n, m, k, r`` = in, out, adapt, rank sizes and ``c, a`` = 1 if ``bias`` / ``adapt_bias``.

    Shapes: ``x [..., in_features] -> y [..., out_features]``, like ``nn.Linear``.

    Attributes:
        weight: ``[out, in]`` (input/output/io policies).
        weight1, weight2: ``[rank, in]`` and ``[out, rank]`` (sva policy); :meth:`effective_weight`
            returns the static product ``W2 W1``.
        bias: ``[out]`` or ``None``.
        latent: the latent model (``nn.Linear``, or ``nn.Linear`` to ``2k`` for glu).
        policy_proj: the bias-free projection ``[P (+ m), k]`` producing all adaptation vectors.
        force_identity: when ``True`` every adaptation is the identity and the layer computes the
            static map ``W x + b`` (``W2 W1 x + b`` for sva) with no adaptation-model cost; see also
            the :meth:`identity_adaptation` context manager.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        policy: str = "io",
        adapt_size: int = 16,
        adaptation_model: str = "relu",
        rank: int | None = None,
        adapt_bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if adaptation_model not in ADAPTATION_MODELS:
            raise ValueError(f"adaptation_model must be one of {ADAPTATION_MODELS}, got {adaptation_model!r}")
        if in_features <= 0 or out_features <= 0 or adapt_size <= 0:
            raise ValueError("in_features, out_features and adapt_size must be positive")
        if rank is not None and policy != "sva":
            raise ValueError("rank is only used by policy='sva'")
        if adapt_bias and not bias:
            raise ValueError("adapt_bias=True requires bias=True")
        fk = {"device": device, "dtype": dtype}
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.policy = policy
        self.adapt_size = int(adapt_size)
        self.adaptation_model = adaptation_model
        self.adapt_bias = bool(adapt_bias)
        self.rank: int | None = None
        if policy == "sva":
            self.rank = int(rank) if rank is not None else min(self.in_features, self.out_features)
        if self.rank is not None and self.rank <= 0:
            raise ValueError("rank must be positive")
        self.force_identity = False

        n, m = self.in_features, self.out_features
        if policy == "sva":
            self.weight1 = nn.Parameter(torch.empty(self.rank, n, **fk))
            self.weight2 = nn.Parameter(torch.empty(m, self.rank, **fk))
        else:
            self.weight = nn.Parameter(torch.empty(m, n, **fk))
        self.bias = nn.Parameter(torch.empty(m, **fk)) if bias else None

        k = self.adapt_size
        self.latent = nn.Linear(n, 2 * k if adaptation_model == "glu" else k, **fk)
        # Slice sizes of the one projection, in order; names are the keys of ``adaptation()``.
        sizes = {"input": [("in", n)], "output": [("out", m)], "io": [("in", n), ("out", m)],
                 "sva": [("sv", self.rank or 0)]}[policy]
        if self.adapt_bias:
            sizes.append(("bias", m))
        self._slices = tuple(sizes)
        self.policy_proj = nn.Linear(k, sum(s for _, s in sizes), bias=False, **fk)
        self.reset_parameters()

    # -- init ---------------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """``nn.Linear`` init for ``W``/``b`` (so the static part starts as a default ``nn.Linear``);
        semi-orthogonal SVA factors (paper, section 2.2); PyTorch default init for the adaptation
        model and the policy projection (as in the reference aLSTM code)."""
        if self.policy == "sva":
            nn.init.orthogonal_(self.weight1)
            nn.init.orthogonal_(self.weight2)
        else:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)
        self.latent.reset_parameters()
        self.policy_proj.reset_parameters()

    # -- adaptation ---------------------------------------------------------------------------------
    def latent_variable(self, x: Tensor) -> Tensor:
        """The latent adaptation variable ``z [..., adapt_size]``."""
        h = self.latent(x)
        if self.adaptation_model == "relu":
            return torch.relu(h)
        if self.adaptation_model == "tanh":
            return torch.tanh(h)
        a, g = h.chunk(2, dim=-1)
        return a * torch.sigmoid(g)

    def adaptation(self, x: Tensor) -> dict[str, Tensor]:
        """The adaptation vectors ``pi(x)`` (the diagonals of the ``D`` matrices), by name.

        Keys: ``"in"`` ``[..., in]`` (input, io), ``"out"`` ``[..., out]`` (output, io), ``"sv"``
        ``[..., rank]`` (sva) and ``"bias"`` ``[..., out]`` (``adapt_bias``). Under
        :attr:`force_identity` all are ones.
        """
        lead = x.shape[:-1]
        if self.force_identity:
            return {name: x.new_ones(*lead, size) for name, size in self._slices}
        pi = torch.tanh(self.policy_proj(self.latent_variable(x)))
        out, start = {}, 0
        for name, size in self._slices:
            out[name] = pi.narrow(-1, start, size)
            start += size
        return out

    @contextmanager
    def identity_adaptation(self) -> Iterator[AdaptiveLinear]:
        """Context manager: within it, the layer is the static ``nn.Linear`` map."""
        prev = self.force_identity
        self.force_identity = True
        try:
            yield self
        finally:
            self.force_identity = prev

    def effective_weight(self) -> Tensor:
        """The static (non-adapted) weight ``[out, in]``: ``W``, or ``W2 W1`` for sva."""
        if self.policy == "sva":
            return self.weight2 @ self.weight1
        return self.weight

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got shape {tuple(x.shape)}")
        sva = self.policy == "sva"
        if self.force_identity:
            if sva:
                return F.linear(F.linear(x, self.weight1), self.weight2, self.bias)
            return F.linear(x, self.weight, self.bias)

        d = self.adaptation(x)
        if sva:
            y = F.linear(d["sv"] * F.linear(x, self.weight1), self.weight2)
        else:
            if "in" in d:
                x = d["in"] * x
            y = F.linear(x, self.weight)
            if "out" in d:
                y = d["out"] * y
        if self.bias is not None:
            y = y + (d["bias"] * self.bias if self.adapt_bias else self.bias)
        return y

    # -- introspection ------------------------------------------------------------------------------
    def num_parameters_formula(self) -> int:
        """The documented parameter count, evaluated for this layer's sizes."""
        n, m, k = self.in_features, self.out_features, self.adapt_size
        c = 1 if self.bias is not None else 0
        a = 1 if self.adapt_bias else 0
        if self.policy == "sva":
            r = self.rank
            main, p = r * n + m * r + c * m, r
        else:
            main, p = m * n + c * m, {"input": n, "output": m, "io": n + m}[self.policy]
        latent = (2 if self.adaptation_model == "glu" else 1) * (k * n + k)
        return main + latent + k * (p + a * m)

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, "
             f"bias={self.bias is not None}, policy={self.policy!r}, adapt_size={self.adapt_size}, "
             f"adaptation_model={self.adaptation_model!r}")
        if self.rank is not None:
            s += f", rank={self.rank}"
        if self.adapt_bias:
            s += ", adapt_bias=True"
        if self.force_identity:
            s += ", force_identity=True"
        return s
