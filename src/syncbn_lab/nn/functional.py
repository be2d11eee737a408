"""Reference BatchNorm and SyncBatchNorm: the formulas of docs/batchnorm.md in plain torch ops.

The input is seen as ``devices`` × per-device batch: ``x`` of shape (N, C, *spatial) is D equal
consecutive slices, slice d being what device d holds. Statistics are computed per slice and
then reduced:

- ``comm is None``: per-device BatchNorm. Every slice is normalised with its own statistics
  (what DataParallel and DDP do with a plain BatchNorm). No communication.
- ``comm`` given: SyncBatchNorm. The slices' statistics are summed over the device axis and
  then over the ranks of ``comm`` with one all_reduce in forward and one in backward.

Real DDP (one slice per rank, a process group communicator) and the single-process emulation
(D slices, a :class:`~syncbn_lab.nn.comm.LocalCommunicator`) run the same lines below; only
the communicator differs.

Two implementations share everything but the per-slice arithmetic (see :func:`_backend`):
the reference below (plain torch ops, hand-written backward) and the fused kernels of
``syncbn_lab._C`` (:mod:`syncbn_lab.nn.ops`). Both reduce the same payload through the same
functions (:func:`global_moments`, :func:`_reduce_grad_sums`), so a fused emulated run and a
fused DDP run still differ only in the communicator.

Notation used in comments (per channel): n = values per slice, m = values that share the
statistics (the global count), K = per-slice pivot, t = x - K, mu = mean, M2 = sum((x - mu)^2),
invstd = 1/sqrt(var + eps), xhat = (x - mu) * invstd, y = gamma * xhat + beta.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from syncbn_lab.errors import warn_one_line
from syncbn_lab.nn import _ext, ops
from syncbn_lab.nn.comm import Communicator

__all__ = [
    "HALF_TYPES",
    "IMPLS",
    "BatchNormCall",
    "SliceShape",
    "batch_norm",
    "auto_takes_fused",
    "check_args",
    "check_fused_runs",
    "check_impl",
    "fused_stats_too_coarse",
    "fused_unavailable_reason",
    "global_moments",
    "input_grad",
    "scale_shift",
    "slice_moments",
]

_log = logging.getLogger(__name__)

IMPLS = ("auto", "reference", "fused")
"""Accepted values of ``impl``: "reference" = the formulas below in torch ops; "fused" = the
kernels of syncbn_lab._C in training (eval: torch's batch_norm); "auto" = fused where the
extension is built and supports the input, else the reference (says which once)."""

HALF_TYPES = (torch.float16, torch.bfloat16)
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

_FUSED_MEAN_LIMIT = 16.0
"""Largest |mean| * invstd the fused kernels take. They hand the mean to their elementwise
passes in float32, rounded by up to |mean| * 2**-24, which moves xhat by |mean| * invstd *
2**-24: at most 2**-20 below this limit. Above it (mean 1e4 and std 0.1: 1e5) the call runs
the reference, whose pivoted sums keep xhat exact."""


@dataclass(frozen=True)
class BatchNormCall:
    """One checked call of :func:`batch_norm`: what every implementation takes.

    ``group_size`` is resolved (1 for per-device BN and for eval, D by default for SyncBN), so
    an implementation reads ``call.training`` or ``call.group_size`` by name.
    """

    x: Tensor
    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None
    training: bool
    momentum: float | None
    eps: float
    devices: int
    group_size: int
    comm: Communicator | None


def batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    *,
    training: bool,
    momentum: float | None,
    eps: float,
    num_batches_tracked: Tensor | None = None,
    devices: int = 1,
    comm: Communicator | None = None,
    group_size: int | None = None,
    impl: str = "auto",
) -> Tensor:
    """BatchNorm of ``x`` seen as ``devices`` slices, synchronised through ``comm`` if given.

    Args:
        x: (N, C, *spatial) with 0 to 3 spatial dims, any memory format (kept in the output),
            float64/float32/float16/bfloat16 (statistics in float32 for the half types).
        weight, bias: per-channel affine parameters or ``None``.
        running_mean, running_var: updated in place in training when given (from the
            statistics of device 0); used for normalisation when ``training`` is False.
        training: normalise with batch statistics (True) or with the running ones (False).
        momentum: running-average factor; ``None`` = cumulative average 1/num_batches_tracked
            (the caller increments ``num_batches_tracked`` first, as torch's modules do).
        eps: added to the variance.
        devices: D; the batch is D equal consecutive slices (N % D == 0 in training).
        comm: ``None`` = per-device BN; a communicator = SyncBN over the slices and its ranks.
        group_size: with ``comm``: how many consecutive slices share statistics (default all
            D). Groups of fewer than D slices are only allowed with a world of one rank.
        impl: "auto" | "reference" | "fused"; resolved by :func:`_backend`.

    Raises:
        ValueError: bad shapes (before any collective), or one value per channel in training
            (decided after the all_reduce, so every rank raises together).
    """
    groups_of = check_args(
        x,
        weight,
        bias,
        running_mean,
        running_var,
        training=training,
        momentum=momentum,
        num_batches_tracked=num_batches_tracked,
        devices=devices,
        comm=comm,
        group_size=group_size,
    )
    call = BatchNormCall(
        x=x,
        weight=weight,
        bias=bias,
        running_mean=running_mean,
        running_var=running_var,
        num_batches_tracked=num_batches_tracked,
        training=training,
        momentum=momentum,
        eps=eps,
        devices=devices,
        group_size=groups_of,
        comm=comm,
    )
    return _backend(impl)(call)


def _backend(impl: str) -> Callable[[BatchNormCall], Tensor]:
    """The single dispatch point from ``impl`` to an implementation of :func:`batch_norm`.

    Every implementation takes a :class:`BatchNormCall`. "fused" and "auto" decide per call:
    eval (running statistics, one elementwise pass) runs torch's batch_norm, which computes
    what the reference does up to float32 rounding in one kernel.
    """
    check_impl(impl)
    if impl == "reference":
        return _reference_batch_norm
    return _fused_batch_norm if impl == "fused" else _auto_batch_norm


def check_impl(impl: str) -> None:
    """Raises the one-line error of an ``impl`` that is not one of :data:`IMPLS`."""
    if impl not in IMPLS:
        raise ValueError(f"unknown BatchNorm impl {impl!r}; choose one of {', '.join(IMPLS)}")


def fused_unavailable_reason(x: Tensor | None = None) -> str | None:
    """Why the fused kernels cannot run (on ``x``, if given); ``None`` when they can."""
    if not ops.available(warn=False):
        return f"extension not built: {_ext.unavailable_reason()}"
    if x is None:
        return None
    if x.dtype not in _FUSED_DTYPES:
        return f"no fused kernels for {x.dtype} input"
    if x.device.type == "cpu" or (x.device.type == "cuda" and ops.has_cuda_kernels()):
        return None
    return f"no fused kernels for {x.device.type} tensors in this build"


def check_fused_available() -> None:
    """Raises the one-line error of impl="fused" when the extension is not built."""
    reason = fused_unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"BatchNorm impl='fused' needs the syncbn_lab._C kernels ({reason}); build them "
            "with `make build-ext`, or use impl='reference' (or 'auto')"
        )


_announced: set[str] = set()


def _announce(choice: str, warn: bool = False) -> None:
    """Says once per process and distinct choice what impl="auto" runs: an info line of the
    run log, or a warning (``warn``) when the kernels are missing from this build."""
    if torch.compiler.is_compiling() or choice in _announced:  # first: no guard on the set
        return
    _announced.add(choice)
    if warn:
        warn_one_line(f"bn impl auto -> {choice}")
    else:
        _log.info("bn impl auto -> %s", choice)


def _eval_batch_norm(call: BatchNormCall) -> Tensor:
    """Eval with the running statistics: torch's batch_norm, ``(x - mean) / sqrt(var + eps)
    * weight + bias`` as the reference computes it, up to float32 rounding (tested)."""
    return torch.nn.functional.batch_norm(
        call.x, call.running_mean, call.running_var, call.weight, call.bias, eps=call.eps
    )


def _auto_batch_norm(call: BatchNormCall) -> Tensor:
    if not call.training:
        return _eval_batch_norm(call)
    if auto_takes_fused(call.x):
        return _fused_batch_norm(call)
    return _reference_batch_norm(call)


def auto_takes_fused(x: Tensor) -> bool:
    """impl="auto"'s choice for a training step on ``x`` (BatchNorm's and BatchRenorm's):
    True when the fused kernels take it; says once per process which it runs."""
    reason = fused_unavailable_reason(x)
    if reason is None:
        _announce("fused kernels (syncbn_lab._C)")
        return True
    # A build without (these) kernels is worth a warning; an input they never take is not.
    missing = not ops.available(warn=False) or x.device.type == "cuda"
    _announce(f"reference ({reason})", warn=missing)
    return False


def check_fused_runs(x: Tensor) -> None:
    """Raises impl="fused"'s one-line error when the kernels cannot run on ``x``."""
    check_fused_available()
    reason = fused_unavailable_reason(x)
    if reason is not None:
        raise RuntimeError(
            f"BatchNorm impl='fused' cannot run here ({reason}); use impl='auto' or 'reference'"
        )


def _fused_batch_norm(call: BatchNormCall) -> Tensor:
    """Training BN/SyncBN on the fused kernels; eval (running statistics) runs torch's.

    Without a reduction across slices or ranks (per-device BN, or SyncBN over one slice in one
    process) it is one differentiable op, ``syncbn_lab::batch_norm_train``, which
    torch.compile sees whole. Otherwise the kernels compute each slice's statistics and the
    elementwise passes, and the reduction in between is the reference's own.
    """
    if not call.training:
        return _eval_batch_norm(call)
    x, devices = call.x, call.devices
    check_fused_runs(x)
    if call.group_size == 1 and (call.comm is None or call.comm.world_size == 1):
        return _fused_single_op(call)
    _, mean, m2 = ops.local_stats(x.detach(), devices)  # per slice, float32 (fp64 for fp64)
    if fused_stats_too_coarse(call, mean, m2):
        return _reference_batch_norm(call)  # same collectives: ranks may choose apart
    return _FusedBatchNormFunction.apply(x, call.weight, call.bias, call, mean, m2)


def fused_stats_too_coarse(call: BatchNormCall, mean: Tensor, m2: Tensor) -> bool:
    """True when |mean| * invstd > _FUSED_MEAN_LIMIT somewhere, given the slices' mean and M2
    from ``ops.local_stats``: the kernels' float32 mean would move xhat by more than 2**-20.

    Before a reduction each process checks its own part of a group (mean = the average |mu_d|
    of its slices, invstd from the average of their variances): if every process passes, so
    does the group, whose variance is at least the count-weighted average of its slices'
    (Cauchy-Schwarz then bounds the weighted |mu_d| by 16 group standard deviations), and the
    rounding of its global mean and of the slice means moves xhat by at most 2 * 2**-20. Not
    checked for float64 input (float64 statistics) nor under torch.compile, where a
    data-dependent branch would break the graph.
    """
    x, group_size = call.x, call.group_size
    if x.dtype == torch.float64 or mean.numel() == 0 or torch.compiler.is_compiling():
        return False
    # This process's part of each group: its slices' mean |mu_d| and mean variance.
    groups, n = call.devices // group_size, SliceShape(x, call.devices).n
    mean_abs = mean.abs().view(groups, group_size, -1).mean(1)
    var = m2.view(groups, group_size, -1).sum(1) / max(n * group_size, 1)
    return (mean_abs * torch.rsqrt(var + call.eps)).max().item() > _FUSED_MEAN_LIMIT


def _fused_single_op(call: BatchNormCall) -> Tensor:
    """Every slice normalised with its own statistics by one op, no communication."""
    x, devices, momentum = call.x, call.devices, call.momentum
    running_mean, running_var = call.running_mean, call.running_var
    m = SliceShape(x, devices).n  # values per slice, each its own group
    _check_count(m, x, devices, call.comm)
    out = ops.batch_norm_train(x, call.weight, call.bias, devices, 1, call.eps)
    track = running_mean is not None and m > 0  # slice 0's statistics, as device 0's buffers
    if torch.compiler.is_compiling():
        # Traced without the guard of _fused_mean_too_coarse (a data-dependent branch would
        # break the graph), and with a tensor factor for momentum=None for the same reason.
        if track:
            with torch.no_grad():
                _update_running_stats(
                    running_mean, running_var, out.mean[0], out.var[0], m, _momentum_factor(call)
                )
        return out.y
    # Eager: the guard and the running statistics in one op call.
    factor = momentum if momentum is not None else 0.0
    if momentum is None and track:
        factor = 1.0 / call.num_batches_tracked.item()
    limit = 0.0 if x.dtype == torch.float64 else _FUSED_MEAN_LIMIT
    stats = (running_mean, running_var) if track else (None, None)
    if ops.update_running_stats(*stats, out.mean, out.var, out.invstd, factor, m, limit):
        return _reference_batch_norm(call)
    return out.y


def _reference_batch_norm(call: BatchNormCall) -> Tensor:
    if not call.training and torch.compiler.is_compiling():
        # Eval under torch.compile: the reference writes through out= into channels_last
        # buffers, which Dynamo cannot trace.
        return _eval_batch_norm(call)
    # x, weight and bias go to apply() on their own: autograd tracks the tensors among its
    # arguments, not the tensors inside the call.
    return _BatchNormFunction.apply(call.x, call.weight, call.bias, call)


def check_args(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    *,
    training: bool,
    momentum: float | None,
    num_batches_tracked: Tensor | None,
    devices: int,
    comm: Communicator | None,
    group_size: int | None,
) -> int:
    """Every check a rank can make on its own, before any collective. Returns the group size."""
    if not 2 <= x.dim() <= 5:
        raise ValueError(f"BatchNorm expects 2-D to 5-D input (N, C, ...), got {x.dim()}-D")
    if not torch.is_floating_point(x):
        raise ValueError(f"BatchNorm expects floating-point input, got {x.dtype}")
    channels = x.shape[1]
    for name, t in (
        ("weight", weight),
        ("bias", bias),
        ("running_mean", running_mean),
        ("running_var", running_var),
    ):
        if t is not None and t.shape != (channels,):
            raise ValueError(
                f"BatchNorm {name} has shape {tuple(t.shape)} but the input has {channels} "
                f"channels (input shape {tuple(x.shape)})"
            )
    if not training:
        if running_mean is None or running_var is None:
            raise ValueError("BatchNorm with training=False needs running_mean and running_var")
        return 1
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if x.shape[0] % devices != 0:
        raise ValueError(
            f"batch of {x.shape[0]} samples cannot be split into {devices} equal device "
            f"slices; make the batch size a multiple of {devices}"
        )
    if running_mean is not None and momentum is None and num_batches_tracked is None:
        raise ValueError("momentum=None (cumulative average) needs num_batches_tracked")
    if comm is None:
        if group_size not in (None, 1):
            raise ValueError("group_size > 1 needs a communicator (comm)")
        return 1  # per-device BN: each slice is its own group
    group_size = devices if group_size is None else group_size
    if group_size < 1 or devices % group_size != 0:
        raise ValueError(f"group_size={group_size} must divide devices={devices}")
    if group_size != devices and comm.world_size > 1:
        raise ValueError(
            "synchronising groups of fewer slices than devices needs a world of one rank; "
            f"got group_size={group_size}, devices={devices}, world_size={comm.world_size}"
        )
    return group_size


class _BatchNormFunction(torch.autograd.Function):
    """BN / SyncBN forward and the hand-written backward of docs/batchnorm.md."""

    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, call: BatchNormCall
    ) -> Tensor:
        running_mean, running_var = call.running_mean, call.running_var
        training, devices, group_size, comm = (
            call.training,
            call.devices,
            call.group_size,
            call.comm,
        )
        compute = torch.float32 if x.dtype in HALF_TYPES else x.dtype
        if not training:
            devices = group_size = 1  # running statistics are the same for every slice
        shape = SliceShape(x, devices)
        xs = shape.view(x)
        xhat = torch.empty_like(x, dtype=compute)  # holds t = x - K first, then xhat in place
        t = shape.view(xhat)
        y = torch.empty_like(x)
        # Full-size scratch in the compute dtype: y itself unless y is fp16/bf16.
        scratch = shape.view(y if y.dtype == compute else torch.empty_like(xhat))

        if training:
            # Per-slice moments, stable for large offsets (corrected two-pass algorithm):
            pivot = xs.sum(shape.reduce, dtype=compute) / max(shape.n, 1)  # K: rounded mean
            torch.sub(xs, shape.per_slice(pivot), out=t)  # t = x - K
            sum_t = t.sum(shape.reduce)  # sum(t)
            sum_t2 = torch.mul(t, t, out=scratch).sum(shape.reduce)  # sum(t^2)
            mean, m2 = slice_moments(pivot, sum_t, sum_t2, shape.n)
            mean, var, m = global_moments(mean, m2, shape.n, call)
        else:
            pivot = running_mean.to(compute).unsqueeze(0)  # K = running mean: t = x - mu
            torch.sub(xs, shape.per_slice(pivot), out=t)
            mean, var = running_mean.double().unsqueeze(0), running_var.double().unsqueeze(0)
            m = 0

        invstd = torch.rsqrt(var + call.eps)  # 1/sqrt(var + eps), float64 (D, C)
        offset = mean - pivot.double()  # mu - K, small: t - (mu - K) = x - mu, no cancellation
        # xhat = (x - mu) * invstd = t * invstd - (mu - K) * invstd, in place over t
        scale_shift(
            t, t, shape.per_slice(invstd, compute), shape.per_slice(-offset * invstd, compute)
        )
        gamma = shape.per_slice(weight[None]) if weight is not None else None
        beta = shape.per_slice(bias[None]) if bias is not None else None
        scale_shift(scratch, t, gamma, beta)  # y = gamma * xhat + beta
        if scratch.data_ptr() != y.data_ptr():
            y.copy_(scratch.view_as(y))  # rounded once to fp16/bf16

        ctx.save_for_backward(xhat, weight)
        ctx.invstd = invstd.to(compute)
        ctx.shape, ctx.group_size, ctx.comm = shape, group_size, comm
        ctx.training, ctx.count, ctx.input_dtype = training, m, x.dtype
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
        grad_x = torch.empty_like(xhat)  # scratch for dy * xhat first
        dx = shape.view(grad_x)
        sum_dy = dy.sum(shape.reduce, dtype=xhat.dtype)  # sum(dy) per slice (D, C)
        sum_dy_xhat = torch.mul(dy, xhat_s, out=dx).sum(shape.reduce)  # sum(dy*xhat) per slice

        # d_gamma and d_beta over this process's data only: DDP averages parameter gradients.
        grad_weight = sum_dy_xhat.sum(0).to(weight.dtype) if need_weight else None  # sum dy*xhat
        grad_bias = sum_dy.sum(0).to(ctx.bias_dtype) if need_bias else None  # sum dy
        if not need_x:
            return None, grad_weight, grad_bias, None

        gamma = weight.to(xhat.dtype).unsqueeze(0) if weight is not None else 1.0
        scale = ctx.invstd * gamma  # gamma * invstd, (D, C)
        if ctx.training:
            sum_dy, sum_dy_xhat = _reduce_grad_sums(sum_dy, sum_dy_xhat, ctx.group_size, ctx.comm)
            input_grad(dy, xhat_s, scale, sum_dy, sum_dy_xhat, ctx.count, shape, out=dx)
        else:
            scale_shift(dx, dy, shape.per_slice(scale), None)  # eval: statistics are constants
        if grad_x.dtype != ctx.input_dtype:
            grad_x = grad_x.to(ctx.input_dtype)
        return grad_x, grad_weight, grad_bias, None  # the call takes no gradient


class _FusedBatchNormFunction(torch.autograd.Function):
    """SyncBN (or BN over groups of slices) on the fused kernels around the shared reduction.

    Forward: the slices' (mean, M2) from ``ops.local_stats`` -> :func:`global_moments` (the
    reference's payload and its one all_reduce) -> ``ops.forward_elemt``. Backward:
    ``ops.backward_reduce`` per slice -> :func:`_reduce_grad_sums` (the one all_reduce) ->
    ``ops.backward_elemt``. Statistics go to the kernels as (D, C) rows, one per slice.
    """

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        call: BatchNormCall,
        slice_mean: Tensor,
        slice_m2: Tensor,
    ) -> Tensor:
        n = SliceShape(x, call.devices).n
        mean, var, m = global_moments(slice_mean.double(), slice_m2.double(), n, call)
        stats_dtype = slice_mean.dtype  # the kernels' float32 (float64 for float64 input)
        invstd = torch.rsqrt(var + call.eps).to(stats_dtype)
        mean = mean.to(stats_dtype)
        y = ops.forward_elemt(x, mean, invstd, weight, bias)
        ctx.save_for_backward(x, weight, bias, mean, invstd)
        ctx.group_size, ctx.comm, ctx.count = call.group_size, call.comm, m
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        x, weight, bias, mean, invstd = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        sum_dy, sum_dy_xhat = ops.backward_reduce(grad_y, x, mean, invstd, weight, bias)
        # d_gamma and d_beta over this process's data only, as in the reference.
        grad_weight = sum_dy_xhat.sum(0).to(weight.dtype) if need_weight else None
        grad_bias = sum_dy.sum(0).to(bias.dtype) if need_bias else None
        if not need_x:
            return None, grad_weight, grad_bias, None, None, None
        sum_dy, sum_dy_xhat = _reduce_grad_sums(sum_dy, sum_dy_xhat, ctx.group_size, ctx.comm)
        count = count_tensor(ctx.count, mean)
        grad_x = ops.backward_elemt(
            grad_y, x, mean, invstd, weight, bias, sum_dy, sum_dy_xhat, count
        )
        return grad_x, grad_weight, grad_bias, None, None, None  # call, slice_mean, slice_m2


class SliceShape:
    """How (N, C, *spatial) is seen as (D, N/D, C, *spatial): views and broadcast shapes."""

    def __init__(self, x: Tensor, devices: int) -> None:
        self.devices = devices
        self.per_device_batch = x.shape[0] // devices
        self.channels = x.shape[1]
        self.spatial = tuple(x.shape[2:])
        # Values per channel in one slice; reductions run over batch and spatial dims.
        self.n = self.per_device_batch * math.prod(self.spatial)
        self.reduce = (1, *range(3, 3 + len(self.spatial)))

    def view(self, t: Tensor) -> Tensor:
        return t.reshape(self.devices, self.per_device_batch, self.channels, *self.spatial)

    def per_slice(self, stat: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """(D or 1, C) statistic -> broadcastable against the (D, N/D, C, *spatial) view."""
        stat = stat if dtype is None else stat.to(dtype)
        return stat.reshape(stat.shape[0], 1, self.channels, *([1] * len(self.spatial)))


def slice_moments(pivot: Tensor, sum_t: Tensor, sum_t2: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Per-slice mean and M2 = sum((x - mean)^2) in float64 from sums of t = x - K.

    K is the slice's own (rounded) mean, so t is centred and sum(t^2) has no cancellation;
    the correction term fixes the rounding of K (the "corrected two-pass" algorithm).
    """
    n = max(n, 1)
    sum_t, sum_t2 = sum_t.double(), sum_t2.double()
    mean = pivot.double() + sum_t / n  # mu_d = K + sum(t)/n
    m2 = (sum_t2 - sum_t * sum_t / n).clamp_min(0)  # M2_d = sum(t^2) - sum(t)^2/n
    return mean, m2


def _stats_payload(n: int, mean: Tensor, m2: Tensor) -> Tensor:
    """Per slice (D, 2C+1) float64 sums [n, sum(x) = n*mu, sum(x^2) = M2 + n*mu^2]."""
    count = mean.new_full((mean.shape[0], 1), float(n))
    return torch.cat([count, n * mean, m2 + n * mean * mean], dim=1)


def _group_sum(per_slice: Tensor, group_size: int) -> Tensor:
    """Sum (D, K) per-slice values over each group of ``group_size`` consecutive slices."""
    devices, width = per_slice.shape
    return per_slice.reshape(devices // group_size, group_size, width).sum(1)


def _per_slice(per_group: Tensor, group_size: int) -> Tensor:
    """(G, C) per-group statistics -> (G * group_size, C): each slice gets its group's."""
    return per_group if group_size == 1 else per_group.repeat_interleave(group_size, dim=0)


def global_moments(
    mean: Tensor, m2: Tensor, n: int, call: BatchNormCall
) -> tuple[Tensor, Tensor, int | Tensor]:
    """Slices' float64 mean and M2 (D, C) of n values each -> each slice's group mean and
    biased variance (D, C) and the count m: the payload, its one all_reduce, the count check,
    the running update. m is an int, or a 0-d tensor after a collective under torch.compile
    (see :func:`_global_count`)."""
    group_size, comm = call.group_size, call.comm
    payload = _group_sum(_stats_payload(n, mean, m2), group_size)
    if comm is not None:
        comm.all_reduce_sum(payload)  # the one forward collective: 2C+1 float64 values
    count, mean, var = _moments_from_payload(payload)
    m = _global_count(count, n * group_size, comm)
    _check_count(m, call.x, call.devices, comm)
    if call.running_mean is not None and (isinstance(m, Tensor) or m > 0):
        factor = _momentum_factor(call)
        _update_running_stats(call.running_mean, call.running_var, mean[0], var[0], m, factor)
    return _per_slice(mean, group_size), _per_slice(var, group_size), m


def _momentum_factor(call: BatchNormCall) -> float | Tensor:
    """The running average's factor: ``momentum``, or 1/num_batches_tracked for None (a
    tensor under torch.compile, where reading the counter back would break the graph)."""
    if call.momentum is not None:
        return call.momentum
    if torch.compiler.is_compiling():
        return 1.0 / call.num_batches_tracked
    return 1.0 / float(call.num_batches_tracked)


def _reduce_grad_sums(
    sum_dy: Tensor, sum_dy_xhat: Tensor, group_size: int, comm: Communicator | None
) -> tuple[Tensor, Tensor]:
    """Slices' sum(dy) and sum(dy*xhat) (D, C) -> their group's sums over slices and ranks."""
    payload = torch.cat([_group_sum(sum_dy, group_size), _group_sum(sum_dy_xhat, group_size)], 1)
    if comm is not None:
        comm.all_reduce_sum(payload)  # the one backward collective: 2C values
    sum_dy, sum_dy_xhat = _per_slice(payload, group_size).chunk(2, dim=1)
    return sum_dy, sum_dy_xhat


def _moments_from_payload(payload: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Reduced sums -> count (G,), mean and biased variance (G, C), all float64."""
    channels = (payload.shape[1] - 1) // 2
    count = payload[:, :1]
    sum_x, sum_x2 = payload[:, 1 : channels + 1], payload[:, channels + 1 :]
    mean = sum_x / count.clamp_min(1)  # mu = sum(x)/m
    var = (sum_x2 / count.clamp_min(1) - mean * mean).clamp_min(0)  # var = sum(x^2)/m - mu^2
    return count[:, 0], mean, var


def _global_count(count: Tensor, local_count: int, comm: Communicator | None) -> int | Tensor:
    """Values per channel that share the statistics; read back only after a real collective.

    Under torch.compile it stays the reduced 0-d float64 tensor: a read-back would end the
    graph there, so the check for one value per channel is eager-only and the running update
    and the input gradient take the count as a tensor."""
    if comm is None or comm.world_size == 1:
        return local_count
    if torch.compiler.is_compiling():
        return count[0]
    return int(count[0].item())


def count_tensor(count: int | Tensor, like: Tensor) -> Tensor:
    """The count m as the (1,) tensor of ``like``'s dtype that the fused backward takes."""
    if isinstance(count, Tensor):
        return count.to(like.dtype).reshape(1)
    return like.new_full((1,), float(count))


def _check_count(m: int | Tensor, x: Tensor, devices: int, comm: Communicator | None) -> None:
    if not isinstance(m, Tensor) and m == 1:
        where = f"over {comm.world_size} rank(s)" if comm is not None else "per device slice"
        raise ValueError(
            "Expected more than 1 value per channel when training, got 1 value per channel "
            f"{where} (input shape {tuple(x.shape)}, devices={devices}); use a larger batch"
        )


def _update_running_stats(
    running_mean: Tensor,
    running_var: Tensor,
    mean: Tensor,
    var: Tensor,
    m: int | Tensor,
    factor: float | Tensor,
) -> None:
    """running <- (1 - factor) * running + factor * batch, with the unbiased variance.

    A tensor ``m`` (torch.compile) may be 0 (every rank empty): the factor is masked to 0
    instead of a branch on the count."""
    if isinstance(m, Tensor):
        factor = (factor * (m > 0)).to(running_mean.dtype)
        unbiased_var = var * (m / (m - 1).clamp_min(1))
    else:
        unbiased_var = var * (m / (m - 1))  # var * m/(m-1), m = the global count
    running_mean.lerp_(mean.to(running_mean.dtype), factor)
    running_var.lerp_(unbiased_var.to(running_var.dtype), factor)


def input_grad(
    dy: Tensor,
    xhat: Tensor,
    scale: Tensor,
    sum_dy: Tensor,
    sum_dy_xhat: Tensor,
    count: int | Tensor,
    shape: SliceShape,
    out: Tensor | None = None,
) -> Tensor:
    """Training-mode BatchNorm's gradient of the input, per slice (``dy``, ``xhat`` and
    ``out`` in ``shape``'s (D, N/D, C, ...) view; ``scale`` and the sums (D, C)):

        dx = scale/m * (m*dy - sum(dy) - xhat*sum(dy*xhat)), evaluated as
        dx = scale*dy - scale*sum(dy)/m - xhat * scale*sum(dy*xhat)/m

    with ``scale`` = gamma * invstd and ``m`` = ``count`` values per channel. Batch
    Renormalization's is the same with scale = gamma * r / sigma_B (docs/batchnorm.md §9).
    Returns ``out``, a new tensor when it is None."""
    m = count.clamp_min(1) if isinstance(count, Tensor) else max(count, 1)
    dx = scale_shift(out, dy, shape.per_slice(scale), shape.per_slice(-scale * sum_dy / m))
    dx.addcmul_(xhat, shape.per_slice(-scale * sum_dy_xhat / m))
    return dx


def scale_shift(
    out: Tensor | None, t: Tensor, scale: Tensor | None, shift: Tensor | None
) -> Tensor:
    """out = t * scale + shift with per-channel scale and shift (``None``: 1 and 0); returns
    out, a new tensor when ``out`` is None.

    One addcmul pass when channels are the innermost dimension (channels_last, 2-D input);
    otherwise a multiply and an add, because on CPU an elementwise op vectorises over at most
    one operand that is constant along the innermost dimension, and addcmul would have two.
    """
    into = {} if out is None else {"out": out}
    if scale is not None and shift is not None and t.stride(2) == 1:
        return torch.addcmul(shift, t, scale, **into)
    if scale is not None:
        out = torch.mul(t, scale, **into)
    elif out is None:
        out = t.clone()
    elif out.data_ptr() != t.data_ptr():
        out.copy_(t)
    if shift is not None:
        out.add_(shift)
    return out
