"""What trainer.precision means for the model, the data and the forward pass.

- ``fp32``: float32 parameters, buffers and data; no autocast.
- ``fp64``: float64 parameters, buffers and data, every norm layer (torch's BatchNorm2d and
  GroupNorm, this project's reference and fused BatchNorm) in float64; no autocast. Slow, but
  summation order then moves the loss by ~1e-16 instead of ~1e-7, which is what makes
  emulated and real DDP runs comparable to 1e-9 (float32 training here is chaotic). CUDA
  takes it too (the CUDA kernels dispatch float64); the tests run it on CPU.
- ``bf16`` / ``fp16``: float32 parameters and data under autocast (fp16 adds a GradScaler).
"""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"fp64": torch.float64}


def model_dtype(precision: str) -> torch.dtype:
    """The dtype of parameters, buffers and input images for ``precision``."""
    return _DTYPES.get(precision, torch.float32)


def autocast(device: torch.device, precision: str):
    """The autocast context for ``precision`` (none for fp32 and fp64)."""
    if precision in ("fp32", "fp64"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
