"""Batches that reach each device exactly as DistributedSampler would hand them to ranks.

A real DDP rank and an emulating process both draw their batches from the same function:
device ``d`` gets DistributedSampler(num_replicas=total_devices, rank=d) indices, cut into
per-device batches; a process holding several devices concatenates its devices' batches in
device order. So slice d of an emulated global batch i is exactly rank d's batch i.

Gradient accumulation (``trainer.accumulate=K``) splits every device's step into K
micro-batches as K times more devices would split it: micro-batch k of device d is the batch
of device ``d + total_devices * k`` of a run with ``total_devices * K`` devices
(DistributedSampler(num_replicas=total_devices * K, rank=d + total_devices * k)). A device's
K micro-batches hold the images its DistributedSampler shard gives it for the step, dealt
out in turn (up to where the two samplers pad at the end of an epoch); so
accumulating K micro-batches on D devices feeds every image to the slice it takes in a run of
D x K devices. Every batch says which devices its slices are (:class:`DeviceBatch`), for the
augmentation streams.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from syncbn_lab.data.image_dataset import DeviceBatch
from syncbn_lab.parallel.context import Runtime


class DeviceBatchSampler(Sampler[list[int]]):
    """Yields this process's batches: per-device batches of its devices, concatenated, each
    a :class:`DeviceBatch` naming the devices of its slices; with ``accumulate`` K, K
    micro-batches per step (see the module's docstring).

    The last incomplete per-device batch is dropped (every device takes the same number
    of optimizer steps, as with DataLoader(drop_last=True) under DDP).
    """

    def __init__(
        self,
        dataset: Dataset,
        per_device_batch_size: int,
        total_devices: int,
        device_ranks: list[int],
        seed: int,
        shuffle: bool = True,
        accumulate: int = 1,
    ):
        self.per_device_batch_size = per_device_batch_size
        self.accumulate = accumulate
        self.start = 0
        # micro-batch k's devices, in a run of total_devices x accumulate devices
        self.devices = [[r + total_devices * k for r in device_ranks] for k in range(accumulate)]
        self.samplers = [
            [
                DistributedSampler(
                    dataset,
                    num_replicas=total_devices * accumulate,
                    rank=d,
                    shuffle=shuffle,
                    seed=seed,
                )
                for d in devices
            ]
            for devices in self.devices
        ]

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The batches of ``epoch``, from batch ``start`` on (a run resumed within an epoch);
        ``len`` stays the epoch's number of batches."""
        self.start = start
        for sampler in itertools.chain.from_iterable(self.samplers):
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        steps = self.samplers[0][0].num_samples // self.per_device_batch_size
        return steps * self.accumulate

    def __iter__(self) -> Iterator[DeviceBatch]:
        shards = [[list(sampler) for sampler in micro] for micro in self.samplers]
        b = self.per_device_batch_size
        for i in range(self.start, len(self)):
            step, k = divmod(i, self.accumulate)
            batch = [index for shard in shards[k] for index in shard[step * b : (step + 1) * b]]
            yield DeviceBatch(batch, self.devices[k])


class ShardSampler(Sampler[int]):
    """Evaluation indices of one rank: the indices cut into groups of ``group`` consecutive
    ones ([0, g), [g, 2g), ..., the last one shorter when ``group`` does not divide
    ``length``), rank r takes groups r, r+W, ...; no padding, so every sample is counted
    exactly once across ranks (DistributedSampler would pad). With ``group=1``: r, r+W, ..."""

    def __init__(self, length: int, rank: int, world_size: int, group: int = 1):
        self.group = group
        starts = range(rank * group, length, world_size * group)
        self.indices = [i for start in starts for i in range(start, min(start + group, length))]

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)


class RepeatedBatches(Sampler[list[int]]):
    """The first ``batches`` batches that ``sampler`` yields in epoch 0, the same ones every
    epoch (``trainer.overfit_batches``, debug=overfit)."""

    def __init__(self, sampler: DeviceBatchSampler, batches: int):
        sampler.set_epoch(0)
        self.batches = list(itertools.islice(sampler, batches))
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.start = start  # the same batches every epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches[self.start :])


def train_loader(
    dataset: Dataset,
    rt: Runtime,
    per_device_batch_size: int,
    seed: int,
    num_workers: int,
    overfit_batches: int | None = None,
    accumulate: int = 1,
) -> DataLoader:
    """This process's training batches (``accumulate`` micro-batches per optimizer step);
    with ``overfit_batches``, only the first that many, repeated every epoch."""
    sampler: Sampler[list[int]] = DeviceBatchSampler(
        dataset,
        per_device_batch_size,
        rt.total_devices,
        rt.local_device_ranks,
        seed,
        accumulate=accumulate,
    )
    if overfit_batches is not None:
        sampler = RepeatedBatches(sampler, overfit_batches)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        # not persistent: workers start each epoch from the dataset after its set_epoch, so
        # the augmentation of an epoch is the same with or without workers (and on resume)
        persistent_workers=False,
        pin_memory=rt.device.type == "cuda",
    )


def eval_loader(
    dataset: Dataset,
    rt: Runtime,
    batch_size: int,
    num_workers: int,
    limit: int | None = None,
    group: int = 1,
) -> DataLoader:
    """This rank's share of ``dataset`` (of its first ``limit`` images when given), in whole
    groups of ``group`` consecutive images (:class:`ShardSampler`); each batch holds whole
    groups: ``batch_size`` is rounded down to a multiple of ``group`` (at least one group)."""
    length = len(dataset) if limit is None else min(limit, len(dataset))
    return DataLoader(
        dataset,
        batch_size=group * max(1, batch_size // group),
        sampler=ShardSampler(length, rt.rank, rt.world_size, group),
        num_workers=num_workers,
        pin_memory=rt.device.type == "cuda",
    )


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA) and Python's and numpy's generators."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
