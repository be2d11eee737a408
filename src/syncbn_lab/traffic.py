"""Bytes this process hands to collectives while it trains, counted where they are sent.

What a user pays for SyncBN is communication, so DDP runs count it instead of computing it
from shapes. Three kinds, each counted at the call that sends it:

- ``gradients``: DDP's gradient buckets, counted by a comm hook that then all-reduces the
  bucket exactly as DDP's default hook does (divide by the world size, sum);
- ``buffers``: DDP's broadcast of rank 0's buffers (BN running statistics) before each
  forward, under ``parallel.broadcast_buffers=true``;
- ``norm_statistics``: SyncBatchNorm's all-reduces (one per layer and direction), counted in
  :class:`syncbn_lab.nn.comm.ProcessGroupCommunicator`.

The figure is the payload each rank passes in (its own tensor's bytes). On the wire a ring
all-reduce sends about 2 (N - 1) / N times that per rank; a broadcast is sent by the root.
Evaluation, PreciseBN and the loop's loss logging also communicate; the trainer reads the
count when training ends, before PreciseBN, and the loop's logging collective is not one
of the three kinds.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

KINDS = ("gradients", "buffers", "norm_statistics")


class Traffic:
    """Running byte and call counts per kind, for one process."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(KINDS, 0)
        self.calls = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, tensors: Tensor | Iterable[Tensor]) -> None:
        """Count one collective call of ``kind`` sending ``tensors``."""
        if isinstance(tensors, Tensor):
            tensors = (tensors,)
        self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)
        self.calls[kind] += 1

    def reset(self) -> None:
        self.__init__()

    def per_step(self, steps: int) -> dict[str, float]:
        """``comm_bytes_per_step`` (all kinds) and ``comm_<kind>_bytes_per_step`` over ``steps``."""
        steps = max(steps, 1)
        result = {f"comm_{kind}_bytes_per_step": self.bytes[kind] / steps for kind in KINDS}
        result["comm_bytes_per_step"] = sum(self.bytes.values()) / steps
        result["comm_calls_per_step"] = sum(self.calls.values()) / steps
        return result


TRAFFIC = Traffic()
"""This process's counts (a DDP rank is one process)."""


def count_ddp_traffic(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Make ``ddp`` count its gradient buckets and buffer broadcasts into :data:`TRAFFIC`."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counting_allreduce(process_group, bucket):
        TRAFFIC.add("gradients", bucket.buffer())
        return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, counting_allreduce)  # None: DDP's own process group

    broadcast = ddp._distributed_broadcast_coalesced  # the one call behind buffer syncs

    def counting_broadcast(tensors, buffer_size, authoritative_rank=0):
        TRAFFIC.add("buffers", tensors)
        return broadcast(tensors, buffer_size, authoritative_rank)

    ddp._distributed_broadcast_coalesced = counting_broadcast
