"""What trainer.precision means for the model, the data and the forward pass.

- ``fp32``: float32 parameters, buffers and data; no autocast.
- ``fp64``: float64 parameters, buffers and data, every norm layer (torch's BatchNorm2d and
  GroupNorm, this project's reference and fused BatchNorm) in float64; no autocast. Slow, but
  summation order then moves the loss by ~1e-16 instead of ~1e-7, which is what makes
  emulated and real DDP runs comparable to 1e-9 (float32 training here is chaotic). CUDA
  takes it too (the CUDA kernels dispatch float64); the tests run it on CPU.
- ``bf16`` / ``fp16``: float32 parameters and data under autocast (fp16 adds a GradScaler).
- ``auto``: bf16 where the device computes bfloat16 natively (:func:`native_bf16`), fp32
  elsewhere; :func:`resolve` turns it into one of the above before the run starts, and the
  run's config.yaml, log and summary hold what it chose.

Why ``auto``: bf16 autocast is a speed-up only where the hardware has bf16 instructions. On
a CPU without them (AVX2 only) oneDNN emulates bf16 and a bf16 matmul runs at 0.3 GFLOP/s
against 67 in float32: resnet8 trains ten times slower in bf16 than in fp32 there.
"""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"fp64": torch.float64}

# Measured with scripts/bench_step.py (reports/bench_cpu/bench_step_avx2.json): resnet8 at
# 32 emulated devices, one thread, ONEDNN_MAX_CPU_ISA=AVX2: bf16 + channels_last 111 images/s
# against 1061 for fp32 + channels_last (9.6x; 9.0-9.8x over bn and sync at 1 and 32 devices).
BF16_EMULATED_SLOWDOWN = "about ten times"


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 in hardware: a CUDA GPU that supports it, or a
    CPU whose oneDNN reports bf16 support (AVX512-BF16 or AMX; it honours
    ONEDNN_MAX_CPU_ISA, so a capped AVX-512 machine answers as an AVX2 one)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve(precision: str, device: torch.device) -> str:
    """``precision`` with ``auto`` replaced by what this device computes fastest."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device) else "fp32"


def describe(precision: str, device: torch.device) -> str:
    """The run log's line on its precision and why a CPU or GPU suits it."""
    if device.type == "cuda":
        hardware = f"{torch.cuda.get_device_name(device)}, bf16 {_yes(native_bf16(device))}"
    else:
        isa = torch.backends.cpu.get_cpu_capability()
        hardware = f"CPU {isa}, bf16 instructions {_yes(native_bf16(device))}"
    what = f"{precision} autocast" if precision in ("bf16", "fp16") else precision
    return f"precision: {what} ({hardware})"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def slow_bf16_warning(precision: str, device: torch.device) -> str | None:
    """The one warning line for bf16 autocast on a CPU that emulates bfloat16, else None."""
    if precision != "bf16" or device.type != "cpu" or native_bf16(device):
        return None
    return (
        "trainer.precision=bf16 on a CPU without bf16 instructions "
        f"({torch.backends.cpu.get_cpu_capability()}): oneDNN emulates bfloat16 and training "
        f"runs {BF16_EMULATED_SLOWDOWN} slower than in float32; use trainer.precision=auto "
        "(or fp32) with trainer.channels_last=true"
    )


def model_dtype(precision: str) -> torch.dtype:
    """The dtype of parameters, buffers and input images for ``precision``."""
    return _DTYPES.get(precision, torch.float32)


def autocast(device: torch.device, precision: str):
    """The autocast context for ``precision`` (none for fp32 and fp64)."""
    if precision in ("fp32", "fp64"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
