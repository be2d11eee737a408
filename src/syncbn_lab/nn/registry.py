"""The `bn` config group as a registry: name -> factory(num_features) -> norm module.

| name         | module                                   | statistics                       |
|--------------|------------------------------------------|----------------------------------|
| `bn`         | torch.nn.BatchNorm2d (or our BatchNorm    | each device's slice of the batch |
|              | when one process emulates N devices)     |                                  |
| `sync`       | syncbn_lab.nn.SyncBatchNorm              | the global batch, any backend    |
| `torch_sync` | torch.nn.SyncBatchNorm                   | the global batch, CUDA only      |
| `gn`         | torch.nn.GroupNorm                       | per sample, batch-independent    |
"""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig
from torch import nn

NormFactory = Callable[[int], nn.Module]
NAMES = ("bn", "sync", "torch_sync", "gn")


def norm_layer(cfg: DictConfig, emulated_devices: int = 1) -> NormFactory:
    """Return the factory for ``cfg.name``.

    ``emulated_devices`` > 1 means one process stands in for that many devices; per-device
    BatchNorm then needs our implementation, which normalises each device slice of the batch
    separately (torch's BatchNorm2d would normalise the whole local batch at once).
    """
    name = cfg.name
    momentum = cfg.get("momentum", 0.1)
    eps = cfg.get("eps", 1e-5)
    if name == "bn":
        if emulated_devices == 1:
            return lambda c: nn.BatchNorm2d(c, eps=eps, momentum=momentum)
        from syncbn_lab.nn.sync_batchnorm import BatchNorm

        return lambda c: BatchNorm(c, eps=eps, momentum=momentum, devices=emulated_devices)
    if name == "sync":
        from syncbn_lab.nn.sync_batchnorm import SyncBatchNorm

        group_size, impl = cfg.get("group_size"), cfg.get("impl", "auto")
        return lambda c: SyncBatchNorm(
            c,
            eps=eps,
            momentum=momentum,
            group_size=group_size,
            impl=impl,
            devices=emulated_devices,
        )
    if name == "torch_sync":
        return lambda c: nn.SyncBatchNorm(c, eps=eps, momentum=momentum)
    if name == "gn":
        groups = cfg.groups

        def group_norm(c: int) -> nn.GroupNorm:
            if c % min(groups, c):
                raise ValueError(f"bn.groups={groups} does not divide {c} channels; pick a divisor")
            return nn.GroupNorm(min(groups, c), c, eps=eps)

        return group_norm
    raise ValueError(f"unknown bn '{name}'; choose one of: {', '.join(NAMES)}")
