"""Augmentation per device: a batch of N devices' slices (the emulation, DataParallel, a
micro-batch of gradient accumulation) is augmented exactly as the N ranks of a DDP run augment
their own batches; the batch's indices say whose slices it holds."""

import torch

from syncbn_lab.data import Augmentation, InMemoryImageDataset
from syncbn_lab.data.image_dataset import DeviceBatch


def dataset():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (32, 1, 6, 6), dtype=torch.uint8, generator=g)
    return InMemoryImageDataset(
        images,
        torch.zeros(32),
        mean=(0.5,),
        std=(0.25,),
        train=True,
        augmentation=Augmentation(crop_padding=2, hflip=True),
        seed=3,
    )


def test_each_slice_is_augmented_as_its_own_rank_would():
    data = dataset()
    for first in (0, 8):  # two consecutive batches: each device's stream advances alone
        batch = list(range(first, first + 8))
        images, _ = data.batch(DeviceBatch(batch, [0, 1]))
        expected = torch.cat([data.batch(batch[:4], [0])[0], data.batch(batch[4:], [1])[0]])
        assert torch.equal(images, expected)
        # items through __getitems__, as the DataLoader builds a batch from the sampler's
        items = data.__getitems__(DeviceBatch(batch, [0, 1]))
        assert torch.equal(torch.stack([x for x, _ in items]), expected)
    # one stream for the whole batch (the rank-0 stream) gives other crops and flips
    assert not torch.equal(data.batch(list(range(8)))[0], data.batch(list(range(8)), [0, 1])[0])
    # another device, the same indices: other draws
    assert not torch.equal(data.batch(list(range(4)), [0])[0], data.batch(list(range(4)), [2])[0])


def test_set_epoch_restarts_every_device_stream():
    d = dataset()
    batch = DeviceBatch(range(8), [0, 1])
    first, _ = d.batch(batch)
    d.batch(batch)
    d.set_epoch(0)
    assert torch.equal(d.batch(batch)[0], first)
    d.set_epoch(1)
    assert not torch.equal(d.batch(batch)[0], first)
