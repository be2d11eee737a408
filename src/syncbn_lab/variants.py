"""The `bn` config group: one :class:`NormVariant` per variant, found by its config name.

(Light to import: torch and the layers load when a layer is built, so the sweep's driver and
the report can ask a variant without them.)

| name         | module                                   | statistics                       |
|--------------|------------------------------------------|----------------------------------|
| `bn`         | torch.nn.BatchNorm2d (or our BatchNorm    | each device's slice of the batch |
|              | when one process emulates N devices)     |                                  |
| `sync`       | syncbn_lab.nn.SyncBatchNorm              | the global batch, any backend    |
| `torch_sync` | torch.nn.SyncBatchNorm                   | the global batch, CUDA only      |
| `brn`        | syncbn_lab.nn.BatchRenorm (Ioffe 2017)   | each device's slice, corrected   |
|              |                                          | towards the running statistics   |
| `brn_tuned`  | the same, with the limits Wu & He (2018) | as brn                           |
|              | tuned: rmax 1.5, dmax 0.5                |                                  |
| `gn`         | syncbn_lab.nn.GroupNorm (torch's, kept   | per sample, batch-independent    |
|              | in NCHW for its CPU kernel)              |                                  |

A variant holds everything the rest of the code asks about it: how to build its layer for a
number of device slices, its normalisation batch, its config checks, its label and role in a
report. Nobody else compares variant names; adding a variant is one spec registered here (or
with :func:`register`) and one YAML file in configs/bn/. This is the module under src/ that
spells the variants' names; :mod:`syncbn_lab.nn.registry` builds their layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from omegaconf import DictConfig

from syncbn_lab.checks import positive
from syncbn_lab.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn


class Mode(Protocol):
    """What a norm variant's checks ask of a parallel mode (``parallel.modes.ParallelMode``)."""

    name: str
    emulated: bool


NormFactory = Callable[[int], "nn.Module"]
GROUP = "bn"
"""The config group that chooses the variant (``bn=<name>``), and the summary.json and
results.csv column that records it."""

Role = Literal["baseline", "reference", "remedy"]

SMALL_BATCH = 4
"""Per-device BN over this many images or fewer gets a note at the run's start."""
SMALL_BATCH_FIGURE = (
    "in reports/nbs_penalty, BN over 2 images cost test error in 3 of the 11 configurations "
    "(+1.02 pp for resnet8 at width 4 on Fashion-MNIST, +3.91 pp at width 2 on Animal-MNIST) "
    "and no figure of a run predicted which"
)
"""The measured figures the note quotes (a test checks them against the committed report)."""


@dataclass(frozen=True)
class NormVariant:
    """One norm variant. Subclasses override :meth:`layer` and, where they have any,
    :meth:`check` and :meth:`normalization_batch_size`.

    ``synchronises``: its statistics span devices through a communicator (DataParallel's
    replicas cannot). ``per_sample``: statistics of one sample, so the batch does not matter
    and there are no running statistics. ``role``: its part in a study's report: the
    ``baseline`` (per-device BN, which the others are measured against), the ``reference``
    (the synchronised BN the remedies are compared with), a ``remedy`` of small per-device
    batches, or None (not part of the study's reading).
    """

    name: str
    label: str
    synchronises: bool = False
    per_sample: bool = False
    role: Role | None = None

    def layer(self, cfg: DictConfig, device_slices: int, training_batches: int | None,
              ours: bool) -> NormFactory:  # fmt: skip
        """The factory ``channels -> module`` for a layer that sees ``device_slices`` device
        slices in each forward; ``ours``: this project's layer even where torch's would do."""
        raise NotImplementedError

    def normalization_batch_size(
        self, cfg: DictConfig, per_device_batch_size: int, devices: int
    ) -> int:
        """Images whose statistics one norm layer shares in training (default: one device's)."""
        return per_device_batch_size

    def check(self, cfg: DictConfig, mode: Mode, device: str) -> None:
        """This variant's own keys and the combinations it cannot run; one-line ConfigError."""

    def small_batch_note(self, normalization_batch_size: int, devices: int) -> str | None:
        """The line a run prints at its start where this variant's statistics span too few
        images to trust (None: nothing to say)."""
        return None


def _eps_momentum(cfg: DictConfig) -> dict:
    return {"eps": cfg.get("eps", 1e-5), "momentum": cfg.get("momentum", 0.1)}


def _check_impl(bn: DictConfig) -> None:
    """bn.impl, where a variant has one: auto | reference | fused."""
    from syncbn_lab.nn.functional import IMPLS

    if bn.get("impl", "auto") not in IMPLS:
        raise ConfigError(f"bn.impl={bn.impl} is unknown; choose one of {', '.join(IMPLS)}")


class _PerDeviceBN(NormVariant):
    """Per-device BatchNorm: torch's on one device slice, ours over several (torch's would
    normalise the whole local batch at once)."""

    def layer(self, cfg, device_slices, training_batches, ours):
        from torch import nn

        kwargs = _eps_momentum(cfg)
        if device_slices == 1 and not ours:
            return lambda c: nn.BatchNorm2d(c, **kwargs)
        from syncbn_lab.nn.sync_batchnorm import BatchNorm

        return lambda c: BatchNorm(c, device_slices=device_slices, **kwargs)

    def small_batch_note(self, normalization_batch_size, devices):
        b = normalization_batch_size
        if b > SMALL_BATCH:
            return None
        # the smallest group of devices (a divisor, as bn.group_size must be) whose SyncBN
        # statistics span 32 images, as in reports/nbs_remedy
        group = next((g for g in range(1, devices + 1) if devices % g == 0 and g * b >= 32), 0)
        setting = (
            f"bn=sync bn.group_size={group} (statistics over {group * b} images)"
            if group > 1
            else f"bn=sync (statistics over {devices * b} images)"
            if devices > 1
            else "a larger trainer.global_batch_size or bn=gn"
        )
        return (
            f"note: per-device BN normalises over {b} image(s) here; {SMALL_BATCH_FIGURE}; "
            f"consider {setting}"
        )


class _SyncBN(NormVariant):
    """This project's SyncBatchNorm: global-batch statistics over any backend, emulated
    device slices included; ``bn.group_size`` synchronises within groups of devices."""

    def layer(self, cfg, device_slices, training_batches, ours):
        from syncbn_lab.nn.sync_batchnorm import SyncBatchNorm

        group_size, impl = cfg.get("group_size"), cfg.get("impl", "auto")
        return lambda c: SyncBatchNorm(
            c, group_size=group_size, impl=impl, device_slices=device_slices, **_eps_momentum(cfg)
        )

    def normalization_batch_size(self, cfg, per_device_batch_size, devices):
        return per_device_batch_size * min(cfg.get("group_size") or devices, devices)

    def check(self, cfg, mode, device):
        bn = cfg.bn
        _check_impl(bn)
        if bn.get("group_size") is not None:
            positive(bn.group_size, "bn.group_size")
            if cfg.parallel.devices % bn.group_size:
                raise ConfigError(
                    f"bn.group_size={bn.group_size} does not divide parallel.devices="
                    f"{cfg.parallel.devices}; pick a divisor of the device count (or null)"
                )


class _TorchSyncBN(NormVariant):
    """torch.nn.SyncBatchNorm: global-batch statistics across DDP processes, CUDA only."""

    def layer(self, cfg, device_slices, training_batches, ours):
        from torch import nn

        return lambda c: nn.SyncBatchNorm(c, **_eps_momentum(cfg))

    normalization_batch_size = _SyncBN.normalization_batch_size

    def check(self, cfg, mode, device):
        if device != "cuda":
            raise ConfigError(
                f"bn={self.name} (torch.nn.SyncBatchNorm) runs only on CUDA; use bn=sync, "
                "this project's SyncBatchNorm, which also runs on CPU"
            )
        if mode.emulated:
            raise ConfigError(
                f"bn={self.name} cannot emulate devices (torch.nn.SyncBatchNorm synchronises "
                f"only across DDP processes); use bn=sync with parallel={mode.name}"
            )


class _BatchRenorm(NormVariant):
    """Batch Renormalization: per-device statistics corrected towards the running ones; its
    rmax/dmax schedule is given in fractions of the run's training batches."""

    def layer(self, cfg, device_slices, training_batches, ours):
        if training_batches is None:
            raise ValueError(
                f"bn={self.name} needs the run's training_batches for its rmax/dmax schedule"
            )
        from syncbn_lab.nn.batch_renorm import BatchRenorm

        schedule = {
            "rmax": cfg.rmax,
            "dmax": cfg.dmax,
            "warmup_batches": round(cfg.warmup * training_batches),
            "ramp_batches": round(cfg.ramp * training_batches),
        }
        impl = cfg.get("impl", "auto")
        return lambda c: BatchRenorm(
            c, device_slices=device_slices, impl=impl, **_eps_momentum(cfg), **schedule
        )

    def check(self, cfg, mode, device):
        """bn.impl, the limits, the schedule's fractions, and the emulation's one limitation."""
        bn, p = cfg.bn, cfg.parallel
        _check_impl(bn)
        for key in ("rmax", "dmax", "warmup", "ramp"):
            value = bn.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(
                    f"bn.{key}={value} must be a number; set it in configs/bn/{self.name}.yaml"
                )
        if not 1 <= bn.rmax < math.inf:
            raise ConfigError(f"bn.rmax={bn.rmax} must be >= 1 (r is clipped to [1/rmax, rmax])")
        if not 0 <= bn.dmax < math.inf:
            raise ConfigError(f"bn.dmax={bn.dmax} must be >= 0 (d is clipped to [-dmax, dmax])")
        for key in ("warmup", "ramp"):
            if not 0 <= bn[key] <= 1:
                raise ConfigError(f"bn.{key}={bn[key]} must be a fraction of the run in [0, 1]")
        if bn.warmup + bn.ramp > 1:
            raise ConfigError(
                f"bn.warmup + bn.ramp = {bn.warmup} + {bn.ramp} > 1: the ramp does not fit in "
                "the run; lower bn.warmup or bn.ramp"
            )
        accumulate, broadcast = cfg.trainer.accumulate, p.get("broadcast_buffers", True)
        if mode.emulated and p.devices > 1 and (accumulate > 1 or not broadcast):
            raise ConfigError(
                f"bn={self.name} under parallel={mode.name} gives every device device 0's "
                "running statistics, which is what DDP does only when every forward starts "
                "from rank 0's buffers; use trainer.accumulate=1 and "
                "parallel.broadcast_buffers=true, or parallel=ddp"
            )


class _GroupNorm(NormVariant):
    """GroupNorm: per-sample statistics over groups of channels (torch's kernel, in NCHW)."""

    def layer(self, cfg, device_slices, training_batches, ours):
        groups, eps = cfg.groups, cfg.get("eps", 1e-5)

        from syncbn_lab.nn.group_norm import GroupNorm

        def group_norm(c: int) -> GroupNorm:
            if c % min(groups, c):
                raise ValueError(f"bn.groups={groups} does not divide {c} channels; pick a divisor")
            return GroupNorm(min(groups, c), c, eps=eps)

        return group_norm

    def normalization_batch_size(self, cfg, per_device_batch_size, devices):
        return 1

    def check(self, cfg, mode, device):
        """bn.groups (capped at a layer's channels) must divide every norm layer's channels;
        the model is built on the meta device (no memory, no compute) to find them."""
        import torch
        from torch import nn

        from syncbn_lab import models

        groups = cfg.bn.groups
        positive(groups, "bn.groups")
        channels: set[int] = set()

        def record(c: int) -> nn.Module:
            channels.add(c)
            return nn.Identity()

        with torch.device("meta"):
            models.build(cfg.model, record, num_classes=10, in_channels=3)
        counts = sorted(channels)
        if any(c % min(groups, c) for c in counts):
            valid = [g for g in range(1, counts[-1] + 1) if all(c % min(g, c) == 0 for c in counts)]
            raise ConfigError(
                f"bn.groups={groups} does not divide the channels of every norm layer of "
                f"model={cfg.model.name} ({', '.join(map(str, counts))}); choose bn.groups from "
                f"{', '.join(map(str, valid))}"
            )


VARIANTS: dict[str, NormVariant] = {}
"""Every registered variant by config name, in the order reports list them."""


def register(variant: NormVariant) -> NormVariant:
    """Add ``variant`` to :data:`VARIANTS` (a config with ``bn.name`` = its name finds it)."""
    VARIANTS[variant.name] = variant
    return variant


for _variant in (
    _PerDeviceBN("bn", "per-device BN", role="baseline"),
    _BatchRenorm("brn", "Batch Renormalization", role="remedy"),
    _BatchRenorm("brn_tuned", "Batch Renormalization (rmax 1.5, dmax 0.5)", role="remedy"),
    _SyncBN("sync", "SyncBN", synchronises=True, role="reference"),
    _TorchSyncBN("torch_sync", "torch.nn.SyncBatchNorm", synchronises=True),
    _GroupNorm("gn", "GroupNorm", per_sample=True, role="remedy"),
):
    register(_variant)


def variant(name: str) -> NormVariant:
    """The variant called ``name``; a one-line ConfigError naming the choices otherwise."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ConfigError(
            f"{GROUP}.name={name} is unknown; choose one with {GROUP}=<name>, one of "
            f"{', '.join(VARIANTS)}"
        ) from None


def with_role(role: Role) -> list[NormVariant]:
    """The registered variants playing ``role`` in a study's report, in report order."""
    return [v for v in VARIANTS.values() if v.role == role]
