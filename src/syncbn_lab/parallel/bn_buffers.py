"""Which BN running statistics evaluation and checkpoints use: ``parallel.dist_bn``.

Every device keeps its own running statistics while training (DDP's ``broadcast_buffers``
copies rank 0's to the others before each synced forward). Before an evaluation the ranks
must agree, or each would evaluate its share of the data with different statistics:

- ``none``: every rank evaluates with rank 0's statistics, the ones the checkpoint holds;
  no rank's own buffers change (a temporary copy), training continues as it would have;
- ``broadcast``: rank 0's statistics are copied into every rank's buffers (timm's option);
- ``reduce``: every rank's buffers become the mean over ranks (timm's option).

``none`` and ``broadcast`` evaluate the same numbers; they differ only in what ranks > 0
carry on training with, which only ``reduce`` could ever observe. Under emulation the same
three act on the devices' statistics (see ``parallel.emulated``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn_lab.parallel.emulated import EmulatedDevices


class BNBuffers:
    """One device, or replicas rebuilt from one module each step (DataParallel): nothing."""

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        yield

    def adopt_module_buffers(self) -> None:
        """The module's buffers were set on every rank alike (PreciseBN, a resumed
        checkpoint): make every device hold them."""


class DistributedBNBuffers(BNBuffers):
    """dist_bn for DDP ranks, over the default process group."""

    def __init__(self, module: nn.Module, dist_bn: str):
        self.dist_bn = dist_bn
        layers = [m for m in module.modules() if isinstance(m, _BatchNorm)]
        self.stats = [b for m in layers for b in (m.running_mean, m.running_var) if b is not None]
        self.counters = [m.num_batches_tracked for m in layers if m.num_batches_tracked is not None]

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        if not self.stats or not dist.is_initialized():
            yield
            return
        if self.dist_bn == "reduce":
            _collective(self.stats, lambda t: dist.all_reduce(t), scale=1 / dist.get_world_size())
            yield
            return
        saved = [b.clone() for b in self.stats + self.counters] if self.dist_bn == "none" else []
        _collective(self.stats, lambda t: dist.broadcast(t, 0))
        _collective(self.counters, lambda t: dist.broadcast(t, 0))
        try:
            yield
        finally:
            for buffer, value in zip(self.stats + self.counters, saved, strict=False):
                buffer.copy_(value)


class EmulatedBNBuffers(BNBuffers):
    """dist_bn for the devices of one emulating process."""

    def __init__(self, model: EmulatedDevices, dist_bn: str):
        self.model, self.dist_bn = model, dist_bn

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        if self.dist_bn == "reduce":
            self.model.reduce_buffers()
        elif self.dist_bn == "broadcast":
            self.model.broadcast_buffers_from_device0()
        yield  # none: the layers' buffers are device 0's already

    def adopt_module_buffers(self) -> None:
        self.model.broadcast_buffers_from_device0()


@torch.no_grad()
def _collective(buffers: list[Tensor], op, scale: float | None = None) -> None:
    """Run ``op`` on all ``buffers`` at once (one flat tensor per dtype), then copy back."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    for group in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in group])
        op(flat)
        if scale is not None:
            flat.mul_(scale)
        offset = 0
        for b in group:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
