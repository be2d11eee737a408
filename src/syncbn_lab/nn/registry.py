"""The `bn` config group's layers: ``norm_layer(cfg.bn, device_slices)`` asks the variant
spec (:mod:`syncbn_lab.variants`) for its factory ``channels -> norm module``."""

from __future__ import annotations

from omegaconf import DictConfig

from syncbn_lab.variants import GROUP, VARIANTS, NormFactory, NormVariant, register, variant

__all__ = [
    "GROUP",
    "VARIANTS",
    "NormFactory",
    "NormVariant",
    "norm_layer",
    "normalization_batch_size",
    "register",
    "variant",
]


def norm_layer(
    cfg: DictConfig,
    device_slices: int = 1,
    training_batches: int | None = None,
    ours: bool = False,
) -> NormFactory:
    """The factory of ``cfg.name``'s layer.

    ``device_slices`` > 1 means one process stands in for that many devices: each norm layer
    sees their slices of the batch in one forward (the parallel mode says how many:
    ``ParallelMode.device_slices``). ``training_batches``: training forward passes of the
    whole run (optimizer steps times trainer.accumulate); schedules in fractions of the run
    need it. ``ours``: this project's layer even where torch's would do (benchmarks).
    """
    return variant(cfg.name).layer(cfg, device_slices, training_batches, ours)


def normalization_batch_size(
    cfg: DictConfig, per_device_batch_size: int, parallel: DictConfig
) -> int:
    """Images whose statistics one norm layer shares in training: the per-device batch for
    per-device variants, per-device x (group size or devices) for synchronised ones, 1 for
    per-sample ones."""
    return variant(cfg.name).normalization_batch_size(cfg, per_device_batch_size, parallel.devices)
