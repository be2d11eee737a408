"""A Lightning ``LayerSync`` plugin that gives a model this package's SyncBatchNorm.

``Trainer(strategy="ddp", accelerator="cpu", devices=2, plugins=[SyncBatchNormPlugin()])``
trains with SyncBatchNorm over gloo, where ``sync_batchnorm=True`` fails on CPU (torch's DDP
refuses ``torch.nn.SyncBatchNorm`` on a CPU module); on GPUs it synchronises as torch's does,
with uneven and empty ranks allowed. Lightning calls :meth:`~SyncBatchNormPlugin.apply` before
it wraps the model in DDP and :meth:`~SyncBatchNormPlugin.revert` when fitting ends, which
gives the layers their original classes back (torch's plugin reverts to a generic
``_BatchNormXd``).

The plugin is a ``LayerSync`` of each Lightning namespace that is installed
(``pytorch_lightning``, ``lightning``): ``pip install 'syncbn-lab[lightning]'``.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist
from torch import nn

from syncbn_lab.nn.convert import convert_sync_batchnorm, revert_sync_batchnorm

__all__ = ["SyncBatchNormPlugin"]


def _layer_sync_classes() -> tuple[type, ...]:
    """``LayerSync`` of every installed Lightning namespace (the Trainer checks isinstance)."""
    found = []
    for module in ("pytorch_lightning.plugins", "lightning.pytorch.plugins"):
        try:
            found.append(importlib.import_module(module).LayerSync)
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "syncbn_lab.integrations.lightning needs Lightning: pip install 'syncbn-lab[lightning]'"
        )
    return tuple(found)


class SyncBatchNormPlugin(*_layer_sync_classes()):
    """Converts the model's BatchNorm layers with :func:`syncbn_lab.nn.convert_sync_batchnorm`.

    ``group_size``: ranks per synchronisation group (consecutive ranks; None = the whole
    world); ``process_group``: an explicit group instead, created by the caller after the
    process group is initialised. At most one of the two.
    """

    def __init__(
        self, group_size: int | None = None, process_group: dist.ProcessGroup | None = None
    ) -> None:
        if group_size is not None and process_group is not None:
            raise ValueError(
                "give SyncBatchNormPlugin either group_size or process_group, not both"
            )
        self.group_size = group_size
        self.process_group = process_group

    def apply(self, model: nn.Module) -> nn.Module:
        return convert_sync_batchnorm(
            model, process_group=self.process_group, group_size=self.group_size
        )

    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)
