"""Uneven inputs under DDP with SyncBatchNorm: a rank out of data steps on an empty batch.

``torch.distributed.algorithms.Join`` lets ranks with fewer batches keep the others going:
each rank that has joined runs its joinables' ``main_hook`` once per step of the ranks that
still train, and each hook must issue the collectives of that step in the order the training
ranks issue them. DDP's own hook shadows the gradient buckets' all_reduce, but a SyncBN step
has more: one all_reduce per layer in the forward, one per layer in the backward, and DDP's
bucket all_reduces start between those of the backward as buckets fill. No hook per layer can
reproduce that order; a hook that runs the step itself does.

:class:`JoinableStep` is that hook's Joinable. A rank with data calls it with its batch; a
rank that has joined runs the same step on an empty batch. SyncBatchNorm takes part with a
count of zero (its statistics are those of the batches that exist), DDP all_reduces zero
gradients, and the optimizer steps on every rank with the same averaged gradients, so the
ranks stay equal (DDP's own join leaves a joined rank's parameters and optimizer state
behind and broadcasts the parameters at the end). Put it in ``Join`` instead of the DDP model:

    step = JoinableStep(train_step, empty=(images[:0], labels[:0]))
    with Join([step]):
        for images, labels in loader:  # a different number of batches on each rank
            step(images, labels)

The step must be defined on an empty batch: average the loss as ``sum / max(count, 1)``
(``F.cross_entropy``'s mean over no samples is NaN). DDP divides the summed gradients by the
world size, joined ranks included, as DDP's own join does by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

__all__ = ["JoinableStep"]


class _EmptyStep(JoinHook):
    def __init__(self, joinable: JoinableStep) -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        self.joinable.step(*self.joinable.empty)


class JoinableStep(Joinable):
    """A training step that ranks out of data keep running on an empty batch under ``Join``.

    Args:
        step: called as ``step(*batch)``: forward, backward and optimizer step (its
            collectives: DDP's and SyncBatchNorm's).
        empty: the batch a joined rank steps on, e.g. ``(images[:0], labels[:0])``.
        device: the device of Join's own all_reduce (the process group's: CPU for gloo).
        process_group: the group Join counts the ranks still training over (None: WORLD).
    """

    def __init__(
        self,
        step: Callable[..., Any],
        empty: tuple,
        device: torch.device | str = "cpu",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.step, self.empty = step, tuple(empty)
        self._device = torch.device(device)
        self._process_group = process_group if process_group is not None else dist.group.WORLD

    def __call__(self, *batch: Any) -> Any:
        """One step on this rank's ``batch`` (tells Join that this rank still trains)."""
        Join.notify_join_context(self)
        return self.step(*batch)

    def join_hook(self, **kwargs) -> JoinHook:
        return _EmptyStep(self)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return self._process_group
