"""Batch Renormalization (Ioffe 2017, arXiv:1702.03275), per device, from the paper's formulas.

Per channel, over the m values of one device's slice, with the running statistics mu and
sigma = sqrt(running_var + eps) as they stand before this step:

    mu_B = mean(x),  sigma_B = sqrt(var_B + eps)            (var_B biased)
    r = clip(sigma_B / sigma, 1/rmax, rmax),  d = clip((mu_B - mu) / sigma, -dmax, dmax)
    xhat = (x - mu_B) / sigma_B,  y = gamma * (r * xhat + d) + beta

r and d are constants in the backward pass (``stop_gradient`` in the paper). The running
statistics then update from slice 0's mu_B and var_B exactly as BatchNorm's do. In eval
mode it is BatchNorm with the running statistics. With rmax = 1 and dmax = 0 (r = 1, d = 0)
it is BatchNorm. docs/batchnorm.md §9 derives the backward and points at the lines below.

The limits follow a schedule counted in training batches (``num_batches_tracked``, so it
is saved in the state dict and survives a resume): rmax = 1 and dmax = 0 for the first
``warmup_batches``, then a linear ramp over ``ramp_batches`` to their final values.

``impl`` as BatchNorm's: "reference" runs the torch ops below; "fused" runs the kernels of
``syncbn_lab._C`` that SyncBN's multi-slice path uses (``ops.local_stats``, then
``ops.forward_elemt`` with each slice's r and d folded into its mean and invstd;
``ops.backward_reduce`` and ``ops.backward_elemt``), r and d coming from the (D, C)
statistics in torch ops; "auto" (the default) takes the kernels where they are built.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn_lab.nn import functional as F
from syncbn_lab.nn import ops
from syncbn_lab.nn.functional import SliceShape
from syncbn_lab.nn.sync_batchnorm import BatchNorm

__all__ = ["BatchRenorm", "batch_renorm", "renorm_limits"]


def renorm_limits(
    batch: int | Tensor, rmax: float, dmax: float, warmup_batches: int, ramp_batches: int
) -> tuple[Tensor, Tensor]:
    """(rmax, dmax) in force at training batch ``batch`` (0-based): 1 and 0 during the
    warm-up, then linear to ``rmax`` and ``dmax`` over ``ramp_batches`` (at once if 0).

    0-dim float64 tensors, from ``batch`` as a tensor (the module's ``num_batches_tracked``):
    the module never reads its counter back to Python, so torch.compile traces it as one
    graph."""
    batch = torch.as_tensor(batch).double()
    if ramp_batches > 0:
        progress = ((batch - warmup_batches) / ramp_batches).clamp(0.0, 1.0)
    else:
        progress = (batch >= warmup_batches).double()
    return 1.0 + (rmax - 1.0) * progress, dmax * progress


def batch_renorm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor,
    running_var: Tensor,
    *,
    rmax: float,
    dmax: float,
    momentum: float | None,
    eps: float,
    num_batches_tracked: Tensor | None = None,
    devices: int = 1,
    impl: str = "auto",
) -> Tensor:
    """Training-mode Batch Renormalization of ``x`` seen as ``devices`` slices, each with
    its own batch statistics and the one set of running statistics (updated in place from
    slice 0, as BatchNorm's). Arguments as :func:`syncbn_lab.nn.functional.batch_norm`
    (``impl`` included: "auto", "reference" or "fused")."""
    F.check_impl(impl)
    if running_mean is None or running_var is None:
        raise ValueError("Batch Renormalization needs running_mean and running_var")
    if not isinstance(rmax, Tensor) and (rmax < 1 or dmax < 0):  # tensors: from the module
        raise ValueError(f"Batch Renormalization needs rmax >= 1 and dmax >= 0, got {rmax}, {dmax}")
    F.check_args(
        x, weight, bias, running_mean, running_var, training=True, momentum=momentum,
        num_batches_tracked=num_batches_tracked, devices=devices, comm=None, group_size=None,
    )  # fmt: skip
    call = F.BatchNormCall(
        x=x, weight=weight, bias=bias, running_mean=running_mean, running_var=running_var,
        num_batches_tracked=num_batches_tracked, training=True, momentum=momentum, eps=eps,
        devices=devices, group_size=1, comm=None,
    )  # fmt: skip
    if impl == "fused" or (impl == "auto" and F.auto_takes_fused(x)):
        return _fused_batch_renorm(call, rmax, dmax)
    return _BatchRenormFunction.apply(x, weight, bias, call, rmax, dmax)


def _renorm_statistics(
    call: F.BatchNormCall, slice_mean: Tensor, slice_m2: Tensor, n: int, rmax, dmax
) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Each slice's mu_B, 1/sigma_B, r and d, (D, C) float64, and the count m per slice, from
    the slices' float64 mean and M2 of n values; updates the running statistics (from slice
    0, after reading them for r and d). Shared by the reference and the fused path."""
    eps, running_mean, running_var = call.eps, call.running_mean, call.running_var
    mu = running_mean.detach().double().clone()  # the running statistics before the update
    sigma = torch.sqrt(running_var.detach().double() + eps)  # sigma = sqrt(running_var + eps)
    mean, var, m = F.global_moments(slice_mean, slice_m2, n, call)  # + running update
    invstd = torch.rsqrt(var + eps)  # 1/sigma_B, (D, C) float64
    r = (torch.sqrt(var + eps) / sigma).clamp(1 / rmax, rmax)  # r = clip(sigma_B/sigma)
    d = ((mean - mu) / sigma).clamp(-dmax, dmax)  # d = clip((mu_B - mu)/sigma)
    return mean, invstd, r, d, m


class _BatchRenormFunction(torch.autograd.Function):
    """Forward and hand-written backward of docs/batchnorm.md §9."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        call: F.BatchNormCall,
        rmax: float,
        dmax: float,
    ) -> Tensor:
        compute = torch.float32 if x.dtype in F.HALF_TYPES else x.dtype
        shape = SliceShape(x, call.devices)
        xs = shape.view(x)
        # No out= buffers (torch.compile cannot trace out= into channels_last views); the
        # operations and their dtypes are BatchNorm's (functional.py), so the values are too.
        # Each slice's mu_B and var_B as BatchNorm computes them (pivoted sums, float64).
        pivot = xs.sum(shape.reduce, dtype=compute) / max(shape.n, 1)
        t = xs - shape.per_slice(pivot, compute)  # t = x - K, in the compute dtype
        sum_t2 = (t * t).sum(shape.reduce)
        slice_mean, slice_m2 = F.slice_moments(pivot, t.sum(shape.reduce), sum_t2, shape.n)
        mean, invstd, r, d, m = _renorm_statistics(call, slice_mean, slice_m2, shape.n, rmax, dmax)
        offset = mean - pivot.double()
        # xhat = (x - mu_B) / sigma_B = t * invstd - (mu_B - K) * invstd
        xhat = F.scale_shift(
            None, t, shape.per_slice(invstd, compute), shape.per_slice(-offset * invstd, compute)
        )
        gamma = weight.double().unsqueeze(0) if weight is not None else 1.0
        beta = bias.double().unsqueeze(0) if bias is not None else 0.0
        scale, shift = gamma * r, gamma * d + beta  # y = (gamma*r) * xhat + (gamma*d + beta)
        y = torch.empty_like(x)  # not a view of a tensor made here: a ReLU may work in place
        shape.view(y).copy_(  # rounded once to fp16/bf16
            F.scale_shift(
                None, xhat, shape.per_slice(scale, compute), shape.per_slice(shift, compute)
            )
        )

        ctx.save_for_backward(xhat, weight)
        ctx.invstd_r = (invstd * r).to(compute)  # r / sigma_B
        ctx.r, ctx.d = r.to(compute), d.to(compute)
        ctx.shape, ctx.count, ctx.input_dtype, ctx.input_shape = shape, m, x.dtype, x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        xhat, weight = ctx.saved_tensors
        shape: SliceShape = ctx.shape
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        dy = shape.view(grad_y)
        xhat_s = shape.view(xhat)
        sum_dy = dy.sum(shape.reduce, dtype=xhat.dtype)  # Σdy per slice (D, C)
        sum_dy_xhat = (dy * xhat_s).sum(shape.reduce)  # Σdy·xhat per slice

        # dgamma = Σ dy * (r*xhat + d) = r*Σdy·xhat + d*Σdy (per slice, then over slices)
        grad_weight = None
        if need_weight:
            grad_weight = (sum_dy_xhat * ctx.r + sum_dy * ctx.d).sum(0).to(weight.dtype)
        grad_bias = sum_dy.sum(0).to(ctx.bias_dtype) if need_bias else None  # dbeta = Σdy
        if not need_x:
            return None, grad_weight, grad_bias, *_NO_GRADS
        gamma = weight.to(xhat.dtype).unsqueeze(0) if weight is not None else 1.0
        scale = ctx.invstd_r * gamma  # gamma * r / sigma_B, (D, C)
        # BatchNorm's dx with scale gamma*r/sigma_B: r is a constant of the backward
        dx = F.input_grad(dy, xhat_s, scale, sum_dy, sum_dy_xhat, ctx.count, shape)
        grad_x = dx.to(ctx.input_dtype).reshape(ctx.input_shape)  # a view: autograd's own
        return grad_x, grad_weight, grad_bias, *_NO_GRADS


_NO_GRADS = (None,) * 3  # call, rmax, dmax


def _fused_batch_renorm(call: F.BatchNormCall, rmax, dmax) -> Tensor:
    """Batch Renormalization on the fused kernels; the reference where their float32 mean
    is too coarse (functional.fused_stats_too_coarse, checked before the running update)."""
    x = call.x
    F.check_fused_runs(x)
    _, slice_mean, slice_m2 = ops.local_stats(x.detach(), call.devices)  # fp32 (fp64 for fp64)
    if F.fused_stats_too_coarse(call, slice_mean, slice_m2):
        return _BatchRenormFunction.apply(x, call.weight, call.bias, call, rmax, dmax)
    return _FusedBatchRenormFunction.apply(
        x, call.weight, call.bias, call, rmax, dmax, slice_mean, slice_m2
    )


class _FusedBatchRenormFunction(torch.autograd.Function):
    """docs/batchnorm.md §9 on the primitives of ``syncbn_lab._C``, statistics per slice.

    The kernels take a per-channel weight and bias and per-slice (D, C) mean and invstd, so
    each slice's r and d go into those: y = gamma * (r * xhat + d) + beta is
    ``forward_elemt`` with invstd' = r / sigma_B and mean' = mu_B - d * sigma_B / r
    ((x - mean') * invstd' = r * xhat + d). The backward reduces with the true mu_B and
    1/sigma_B (Σdy, Σdy·xhat per slice), and ``backward_elemt`` with invstd' and mu_B, whose
    xhat' = r * xhat, takes Σdy·xhat / r: BatchNorm's dx with scale gamma * r / sigma_B.
    """

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        call: F.BatchNormCall,
        rmax: float,
        dmax: float,
        slice_mean: Tensor,
        slice_m2: Tensor,
    ) -> Tensor:
        n = SliceShape(x, call.devices).n
        mean, invstd, r, d, m = _renorm_statistics(
            call, slice_mean.double(), slice_m2.double(), n, rmax, dmax
        )
        stats = slice_mean.dtype  # the kernels' float32 (float64 for float64 input)
        invstd_r = invstd * r  # r / sigma_B
        # y = gamma * (x - (mu_B - d * sigma_B / r)) * r / sigma_B + beta, rounded once
        y = ops.forward_elemt(x, (mean - d / invstd_r).to(stats), invstd_r.to(stats), weight, bias)
        ctx.save_for_backward(
            x, weight, bias, *(t.to(stats) for t in (mean, invstd, invstd_r, r, d))
        )
        ctx.count = m
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        x, weight, bias, mean, invstd, invstd_r, r, d = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        # Σdy and Σdy·xhat per slice (D, C), xhat = (x - mu_B) / sigma_B
        sum_dy, sum_dy_xhat = ops.backward_reduce(grad_y, x, mean, invstd, weight, bias)
        grad_weight = None  # dgamma = r*Σdy·xhat + d*Σdy (per slice, then over slices)
        if need_weight:
            grad_weight = (sum_dy_xhat * r + sum_dy * d).sum(0).to(weight.dtype)
        grad_bias = sum_dy.sum(0).to(bias.dtype) if need_bias else None  # dbeta = Σdy
        if not need_x:
            return None, grad_weight, grad_bias, *_NO_GRADS, None, None
        count = mean.new_full((1,), float(ctx.count))
        # dx = gamma*r/sigma_B/m * (m*dy - Σdy - xhat*Σdy·xhat); the kernel's xhat is r*xhat
        grad_x = ops.backward_elemt(
            grad_y, x, mean, invstd_r, weight, bias, sum_dy, sum_dy_xhat / r, count
        )
        return grad_x, grad_weight, grad_bias, *_NO_GRADS, None, None  # slice_mean, slice_m2


class BatchRenorm(BatchNorm):
    """Batch Renormalization with torch's BatchNorm constructor and state-dict keys.

    Each device slice (``device_slices``, as :class:`~syncbn_lab.nn.BatchNorm`) is normalised with
    its own batch statistics and corrected towards the running statistics by r and d (see
    the module doc); the running statistics follow slice 0. Eval mode is BatchNorm's.

    Args beyond torch's BatchNorm (``track_running_stats`` must be True: r and d need the
    running statistics):
        rmax, dmax: final limits of r (>= 1) and d (>= 0); the paper's 3 and 5 by default.
        warmup_batches: training batches with rmax = 1 and dmax = 0 (plain BatchNorm).
        ramp_batches: training batches over which the limits then grow linearly to their
            final values (0: at once). Defaults: the paper's 5,000 and 35,000 (rmax reaches
            3 after 40,000 steps).
    The schedule counts ``num_batches_tracked`` (a buffer, saved with the model).
    ``impl``: as BatchNorm's ("auto": the fused kernels where built; eval is BatchNorm's).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
        device_slices: int = 1,
        impl: str = "auto",
        rmax: float = 3.0,
        dmax: float = 5.0,
        warmup_batches: int = 5_000,
        ramp_batches: int = 35_000,
    ) -> None:
        if not track_running_stats:
            raise ValueError("BatchRenorm needs track_running_stats=True (r and d use them)")
        if not (rmax >= 1 and dmax >= 0 and math.isfinite(rmax) and math.isfinite(dmax)):
            raise ValueError(
                f"BatchRenorm needs finite rmax >= 1 and dmax >= 0, got {rmax}, {dmax}"
            )
        if warmup_batches < 0 or ramp_batches < 0:
            raise ValueError(
                f"BatchRenorm warmup_batches={warmup_batches} and ramp_batches={ramp_batches} "
                "must be >= 0"
            )
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype,
            bias=bias, impl=impl, device_slices=device_slices,
        )  # fmt: skip
        self.rmax, self.dmax = float(rmax), float(dmax)
        self.warmup_batches, self.ramp_batches = int(warmup_batches), int(ramp_batches)
        self.plain = False  # see as_batchnorm

    @contextlib.contextmanager
    def as_batchnorm(self) -> Iterator[None]:
        """Within the block, training steps use r = 1 and d = 0 (BatchNorm): for PreciseBN,
        whose re-estimated running statistics would otherwise feed back into the very
        activations it measures (and differently on every DDP rank)."""
        previous, self.plain = self.plain, True
        try:
            yield
        finally:
            self.plain = previous

    def limits(self) -> tuple[float, float] | tuple[Tensor, Tensor]:
        """(rmax, dmax) for the next training batch (float64 tensors, see renorm_limits;
        1 and 0 as floats within as_batchnorm)."""
        if self.plain:
            return 1.0, 0.0
        return renorm_limits(
            self.num_batches_tracked, self.rmax, self.dmax,
            self.warmup_batches, self.ramp_batches,
        )  # fmt: skip

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return super().forward(input)  # BatchNorm with the running statistics
        self._check_input_dim(input)
        rmax, dmax = self.limits()
        self.num_batches_tracked.add_(1)
        return batch_renorm(
            input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            rmax=rmax,
            dmax=dmax,
            momentum=self.momentum,
            eps=self.eps,
            num_batches_tracked=self.num_batches_tracked,
            devices=self.device_slices,
            impl=self.impl,
        )

    def extra_repr(self) -> str:
        slices = f", device_slices={self.device_slices}" if self.device_slices != 1 else ""
        impl = f", impl={self.impl!r}" if self.impl != "auto" else ""
        return (
            f"{_BatchNorm.extra_repr(self)}{slices}{impl}, rmax={self.rmax}, dmax={self.dmax}, "
            f"warmup_batches={self.warmup_batches}, ramp_batches={self.ramp_batches}"
        )
