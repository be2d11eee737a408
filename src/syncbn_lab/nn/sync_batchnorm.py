"""BatchNorm (per device) and SyncBatchNorm (global batch) modules over ``functional``'s math.

``impl`` picks the arithmetic of a training step: "reference" (torch ops), "fused" (the
kernels of syncbn_lab._C) or "auto" (fused where built, else the reference; one warning line
says which). Statistics, payloads and collectives are the same for all three.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import init
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from syncbn_lab.nn import functional as F
from syncbn_lab.nn.comm import Communicator, LocalCommunicator, communicator_for, subgroup_for

# Whether torch's own BatchNorm takes `bias` (older releases, 2.11 among them, do not).
TORCH_BN_TAKES_BIAS = "bias" in inspect.signature(_NormBase.__init__).parameters

__all__ = ["BatchNorm", "SyncBatchNorm", "SyncBatchNormAct", "is_sync_batchnorm"]


def _check_impl(impl: str) -> str:
    F.check_impl(impl)
    if impl == "fused":
        F.check_fused_available()  # at construction: the one-line error, before any training
    return impl


class BatchNorm(_BatchNorm):
    """Per-device BatchNorm for 2-D to 5-D input, through ``functional.batch_norm``.

    Equal to ``torch.nn.BatchNorm1d/2d/3d`` with ``device_slices == 1``. With
    ``device_slices = D`` (set by the single-process emulation of D devices) the batch is D
    equal consecutive slices and each slice is normalised with its own statistics, exactly as
    D replicas under DataParallel or DDP would do; running statistics follow slice 0 (device
    0's buffers are the ones that survive). State dict keys are those of ``torch.nn.BatchNorm2d``.

    ``impl``: "auto" (default: the fused kernels when syncbn_lab._C is built and takes the
    input, else the reference), "fused" (raises when the extension is missing) or "reference".
    Eval mode runs the reference under "reference", torch's batch_norm otherwise.
    ``device_slices``: how many devices' slices one forward call holds (the single-process
    emulation passes ``parallel.devices``; 1 otherwise).
    """

    device_slices: int
    impl: str

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
        impl: str = "auto",
        device_slices: int = 1,
    ) -> None:
        # Older torch releases (2.11 among them) take no `bias` argument: affine BN has one.
        kwargs = {"bias": bias} if TORCH_BN_TAKES_BIAS else {}
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype, **kwargs
        )
        if affine and not bias and not TORCH_BN_TAKES_BIAS:
            self.register_parameter("bias", None)
        if not isinstance(device_slices, int) or device_slices < 1:
            raise ValueError(
                f"{type(self).__name__} device_slices must be a positive integer, got "
                f"{device_slices}"
            )
        self.device_slices = device_slices
        self.impl = _check_impl(impl)

    def reset_parameters(self) -> None:
        """torch's, for every release: ones for the weight, zeros for a bias if there is one."""
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
            if self.bias is not None:
                init.zeros_(self.bias)

    def _check_input_dim(self, input: Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(
                f"{type(self).__name__} expects 2-D to 5-D input (N, C, ...), "
                f"got {input.dim()}-D input of shape {tuple(input.shape)}"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__}({self.num_features}) got input with {input.shape[1]} "
                f"channels (shape {tuple(input.shape)}); channels are dim 1"
            )

    def _synchronisation(self) -> tuple[Communicator | None, int | None]:
        """(communicator, slices per group) for a training step; per-device BN has none."""
        return None, None

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)  # before any collective, on every rank
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        # Batch statistics in training, and in eval when there are no running statistics.
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep_buffers = not self.training or self.track_running_stats
        comm, group_size = self._synchronisation() if self.training else (None, None)
        return F.batch_norm(
            input,
            self.weight,
            self.bias,
            self.running_mean if keep_buffers else None,
            self.running_var if keep_buffers else None,
            training=use_batch_stats,
            momentum=self.momentum,
            eps=self.eps,
            num_batches_tracked=self.num_batches_tracked,
            devices=self.device_slices,
            comm=comm,
            group_size=group_size,
            impl=self.impl,
        )

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if self.device_slices != 1:
            extra += f", device_slices={self.device_slices}"
        if self.impl != "auto":
            extra += f", impl={self.impl!r}"
        return extra


class SyncBatchNorm(BatchNorm):
    """BatchNorm over the global batch; a drop-in for ``torch.nn.SyncBatchNorm`` that also
    runs on CPU (gloo), with uneven or empty per-rank batches, and in a single process.

    What is synchronised, in training, per channel: the count m, the sum of x and the sum of
    x^2 in the forward pass (so the mean and biased variance that normalise the input are
    those of the global batch), and sum(dy) and sum(dy * xhat) in the backward pass (so the
    input gradient is that of the global batch). Nothing else: the gradients of weight and
    bias are sums over this process's own data (DDP averages them like any parameter), and
    the running statistics are updated on every rank from the same global statistics (with
    the unbiased variance var * m / (m - 1)), so they stay equal across the group.

    Communication per layer and training step, independent of the world size W:

    - forward: one all_reduce of 2C+1 float64 values (count, sum x, sum x^2) = (2C+1)*8 bytes;
    - backward: one all_reduce of 2C values in the compute dtype (float32 for fp32/fp16/bf16
      input) = 2C*4 bytes, skipped like torch when the input needs no gradient.

    torch.nn.SyncBatchNorm all_gathers W*(2C+1) values (mean, invstd, count of every rank)
    in forward instead. Eval mode normalises with the running statistics and communicates
    nothing; without running statistics it normalises each rank with its own batch, as
    torch does.

    Who synchronises with whom: all ranks of ``process_group`` (default WORLD), or
    consecutive groups of ``group_size`` devices (``group_size`` counts devices: ranks times
    the ``device_slices`` each rank emulates). Without an initialised process group, or in a
    group of one rank, it is BatchNorm over all ``devices`` slices merged.

    Args:
        num_features, eps, momentum, affine, track_running_stats, process_group, device,
        dtype, bias: as ``torch.nn.SyncBatchNorm`` (``momentum=None`` = cumulative average).
        group_size: synchronise within consecutive groups of this many devices; exclusive
            with ``process_group``. The subgroups are created (collectively, on all ranks) at
            the first training step and cached.
        impl: "auto" | "reference" | "fused": who computes the per-slice statistics and the
            elementwise passes in training (see :class:`BatchNorm`). The payloads and
            collectives above are the same for all three. With "fused" in one process and
            one slice per group it is a single op, so ``torch.compile(fullgraph=True)``
            traces it without graph breaks.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device=None,
        dtype=None,
        *,
        group_size: int | None = None,
        impl: str = "auto",
        bias: bool = True,
        device_slices: int = 1,
    ) -> None:
        super().__init__(
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            device,
            dtype,
            bias=bias,
            impl=impl,
            device_slices=device_slices,
        )
        self.set_group(process_group, group_size)

    def set_group(
        self, process_group: dist.ProcessGroup | None = None, group_size: int | None = None
    ) -> None:
        """Who synchronises with whom from the next training step on (see the class)."""
        if process_group is not None and group_size is not None:
            raise ValueError("give SyncBatchNorm either process_group or group_size, not both")
        if group_size is not None and group_size < 1:
            raise ValueError(f"SyncBatchNorm group_size must be >= 1, got {group_size}")
        self.process_group = process_group
        self.group_size = group_size

    def _synchronisation(self) -> tuple[Communicator | None, int | None]:
        if self.group_size is None:
            return communicator_for(self.process_group), None
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed or dist.get_world_size() == 1:
            return LocalCommunicator(), self.group_size  # groups of emulated devices
        if self.group_size % self.device_slices == 0:  # each group spans whole ranks
            return communicator_for(subgroup_for(self.group_size // self.device_slices)), None
        if self.device_slices % self.group_size == 0:  # groups inside each rank's slices
            return LocalCommunicator(), self.group_size
        raise ValueError(
            f"SyncBatchNorm group_size={self.group_size} neither divides nor is a multiple "
            f"of device_slices={self.device_slices} per rank"
        )

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if self.group_size is not None:
            extra += f", group_size={self.group_size}"
        return extra


class SyncBatchNormAct(SyncBatchNorm):
    """SyncBatchNorm followed by its ``drop`` and then its ``act`` module (both Identity
    unless given): what ``convert_sync_batchnorm`` makes of timm's ``BatchNormAct2d``, with
    the same submodules and state-dict keys. Takes SyncBatchNorm's arguments plus ``drop``
    and ``act``."""

    def __init__(
        self, *args, drop: nn.Module | None = None, act: nn.Module | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()

    def forward(self, input: Tensor) -> Tensor:
        return self.act(self.drop(super().forward(input)))


def is_sync_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` normalises over the global batch: this package's SyncBatchNorm (any
    subclass) or ``torch.nn.SyncBatchNorm``. Ours is not a subclass of torch's (DDP refuses
    torch's on CPU modules), so ``isinstance(m, torch.nn.SyncBatchNorm)`` misses it."""
    return isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm))
