"""One process with exactly the numerics of N devices.

What makes the emulation exact lives elsewhere and is only put together here:

- the batch: slice d of every local batch is what rank d of an N-rank DDP run gets
  (``sampling.DeviceBatchSampler``);
- normalisation: every BatchNorm layer was built with ``device_slices = N`` and computes statistics
  per slice; SyncBatchNorm sums the slices' statistics (``syncbn_lab.nn``), the sum that the
  all_reduce does under DDP;
- the gradient: the loss is the mean over the local batch, i.e. the mean over devices of the
  per-device mean losses (equal slices), which is what DDP's gradient all-reduce averages;
- running statistics: the layers keep device 0's, which is what DDP keeps with
  ``broadcast_buffers`` (rank 0's buffers are copied to the others before each synced
  forward, never the other way round) and what DataParallel keeps (replica 0 updates the
  module's buffers in place).

:class:`EmulatedDevices` adds the rest of DDP's behaviour that is visible in the results:
``no_sync`` for gradient accumulation (nothing to skip, but it drives the buffer broadcast as
DDP does) and, for ``parallel.dist_bn=reduce``, the running statistics of devices 1..N-1,
which per-device BatchNorm does not keep (only their mean over devices is ever observable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from syncbn_lab.nn.sync_batchnorm import BatchNorm, SyncBatchNorm


class DeviceRunningStats:
    """Running mean/var of devices 1..N-1 for one per-device BatchNorm layer.

    Updated by a forward hook from the per-slice statistics of the layer's input, exactly as
    that device's own layer would update its buffers (unbiased variance over the slice,
    ``momentum`` or the cumulative average for ``momentum=None``). Device 0 is the layer's
    own buffers.
    """

    def __init__(self, layer: BatchNorm):
        self.layer = layer
        others = layer.device_slices - 1
        self.mean = layer.running_mean.detach().clone().unsqueeze(0).repeat(others, 1)
        self.var = layer.running_var.detach().clone().unsqueeze(0).repeat(others, 1)
        self.handle = layer.register_forward_hook(self._update)

    @torch.no_grad()
    def _update(self, layer: BatchNorm, args: tuple, output: Tensor) -> None:
        if not layer.training:
            return
        x = args[0].detach()
        devices = layer.device_slices
        slices = x.reshape(devices, x.shape[0] // devices, *x.shape[1:]).transpose(1, 2)
        slices = slices.reshape(devices, x.shape[1], -1)[1:].double()  # devices 1..N-1
        var, mean = torch.var_mean(slices, dim=2, correction=1)
        if layer.momentum is None:
            factor = 1.0 / float(layer.num_batches_tracked)
        else:
            factor = layer.momentum
        self.mean.lerp_(mean.to(self.mean.dtype), factor)
        self.var.lerp_(var.to(self.var.dtype), factor)

    def broadcast_from_device0(self) -> None:
        self.mean.copy_(self.layer.running_mean.unsqueeze(0).expand_as(self.mean))
        self.var.copy_(self.layer.running_var.unsqueeze(0).expand_as(self.var))

    @torch.no_grad()
    def reduce_mean(self) -> None:
        """Every device's running statistics become their mean over the N devices."""
        layer, devices = self.layer, self.layer.device_slices
        layer.running_mean.copy_((layer.running_mean + self.mean.sum(0)) / devices)
        layer.running_var.copy_((layer.running_var + self.var.sum(0)) / devices)
        self.broadcast_from_device0()

    def remove(self) -> None:
        self.handle.remove()


class EmulatedDevices(nn.Module):
    """The model of one process emulating ``devices`` devices, with DDP's step semantics.

    ``forward`` is the module's. With ``broadcast_buffers`` every device starts a synced
    step from device 0's running statistics, in exactly the forwards where DDP broadcasts
    buffers (the first forward after a synced one; not inside ``no_sync`` accumulation).
    That is only observable through the running statistics of devices 1..N-1, kept when
    ``track_all_devices`` (for ``dist_bn=reduce``).
    """

    def __init__(
        self,
        module: nn.Module,
        devices: int,
        broadcast_buffers: bool = True,
        track_all_devices: bool = False,
    ):
        super().__init__()
        self.module = module
        self.devices = devices
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True  # as DDP: the first forward syncs buffers
        self.device_stats: list[DeviceRunningStats] = []
        if track_all_devices and devices > 1:
            self.device_stats = [
                DeviceRunningStats(m)
                for m in module.modules()
                if isinstance(m, BatchNorm)
                and not isinstance(m, SyncBatchNorm)  # SyncBN: every device has the same stats
                and m.track_running_stats
                and getattr(m, "device_slices", 1) == devices
            ]

    def forward(self, *args, **kwargs):
        if self.require_forward_param_sync and self.broadcast_buffers:
            for stats in self.device_stats:
                stats.broadcast_from_device0()
        out = self.module(*args, **kwargs)
        self.require_forward_param_sync = (
            torch.is_grad_enabled() and self.require_backward_grad_sync
        )
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's no_sync: the gradient sum over devices happens anyway; buffers are not
        broadcast before the next forward (as in DDP)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def broadcast_buffers_from_device0(self) -> None:
        for stats in self.device_stats:
            stats.broadcast_from_device0()

    def reduce_buffers(self) -> None:
        for stats in self.device_stats:
            stats.reduce_mean()
