"""The `bn` config group as a registry: name -> factory(num_features) -> norm module.

| name         | module                                   | statistics                       |
|--------------|------------------------------------------|----------------------------------|
| `bn`         | torch.nn.BatchNorm2d (or our BatchNorm    | each device's slice of the batch |
|              | when one process emulates N devices)     |                                  |
| `sync`       | syncbn_lab.nn.SyncBatchNorm              | the global batch, any backend    |
| `torch_sync` | torch.nn.SyncBatchNorm                   | the global batch, CUDA only      |
| `brn`        | syncbn_lab.nn.BatchRenorm (Ioffe 2017)   | each device's slice, corrected   |
|              |                                          | towards the running statistics   |
| `gn`         | syncbn_lab.nn.GroupNorm (torch's, kept   | per sample, batch-independent    |
|              | in NCHW for its CPU kernel)              |                                  |
"""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig
from torch import nn

NormFactory = Callable[[int], nn.Module]
NAMES = ("bn", "sync", "torch_sync", "brn", "gn")


def norm_layer(
    cfg: DictConfig, emulated_devices: int = 1, training_batches: int | None = None
) -> NormFactory:
    """Return the factory for ``cfg.name``.

    ``emulated_devices`` > 1 means one process stands in for that many devices; per-device
    BatchNorm then needs our implementation, which normalises each device slice of the batch
    separately (torch's BatchNorm2d would normalise the whole local batch at once).
    ``training_batches``: training forward passes of the whole run (optimizer steps times
    trainer.accumulate); bn=brn needs it to turn its schedule's fractions into batches.
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
    if name == "brn":
        if training_batches is None:
            raise ValueError("bn=brn needs the run's training_batches for its rmax/dmax schedule")
        from syncbn_lab.nn.batch_renorm import BatchRenorm

        schedule = {
            "rmax": cfg.rmax,
            "dmax": cfg.dmax,
            "warmup_batches": round(cfg.warmup * training_batches),
            "ramp_batches": round(cfg.ramp * training_batches),
        }
        return lambda c: BatchRenorm(
            c, eps=eps, momentum=momentum, devices=emulated_devices, **schedule
        )
    if name == "gn":
        groups = cfg.groups

        from syncbn_lab.nn.group_norm import GroupNorm

        def group_norm(c: int) -> nn.GroupNorm:
            if c % min(groups, c):
                raise ValueError(f"bn.groups={groups} does not divide {c} channels; pick a divisor")
            return GroupNorm(min(groups, c), c, eps=eps)

        return group_norm
    raise ValueError(f"unknown bn '{name}'; choose one of: {', '.join(NAMES)}")


def normalization_batch_size(
    cfg: DictConfig, per_device_batch_size: int, parallel: DictConfig
) -> int:
    """Images whose statistics one norm layer shares in training: the per-device batch for
    bn and brn, per-device x group_size for sync with groups, the global batch (per-device x
    devices) for sync and torch_sync, 1 for gn (per-sample statistics)."""
    name = cfg.name
    if name in ("bn", "brn"):
        return per_device_batch_size
    if name in ("sync", "torch_sync"):
        group_size = cfg.get("group_size")
        return per_device_batch_size * min(group_size or parallel.devices, parallel.devices)
    if name == "gn":
        return 1
    raise ValueError(f"unknown bn '{name}'; choose one of: {', '.join(NAMES)}")
