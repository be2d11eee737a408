"""Communicators: the only thing that differs between real DDP and the emulation of N devices.

A norm layer computes statistics per device slice and hands a small payload to a
communicator, which sums it over the ranks that share statistics. Real runs use a
``torch.distributed`` process group; a single process (or a group of one) uses the no-op
:class:`LocalCommunicator`. The math in :mod:`syncbn_lab.nn.functional` never looks at which
one it got.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from syncbn_lab.traffic import TRAFFIC

__all__ = [
    "Communicator",
    "LocalCommunicator",
    "ProcessGroupCommunicator",
    "communicator_for",
    "subgroup_for",
]


class Communicator:
    """Sums a tensor over the ranks that share batch statistics."""

    world_size: int = 1

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum ``t`` over the ranks in place and return it."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"


class LocalCommunicator(Communicator):
    """World of one rank: the sum over ranks is the tensor itself."""

    world_size = 1

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        return t


class ProcessGroupCommunicator(Communicator):
    """``torch.distributed.all_reduce(SUM)`` over ``process_group`` (``None`` = WORLD)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        # Counted in eager runs only: inside a compiled graph no Python runs per call (and
        # Dynamo refuses the counter's mutation inside an autograd.Function).
        if not torch.compiler.is_compiling():
            TRAFFIC.add("norm_statistics", t)
        # Looked up at call time so tests can count collectives by wrapping dist.all_reduce.
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
        return t


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def communicator_for(process_group: dist.ProcessGroup | None = None) -> Communicator:
    """The communicator for ``process_group``: local without distributed or in a group of one."""
    if not _distributed():
        return LocalCommunicator()
    if process_group is not None and dist.get_rank(process_group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the SyncBatchNorm process group; "
            "give each rank the group it belongs to"
        )
    if dist.get_world_size(process_group) == 1:
        return LocalCommunicator()
    return ProcessGroupCommunicator(process_group)


# (world_size, group_size) -> (the WORLD group it was made under, this rank's subgroup)
_SUBGROUPS: dict[tuple[int, int], tuple[object, dist.ProcessGroup]] = {}


def subgroup_for(group_size: int) -> dist.ProcessGroup | None:
    """This rank's group among consecutive groups of ``group_size`` ranks.

    Collective: every rank must call it (``dist.new_subgroups`` creates all groups on all
    ranks). Groups are created once per (world_size, group_size) and cached; the cache is
    rebuilt when the default process group has been destroyed and re-created. Returns
    ``None`` (meaning "no synchronisation needed beyond this process") without distributed.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not _distributed():
        return None
    world_size = dist.get_world_size()
    if world_size % group_size != 0:
        raise ValueError(
            f"SyncBatchNorm group_size={group_size} does not divide the world size "
            f"{world_size}; pick a divisor of {world_size}"
        )
    key = (world_size, group_size)
    world = dist.group.WORLD
    cached = _SUBGROUPS.get(key)
    if cached is None or cached[0] is not world:
        subgroup, _ = dist.new_subgroups(group_size=group_size)
        cached = (world, subgroup)
        _SUBGROUPS[key] = cached
    return cached[1]
