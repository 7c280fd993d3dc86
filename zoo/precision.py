"""Compute precision of training and eager inference: ``"fp32"`` (the default) or ``"bf16"``.

What runs in which precision under ``"bf16"`` (mixed precision, as ``torch.autocast`` defines it):

* **bfloat16**: the GEMMs. The decoder and every layer's input/recurrent/adaptation GEMMs, through autocast
  for plain ops (the reference loops, ``torch.lstm``, the decoder) and through :mod:`zoo.models._gemm` for
  the fused fast paths and their hand-written backward, where autocast cannot reach. The kernels (oneDNN on
  the CPU, cuBLAS on CUDA) accumulate in float32 and round the result to bfloat16.
* **float32**: the master weights, gradients and optimiser state (the checkpoint is float32), the loss and its
  softmax (logits are widened before the cross-entropy), the gate nonlinearities, and the recurrent cell and
  hidden states carried from step to step and from segment to segment. These are where bfloat16's 8-bit
  mantissa would compound: a carried state is rounded once per step, a loss sums ~1,400 terms per batch.
  (The one exception is PyTorch's fused LSTM kernel, which keeps its cell state in bfloat16 within a segment;
  :class:`zoo.models.lstm.LSTMStack` widens what it returns.)

Whether bf16 is faster depends on the machine: a CPU whose bf16 dot products run at twice the fp32 FMA rate
(AMD Zen 4, or AMX on Intel) speeds the GEMMs up; a CPU that exposes AVX512-BF16 without AMX (Intel Xeon under
a hypervisor that hides AMX) runs them *slower* than fp32. ``benchmarks/precision.py`` measures it.
"""

from __future__ import annotations

import contextlib

import torch

from zoo.errors import ConfigError

#: precision name -> the autocast dtype (``None``: plain float32)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def check(name: str) -> str:
    """``name`` if it is a known precision, else a ``ConfigError`` (a ``ValueError``) that lists the choices."""
    if name not in PRECISIONS:
        raise ConfigError(f"unknown precision {name!r} (choose from {', '.join(PRECISIONS)})")
    return name


def autocast(name: str, device: torch.device | str, cache: bool = True) -> contextlib.AbstractContextManager:
    """The context a forward pass runs in for precision ``name`` on ``device`` (a no-op for fp32). ``cache``:
    autocast's cache of cast weights, which a CUDA graph capture must run without."""
    dtype = PRECISIONS[check(name)]
    if dtype is None:
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=dtype, cache_enabled=cache)



class AutocastRunner:
    """An eager :class:`~zoo.lm.LanguageModel` run in a low precision for scoring and generation.

    Same ``init_state/forward/step`` calls as the model; the forward runs under :func:`autocast` and what it
    returns (logits, state) is widened to float32, so the log-softmax of scoring and the sampling of generation
    stay float32, and the state handed back in between calls is float32 like the default path's.
    """

    def __init__(self, lm: torch.nn.Module, name: str) -> None:
        self.lm, self.precision = lm, check(name)

    @property
    def device(self) -> torch.device:
        return self.lm.decoder.weight.device

    def init_state(self, batch_size: int, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
        return self.lm.init_state(batch_size, device)

    def forward(self, tokens: torch.Tensor, state: tuple[torch.Tensor, ...] | None = None):
        with torch.no_grad(), autocast(self.precision, tokens.device):
            logits, state = self.lm(tokens, state)
        return logits.float(), tuple(s.float() for s in state)

    __call__ = forward

    def step(self, token: torch.Tensor, state: tuple[torch.Tensor, ...]):
        with torch.no_grad(), autocast(self.precision, token.device):
            logits, state = self.lm.step(token, state)
        return logits.float(), tuple(s.float() for s in state)
