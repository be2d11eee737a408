"""Python face of the fused BatchNorm kernels (torch.ops.syncbn_lab, built from csrc/).

The input is seen as ``devices`` equal consecutive slices along N (what each device holds);
statistics are float32 (float64 for float64 input). Shapes below: x (N, C, *spatial),
G = number of statistic rows ("slices" of the elementwise ops).

Composite, differentiable, compiles with ``torch.compile(fullgraph=True)`` (no communication):

- :func:`batch_norm_train` (x, weight, bias, devices, group_size, eps)
  -> ``BatchNormOutput(y, mean, var, invstd)``, mean/var/invstd (G, C), G = devices/group_size.
  group_size=1: every slice uses its own statistics (per-device BN under DP/DDP);
  group_size=devices: all slices share them (SyncBN emulated in one process).
  ``var`` is biased; each group holds ``count = N / G * prod(spatial)`` values.

``batch_norm_train_backward(dy, x, weight, bias, mean, invstd, input_grad) -> (dx, dweight,
dbias)`` is its backward in one op (dx empty unless ``input_grad``), and
:func:`update_running_stats` the bookkeeping of an eager training step after it.

Primitives (not differentiable). ``nn.functional`` runs SyncBN across slices or ranks on them,
with its own reduction (one all_reduce per direction) between them:

- ``local_stats(x, devices) -> (count (D,), mean (D, C), m2 (D, C))``: one-pass Welford.
- ``forward_elemt(x, mean, invstd, weight, bias) -> y``: ``(x - mean) * invstd * weight +
  bias``; mean/invstd (G, C) or (C,).
- ``backward_reduce(dy, x, mean, invstd, weight, bias) -> (sum_dy, sum_dy_xhat)``, shaped like
  mean. These are also d(bias) and d(weight) summed over the rows.
- ``backward_elemt(dy, x, mean, invstd, weight, bias, sum_dy, sum_dy_xhat, count) -> dx`` with
  global sums and count (1 or G values): ``weight * invstd / m * (m dy - sum_dy - xhat
  sum_dy_xhat)``.

Outputs shaped like x (y, dx) keep x's layout when it is contiguous or channels-last
(channels_last / channels_last_3d, or the same for 3-D input); any other layout is computed
from a contiguous copy and returned contiguous.

Every function raises RuntimeError when the extension is not built; :func:`available` says
whether it is (and warns once when not), so callers can fall back to the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from syncbn_lab.nn import _ext

__all__ = [
    "BatchNormOutput",
    "available",
    "backward_elemt",
    "backward_reduce",
    "batch_norm_train",
    "forward_elemt",
    "has_cuda_kernels",
    "local_stats",
    "update_running_stats",
]

available = _ext.available


class BatchNormOutput(NamedTuple):
    y: Tensor
    mean: Tensor  # (G, C)
    var: Tensor  # (G, C), biased
    invstd: Tensor  # (G, C)


def _ops():
    if not _LOADED:  # a plain global: torch.compile traces this without a graph break
        raise RuntimeError(
            f"syncbn_lab._C is not built ({_ext.unavailable_reason()}); "
            "build it with `make build-ext` or use the reference implementation"
        )
    return torch.ops.syncbn_lab


def has_cuda_kernels() -> bool:
    """True when the loaded extension has its CUDA kernels. The answer is fixed once it is
    loaded, so the dispatcher is asked once, at import, not on every training step (~4 us)."""
    return _HAS_CUDA_KERNELS


# ---------------------------------------------------------------------------------------------
# Primitives
# ---------------------------------------------------------------------------------------------


def local_stats(x: Tensor, devices: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """Per-slice (count, mean, m2) of x cut into ``devices`` slices."""
    return _ops().local_stats(x, devices)


def forward_elemt(
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """y = (x - mean) * invstd * weight + bias, statistics per slice row."""
    return _ops().forward_elemt(x, mean, invstd, weight, bias)


def backward_reduce(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(sum dy, sum dy * xhat) per statistic row."""
    return _ops().backward_reduce(dy, x, mean, invstd, weight, bias)


def backward_elemt(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    sum_dy: Tensor,
    sum_dy_xhat: Tensor,
    count: Tensor,
) -> Tensor:
    """dx from the (global) sums and count of the statistic rows."""
    return _ops().backward_elemt(dy, x, mean, invstd, weight, bias, sum_dy, sum_dy_xhat, count)


# ---------------------------------------------------------------------------------------------
# Composite op: forward, backward and autograd in C++ (csrc/syncbn_autograd.cpp)
# ---------------------------------------------------------------------------------------------


def batch_norm_train(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    devices: int = 1,
    group_size: int = 1,
    eps: float = 1e-5,
) -> BatchNormOutput:
    """Training-mode BatchNorm of x seen as ``devices`` slices, no communication.

    Statistics are shared within consecutive groups of ``group_size`` slices (1: per-device
    BN; ``devices``: SyncBN over all slices). Differentiable in x, weight and bias.
    """
    return BatchNormOutput(*_ops().batch_norm_train(x, weight, bias, devices, group_size, eps))


def update_running_stats(
    running_mean: Tensor | None,
    running_var: Tensor | None,
    mean: Tensor,
    var: Tensor,
    invstd: Tensor,
    factor: float,
    count: int,
    mean_limit: float,
) -> bool:
    """Eager bookkeeping of a :func:`batch_norm_train` step in one op call: returns True (and
    updates nothing) when some row has ``|mean| * invstd > mean_limit`` (0: no check);
    otherwise moves the running statistics, if given, by ``factor`` towards row 0's mean and
    unbiased variance of ``count`` values. Reads the answer back (a device sync on a GPU)
    only when there is a check (``mean_limit > 0``; float64 input has none)."""
    too_coarse = _ops().update_running_stats(
        running_mean, running_var, mean, var, invstd, factor, count, mean_limit
    )
    return mean_limit > 0 and bool(too_coarse.item())


# ---------------------------------------------------------------------------------------------
# Fake (meta) kernels and autograd, registered when the extension is loaded
# ---------------------------------------------------------------------------------------------


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _is_channels_last_dense(x: Tensor) -> bool:
    """Mirror of csrc/syncbn.h::is_channels_last_dense (dims of size 1 have any stride)."""
    if x.dim() < 3:
        return False
    sizes, strides = x.shape, x.stride()
    expected = 1
    if sizes[1] != 1 and strides[1] != expected:
        return False
    expected = expected * sizes[1]
    for d in range(x.dim() - 1, 1, -1):
        if sizes[d] != 1 and strides[d] != expected:
            return False
        expected = expected * sizes[d]
    return sizes[0] == 1 or strides[0] == expected


def _empty_like_kernel_output(x: Tensor) -> Tensor:
    """Output shaped like x in the layout the kernels produce (see csrc/syncbn.h)."""
    if x.is_contiguous() or not _is_channels_last_dense(x):
        return x.new_empty(x.shape)
    strides = [0] * x.dim()
    expected = 1
    strides[1] = expected
    expected = expected * x.shape[1]
    for d in range(x.dim() - 1, 1, -1):
        strides[d] = expected
        expected = expected * x.shape[d]
    strides[0] = expected
    return x.new_empty_strided(x.shape, strides)


def _check_input(x: Tensor, rows: int) -> None:
    torch._check(2 <= x.dim() <= 5, lambda: f"expected a 2-D to 5-D input, got {x.dim()}-D")
    torch._check(rows >= 1, lambda: "the number of device slices must be >= 1")
    torch._check(
        x.shape[0] % rows == 0,
        lambda: f"the batch size {x.shape[0]} is not divisible by {rows} device slices",
    )


def _stat_rows(x: Tensor, mean: Tensor) -> int:
    torch._check(
        mean.dim() in (1, 2) and mean.shape[-1] == x.shape[1],
        lambda: f"mean must have shape (C,) or (slices, C), got {tuple(mean.shape)}",
    )
    return 1 if mean.dim() == 1 else mean.shape[0]


def _register() -> None:
    lib = "syncbn_lab::"

    @torch.library.register_fake(lib + "local_stats")
    def _(x, devices):
        _check_input(x, devices)
        acc = _acc_dtype(x)
        return (
            x.new_empty((devices,), dtype=acc),
            x.new_empty((devices, x.shape[1]), dtype=acc),
            x.new_empty((devices, x.shape[1]), dtype=acc),
        )

    @torch.library.register_fake(lib + "forward_elemt")
    def _(x, mean, invstd, weight, bias):
        _check_input(x, _stat_rows(x, mean))
        return _empty_like_kernel_output(x)

    @torch.library.register_fake(lib + "backward_reduce")
    def _(dy, x, mean, invstd, weight, bias):
        _check_input(x, _stat_rows(x, mean))
        acc = _acc_dtype(x)
        return mean.new_empty(mean.shape, dtype=acc), mean.new_empty(mean.shape, dtype=acc)

    @torch.library.register_fake(lib + "backward_elemt")
    def _(dy, x, mean, invstd, weight, bias, sum_dy, sum_dy_xhat, count):
        _check_input(x, _stat_rows(x, mean))
        return _empty_like_kernel_output(x)

    @torch.library.register_fake(lib + "batch_norm_train")
    def _(x, weight, bias, devices, group_size, eps):
        torch._check(
            group_size >= 1 and devices % group_size == 0,
            lambda: f"group_size must divide devices, got {group_size} and {devices}",
        )
        _check_input(x, devices)
        acc = _acc_dtype(x)
        shape = (devices // group_size, x.shape[1])
        return (
            _empty_like_kernel_output(x),
            x.new_empty(shape, dtype=acc),
            x.new_empty(shape, dtype=acc),
            x.new_empty(shape, dtype=acc),
        )

    @torch.library.register_fake(lib + "batch_norm_train_backward")
    def _(dy, x, weight, bias, mean, invstd, input_grad):
        _check_input(x, _stat_rows(x, mean))
        acc = _acc_dtype(x)
        dx = _empty_like_kernel_output(x) if input_grad else x.new_empty((0,))
        return dx, x.new_empty((x.shape[1],), dtype=acc), x.new_empty((x.shape[1],), dtype=acc)

    @torch.library.register_fake(lib + "update_running_stats")
    def _(running_mean, running_var, mean, var, invstd, factor, count, mean_limit):
        torch._check(mean.dim() == 2, lambda: "mean, var and invstd must be (G, C)")
        return mean.new_empty((), dtype=torch.bool)


_LOADED = _ext.load()
_HAS_CUDA_KERNELS = _LOADED and _ext.has_cuda_kernels()
if _LOADED:
    _register()
