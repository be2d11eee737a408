"""Augmentation per device: a batch of N devices' slices (the emulation, DataParallel) is
augmented exactly as the N ranks of a DDP run augment their own batches."""

import torch

from syncbn_lab.data import Augmentation, InMemoryImageDataset


def dataset(devices):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (32, 1, 6, 6), dtype=torch.uint8, generator=g)
    out = InMemoryImageDataset(
        images,
        torch.zeros(32),
        mean=(0.5,),
        std=(0.25,),
        train=True,
        augmentation=Augmentation(crop_padding=2, hflip=True),
        seed=3,
    )
    out.set_devices(devices)
    return out


def test_each_slice_is_augmented_as_its_own_rank_would():
    emulated, rank0, rank1 = dataset([0, 1]), dataset([0]), dataset([1])
    for first in (0, 8):  # two consecutive batches: each device's stream advances alone
        batch = list(range(first, first + 8))
        images, _ = emulated.batch(batch)
        expected = torch.cat([rank0.batch(batch[:4])[0], rank1.batch(batch[4:])[0]])
        assert torch.equal(images, expected)
    # one stream for the whole batch (the rank-0 stream) gives other crops and flips
    assert not torch.equal(
        dataset([0]).batch(list(range(8)))[0], dataset([0, 1]).batch(list(range(8)))[0]
    )


def test_set_epoch_restarts_every_device_stream():
    d = dataset([0, 1])
    first, _ = d.batch(list(range(8)))
    d.batch(list(range(8)))
    d.set_epoch(0)
    assert torch.equal(d.batch(list(range(8)))[0], first)
    d.set_epoch(1)
    assert not torch.equal(d.batch(list(range(8)))[0], first)
