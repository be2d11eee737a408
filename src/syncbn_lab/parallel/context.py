"""What one training process knows about its place in the (real or emulated) device set."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    """Rank, world and device of this process.

    ``world_size`` counts processes; ``slices_per_process`` counts the device slices one
    process's batch holds (N under ``parallel=emulated`` and ``dp``, else 1). Slice ``d`` of
    process ``r`` is global device ``r * slices_per_process + d``.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    slices_per_process: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def total_devices(self) -> int:
        return self.world_size * self.slices_per_process

    @property
    def local_device_ranks(self) -> list[int]:
        first = self.rank * self.slices_per_process
        return list(range(first, first + self.slices_per_process))

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over processes in place (a no-op in one process)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor
