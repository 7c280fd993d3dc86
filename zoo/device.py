"""Where a model runs: the one parser of a device argument (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"auto"``).

Why one helper: ``zoo.load``, ``ZooModel.to``, every CLI command's ``--device``, training, the lm-eval plugin, the
demo and the server all take a device; each refuses the same mistakes with the same one line (a
:class:`~zoo.errors.DeviceError`, a ``ConfigError``: exit 2 on the CLI), instead of torch's RuntimeError or
AssertionError deep in the first allocation.

Numbers on CUDA: fp32 means fp32. PyTorch lets cuDNN (the LSTM baselines' kernels) use TF32 by default, which
rounds the GEMM inputs to a 10-bit mantissa; :func:`exact_float32` turns TF32 off for cuBLAS and cuDNN, so a
model's CUDA scores equal its CPU scores to float rounding. bf16 is an explicit choice (``precision="bf16"``).
"""

from __future__ import annotations

import torch

from zoo.errors import DeviceError

#: what a device argument may name
CHOICES = "cpu, cuda, cuda:N or auto"


def resolve_device(spec: str | torch.device | None = "cpu", what: str = "device") -> torch.device:
    """``spec`` as a :class:`torch.device` this machine has: ``None`` or ``"cpu"`` the CPU, ``"auto"`` CUDA when
    there is one (else the CPU), ``"cuda"`` the current CUDA device (with its index, so ``.device`` says which).
    ``what`` names the argument in the error (``"--device"`` on the CLI)."""
    if spec is None:
        return torch.device("cpu")
    if not isinstance(spec, str | torch.device):
        raise DeviceError(f"{what} must be a str ({CHOICES}), got {type(spec).__name__}")
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec.strip() if isinstance(spec, str) else spec)
    except (RuntimeError, ValueError):
        raise DeviceError(f"{what} {spec!r} is not a device (use {CHOICES})") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"{what} {str(spec)!r}: the zoo runs on cpu or cuda (use {CHOICES})")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"{what} {str(spec)!r}: this machine has no CUDA device torch can use (use cpu)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"{what} {str(spec)!r}: this machine has {count} CUDA device{'s' * (count != 1)} "
                          f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def device_of(runner: object) -> torch.device:
    """Where a runner (:mod:`zoo.scoring`) takes its inputs: its ``device`` (the eager model, its CUDA-graph and
    autocast runners), else the CPU (the TorchScript and ONNX Runtime backends)."""
    device = getattr(runner, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def check_gpus(count: int, what: str = "--gpus") -> int:
    """A number of GPUs to use (``zoo serve start --gpus N``): 0 (the CPU) or at most as many as there are."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise DeviceError(f"{what} must be a whole number >= 0, got {count!r}")
    if count:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise DeviceError(f"{what} {count}: this machine has no CUDA device torch can use (use {what} 0)")
        if count > have:
            raise DeviceError(f"{what} {count}: this machine has {have} CUDA device{'s' * (have != 1)}")
    return count


def exact_float32(device: torch.device) -> None:
    """Keep float32 GEMMs float32 on ``device`` (TF32 off for cuBLAS and cuDNN; see the module docstring).
    Process-wide, as PyTorch's switches are; a no-op on the CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
