"""The shape of a run: what its config implies about devices and batches, as plain values.

A leaf module (it imports nothing of the project), so the config checks, the parallel modes,
DDP and the logger can all name it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunShape:
    """What a run's config implies, computed once (``config.derive``) and passed explicitly.

    ``variant`` and ``mode`` are the names of its norm variant and parallel mode (their specs:
    ``variants.variant(name)``, ``parallel.modes.mode(name)``); ``devices`` is
    ``parallel.devices``; ``slices_per_process``: the device slices one process's batch holds
    (N under emulated and dp, else 1); ``device_slices``: the slices one norm layer normalises
    apart (N only under emulation); ``normalization_batch_size``: the images one norm layer's
    statistics span in training. Plain values, so it pickles into spawned DDP ranks.
    """

    variant: str
    mode: str
    devices: int
    per_device_batch_size: int
    slices_per_process: int
    device_slices: int
    normalization_batch_size: int
    device: str
    backend: str | None
