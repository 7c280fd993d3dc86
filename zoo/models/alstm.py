"""Adaptive LSTM (aLSTM), Flennerhag, Yin, Keane & Elliot, "Breaking the Activation Function
Bottleneck through Adaptive Parameterization", NeurIPS 2018.

An aLSTM layer is an LSTM whose two linear maps are re-scaled at every step by vectors that a small
adaptation model produces from the current context (paper eq. 8, with the input-side adaptations
tied across the four gates)::

    z_t   = adaptation model(v_t)                     # small LSTM (eq. 7 / 9) or MLP (eq. 6)
    pi_t  = tanh(W_pi z_t)                            # ONE projection, then sliced:
            [pi_x | pi_h | pi_ih | pi_hh | pi_b]      # n_in, n_h, 4n_h, 4n_h, 4n_h: consecutive (the paper's)
    gates = (W_ih (x_t * pi_x)) * pi_ih + (W_hh (h_{t-1} * pi_h)) * pi_hh + b * pi_b
    c_t   = sig(f) * c_{t-1} + sig(i) * tanh(g);   h_t = sig(o) * tanh(c_t)     # gates (i, f, g, o)

This file follows the reference code (github.com/flennerhag/alstm, ``alstm/alstm.py``) and the paper's
appendix (Flennerhag et al. 2018): sizes, initialisation, the variational dropouts owned by the
stack, and the layer-0 "wrap-around" of the LSTM-RHN adaptation input. Options the reference does not
have (``policy="output"``, the ``"lstm"`` and ``"feedforward"`` adaptation models, a non-adaptive bias)
are the paper's variants; each is documented where it is built.

**The policy's slices are consecutive, as the paper describes, not the reference code's.** The reference's
``utils.chunk`` starts each slice at the previous slice's *size* instead of at the running offset, so its slices
overlap: slice k covers rows ``[s_{k-1}, s_{k-1} + s_k)`` of ``W_pi`` (s_k: the slice sizes above). In its 4n_h-long
tail ``pi_hh`` and ``pi_b`` both start at 4n_h and come out identical, and the rows past the last slice's end are
never read: in the paper's PTB model (400-1150-400, n_z 100; 17,197,800 parameters) layer 0 reads rows
[0, 9200) of its 15,350 and layer 1 rows [0, 3200) of its 6,350, so 6,150 + 3,150 rows of 100 weights,
**930,000 parameters (5.4%), are never read by the reference code** (computed from this file's slice sizes by
``tests/test_alstm.py::test_reference_code_slicing_leaves_930k_parameters_unread``). The zoo slices consecutively
(``ALSTMLayer.policy``): every row is read, every vector is its own. The zoo's 17.2M run still follows the
reference repository's own validation curve (within +-0.007 nats from epoch 30 on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.models._alstm_fast import alstm_forward
from zoo.models.base import RecurrentStack, State, locked_mask

ADAPTATION_MODELS = ("lstm_rhn", "lstm", "feedforward")
POLICIES = ("io", "output")

#: Per-layer dropout masks of one forward call: (hidden mask [B, n_h] or None, z mask [B, n_z] or None).
LayerMasks = tuple[Tensor | None, Tensor | None]


class ALSTMLayer(nn.Module):
    """One aLSTM layer: adaptation model + policy projection + adaptive LSTM cell.

    Parameters (names are part of the checkpoint format):

    * ``adapt``: the adaptation model. ``nn.LSTMCell(a_in -> n_z)`` for the recurrent models
      (paper eq. 7 / eq. 9), ``nn.Linear(n_in + n_h -> n_z)`` followed by ReLU for ``"feedforward"``
      (paper eq. 6: ``z_t = ReLU(W v_t + b)`` with ``v_t = [x_t; h_{t-1}]``).
    * ``project``: ``nn.Linear(n_z -> P, bias=False)``, the single projection ``W_pi`` that yields every
      adaptation vector in one GEMM (reference ``Project``).
    * ``weight_ih [4n_h, n_in]``, ``weight_hh [4n_h, n_h]``, ``bias [4n_h]``: the main LSTM, gates in
      PyTorch order (i, f, g, o). One bias only (the reference has no ``bias_hh``).
    """

    def __init__(self, input_size: int, hidden_size: int, adapt_size: int, adaptation_model: str,
                 policy: str, adaptive_bias: bool, z_input: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.adapt_size = adapt_size
        self.recurrent = adaptation_model != "feedforward"
        self.input_adaptation = policy == "io"
        self.adaptive_bias = adaptive_bias
        #: True when the adaptation input includes the z of the layer below (LSTM-RHN hybrid, eq. 9).
        self.z_input = z_input
        #: Testing switch: every adaptation vector becomes 1, so the cell is a plain LSTM.
        self.identity = False

        n_in, n_h, n_z = input_size, hidden_size, adapt_size
        if self.recurrent:
            self.adapt = nn.LSTMCell(n_in + n_h + (n_z if z_input else 0), n_z)
        else:
            self.adapt = nn.Linear(n_in + n_h, n_z)
        # The slices of pi, consecutive as in the paper (the reference code's overlap: module docstring):
        # [pi_x, pi_h] (input side, IO policy only), pi_ih, pi_hh (output side, per gate and unit), pi_b (adaptive
        # bias only).
        self.pi_names: tuple[str, ...] = (
            (("pi_x", "pi_h") if self.input_adaptation else ())
            + ("pi_ih", "pi_hh")
            + (("pi_b",) if adaptive_bias else ())
        )
        sizes = {"pi_x": n_in, "pi_h": n_h, "pi_ih": 4 * n_h, "pi_hh": 4 * n_h, "pi_b": 4 * n_h}
        self.pi_sizes: tuple[int, ...] = tuple(sizes[name] for name in self.pi_names)
        self.project = nn.Linear(n_z, sum(self.pi_sizes), bias=False)

        self.weight_ih = nn.Parameter(torch.empty(4 * n_h, n_in))
        self.weight_hh = nn.Parameter(torch.empty(4 * n_h, n_h))
        self.bias = nn.Parameter(torch.empty(4 * n_h))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Reference init: orthogonal on each whole rectangular ``[4n_h, n]`` matrix (not per gate),
        bias 0 with +1 on the forget slice; ``adapt`` and ``project`` keep PyTorch's default init.
        """
        nn.init.orthogonal_(self.weight_ih)
        nn.init.orthogonal_(self.weight_hh)
        with torch.no_grad():
            self.bias.zero_()
            self.bias[self.hidden_size:2 * self.hidden_size] += 1.0

    # -- the policy ------------------------------------------------------------------------------------
    def policy(self, z: Tensor) -> tuple[Tensor, ...]:
        """``tanh(W_pi z)`` sliced (views via ``split``) into the vectors named by ``pi_names``."""
        pi = torch.tanh(F.linear(z, self.project.weight))
        if self.identity:
            pi = torch.ones_like(pi)
        return pi.split(self.pi_sizes, dim=1)

    # -- one time step ---------------------------------------------------------------------------------
    def forward(self, x: Tensor, h: Tensor, c: Tensor, z: Tensor | None, zc: Tensor | None,
                z_below: Tensor | None, mask_z: Tensor | None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """One step of this layer.

        ``x`` is the layer input (the dropped h of the layer below), ``h`` the (dropped) previous hidden,
        ``z, zc`` the adaptation LSTM state (``None`` for the feed-forward model), ``z_below`` the
        adaptation input from the layer below (only used when ``self.z_input``), ``mask_z`` the
        adaptation dropout mask. Returns ``(h_t, c_t, z_t, zc_t)`` with ``h_t`` undropped (the stack
        applies the hidden mask, because the undropped h is the stack output) and ``z_t`` dropped (the
        dropped z is what is projected, stored and passed up, as in the reference).
        """
        # 1. adaptation model -> latent z_t
        if self.recurrent:
            v = torch.cat((x, h, z_below), 1) if self.z_input else torch.cat((x, h), 1)
            z, zc = self.adapt(v, (z, zc))
        else:
            z = torch.relu(self.adapt(torch.cat((x, h), 1)))
        if mask_z is not None:
            z = z * mask_z

        # 2. all adaptation vectors from one projection
        pis = self.policy(z)
        if self.input_adaptation:
            pi_x, pi_h, pi_ih, pi_hh = pis[:4]
            gi = torch.mm(x * pi_x, self.weight_ih.t())
            gh = torch.mm(h * pi_h, self.weight_hh.t())
        else:
            pi_ih, pi_hh = pis[:2]
            gi = torch.mm(x, self.weight_ih.t())
            gh = torch.mm(h, self.weight_hh.t())

        # 3. adaptive LSTM cell: D_out W D_in x + D_out V D_in h + D_b b
        gates = torch.addcmul(gh * pi_hh, gi, pi_ih)
        if self.adaptive_bias:
            gates = torch.addcmul(gates, self.bias, pis[-1])
        else:
            gates = gates + self.bias
        i, f, g, o = gates.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c, z, zc


class ALSTMStack(RecurrentStack):
    """Stack of aLSTM layers (the reference ``aLSTM`` module), batch-first, zoo protocol.

    Args:
        input_size, output_size: layer 0 reads ``input_size``; the last layer has ``output_size``
            units (so an LM can tie its decoder to a 400-d embedding). Middle layers have
            ``hidden_size`` units. One layer maps ``input_size -> output_size`` (reference ``get_sizes``).
        adapt_size: ``n_z``, the latent adaptation size per layer (``npar``, 100 in the paper).
        adaptation_model: ``"lstm_rhn"`` (reference / paper eq. 9), ``"lstm"`` (eq. 7, ``v = [x; h]``)
            or ``"feedforward"`` (eq. 6: ``z_t = ReLU(W v_t + b)`` with ``v_t = [x_t; h_{t-1}]``, one
            ``nn.Linear`` per layer, no adaptation state). The paper gives ``v_t = [x_t; h_{t-1}]`` as the
            normal summary (sec. 3, after eq. 7) and motivates the z-from-below of eq. 9 only for the
            recurrent policy, so the feed-forward model reads no z. ``dropout_adapt`` still applies to
            its z, so the two models regularise alike.
        policy: ``"io"`` (input- and output-side adaptation, reference) or ``"output"`` (``D_out W x``).
        adaptive_bias: scale the static bias by ``pi_b`` (reference). When False the static bias is
            still there but unscaled; the reference's ``bias=False`` (no bias at all) is not offered.
        layer0_wraparound: LSTM-RHN only. Layer 0 receives the *top* layer's z from step t-1, which
            is what the reference code does (index -1) and what the paper's eq. 9 writes
            (``z^(0)_t = z^(L)_{t-1}``). False gives layer 0 the input ``[x_t; h_{t-1}]`` only.
        dropout_hidden: variational dropout on every layer's h_t (one ``[B, n_h]`` mask per layer
            per forward call); the dropped h is the recurrent state and the next layer's input.
        dropout_adapt: variational dropout on z_t right after the adaptation model.

    State: per layer ``(h, c, z, zc)`` (``(h, c)`` for ``"feedforward"``), layers in order, flat;
    ``h, c`` are ``[B, n_h^l]`` and ``z, zc`` are ``[B, adapt_size]``. ``h`` and ``z`` are the
    *dropped* values in training mode, as in the reference (they carry across BPTT segments).
    """

    def __init__(self, input_size: int, output_size: int, hidden_size: int = 1150, num_layers: int = 2,
                 adapt_size: int = 100, adaptation_model: str = "lstm_rhn", policy: str = "io",
                 adaptive_bias: bool = True, layer0_wraparound: bool = True,
                 dropout_hidden: float = 0.25, dropout_adapt: float = 0.1) -> None:
        super().__init__(input_size, output_size)
        if adaptation_model not in ADAPTATION_MODELS:
            raise ValueError(f"adaptation_model must be one of {ADAPTATION_MODELS}, got {adaptation_model!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.hidden_size = int(hidden_size)
        self.num_layers = int(num_layers)
        self.adapt_size = int(adapt_size)
        self.adaptation_model = adaptation_model
        self.policy = policy
        self.adaptive_bias = bool(adaptive_bias)
        self.layer0_wraparound = bool(layer0_wraparound)
        self.dropout_hidden = float(dropout_hidden)
        self.dropout_adapt = float(dropout_adapt)

        rhn = adaptation_model == "lstm_rhn"
        # The wrap-around only exists with >1 layer: the reference gives a single layer [x; h] only.
        self._wraparound = rhn and self.layer0_wraparound and self.num_layers > 1
        self.layers = nn.ModuleList()
        for l, (n_in, n_h) in enumerate(self.layer_sizes()):
            z_input = rhn and self.num_layers > 1 and (l > 0 or self._wraparound)
            self.layers.append(ALSTMLayer(n_in, n_h, self.adapt_size, adaptation_model, policy,
                                          self.adaptive_bias, z_input))
        self._per_layer = 4 if adaptation_model != "feedforward" else 2

    def layer_sizes(self) -> list[tuple[int, int]]:
        """``(n_in, n_h)`` per layer, as the reference's ``get_sizes``."""
        if self.num_layers == 1:
            return [(self.input_size, self.output_size)]
        return ([(self.input_size, self.hidden_size)]
                + [(self.hidden_size, self.hidden_size)] * (self.num_layers - 2)
                + [(self.hidden_size, self.output_size)])

    # -- testing switch ------------------------------------------------------------------------------
    def set_identity_adaptation(self, flag: bool) -> None:
        """Force every adaptation vector to 1 (the cell becomes a plain LSTM with one bias).

        Only for tests and diagnostics: the adaptation model still runs and updates z.
        """
        for layer in self.layers:
            layer.identity = bool(flag)

    @contextlib.contextmanager
    def identity_adaptation(self) -> Iterator[ALSTMStack]:
        """Context manager form of :meth:`set_identity_adaptation`."""
        previous = [layer.identity for layer in self.layers]
        self.set_identity_adaptation(True)
        try:
            yield self
        finally:
            for layer, flag in zip(self.layers, previous, strict=True):
                layer.identity = flag

    # -- state -----------------------------------------------------------------------------------------
    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> State:
        ref = self.layers[0].weight_ih
        device = ref.device if device is None else device
        dtype = ref.dtype if dtype is None else dtype
        state: list[Tensor] = []
        for _, n_h in self.layer_sizes():
            sizes = [n_h, n_h] + ([self.adapt_size] * 2 if self._per_layer == 4 else [])
            state += [torch.zeros(batch_size, n, device=device, dtype=dtype) for n in sizes]
        return tuple(state)

    def state_names(self) -> list[str]:
        kinds = ("h", "c", "z", "zc")[:self._per_layer]
        return [f"{k}{l}" for l in range(self.num_layers) for k in kinds]

    # -- dropout ---------------------------------------------------------------------------------------
    def draw_masks(self, batch_size: int, device: torch.device, dtype: torch.dtype
                   ) -> list[LayerMasks] | None:
        """One hidden mask and one z mask per layer, reused at every step of the forward call."""
        if self.dropout_hidden <= 0 and self.dropout_adapt <= 0:
            return None
        return [(locked_mask(batch_size, n_h, self.dropout_hidden, device, dtype),
                 locked_mask(batch_size, self.adapt_size, self.dropout_adapt, device, dtype))
                for _, n_h in self.layer_sizes()]

    # -- computation -----------------------------------------------------------------------------------
    def step_with_masks(self, x: Tensor, state: State, masks: list[LayerMasks] | None
                        ) -> tuple[Tensor, State]:
        n = self._per_layer
        recurrent = n == 4
        # LSTM-RHN layer 0 reads the top layer's z from step t-1 (still in `state`, not yet updated).
        z_below = state[(self.num_layers - 1) * n + 2] if self._wraparound else None
        new_state: list[Tensor] = []
        out = x
        for l, layer in enumerate(self.layers):
            h, c = state[l * n], state[l * n + 1]
            z, zc = (state[l * n + 2], state[l * n + 3]) if recurrent else (None, None)
            mask_h, mask_z = masks[l] if masks is not None else (None, None)
            out, c, z, zc = layer(x, h, c, z, zc, z_below, mask_z)
            h = out * mask_h if mask_h is not None else out
            new_state += [h, c, z, zc] if recurrent else [h, c]
            x, z_below = h, z
        return out, tuple(new_state)

    def fast_path(self, x: Tensor):
        """:func:`zoo.models._alstm_fast.alstm_forward` (same math, same dropout draws, one autograd node);
        the reference loop while the identity testing switch is on."""
        return None if any(layer.identity for layer in self.layers) else alstm_forward

    # -- introspection ---------------------------------------------------------------------------------
    def adaptation_signals(self, state: State) -> dict[str, Tensor]:
        """``{"layer{l}.{pi_name}": [B, n]}`` recomputed from each layer's z in ``state``.

        The state holds the (dropped) z that was projected at the last step, so this reproduces
        exactly the vectors used there. The feed-forward model keeps no z (its z depends on x_t,
        which the state does not hold), so it returns ``{}``.
        """
        if self._per_layer != 4:
            return {}
        signals: dict[str, Tensor] = {}
        for l, layer in enumerate(self.layers):
            for name, pi in zip(layer.pi_names, layer.policy(state[l * 4 + 2]), strict=True):
                signals[f"layer{l}.{name}"] = pi
        return signals
