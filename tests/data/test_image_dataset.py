"""Batched uint8 datasets: augmentation against a per-image reference, seeding, loaders."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from syncbn_lab.data import Augmentation, InMemoryImageDataset
from syncbn_lab.data import image_dataset as image_dataset_mod

MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def make_dataset(n=64, size=12, augmentation=None, train=True, seed=0, normalize=False):
    images = torch.randint(
        0, 256, (n, 3, size, size), generator=torch.Generator().manual_seed(5), dtype=torch.uint8
    )
    labels = torch.arange(n) % 7
    return InMemoryImageDataset(
        images,
        labels,
        mean=MEAN,
        std=STD,
        normalize=normalize,
        train=train,
        augmentation=augmentation,
        seed=seed,
    )


def reference_views(raw: torch.Tensor, pad: int, flips: bool) -> tuple[list[tuple], torch.Tensor]:
    """Every crop (and flip) of one uint8 image, one slice at a time, as floats in [0, 1]."""
    _, h, w = raw.shape
    padded = F.pad(raw, (pad, pad, pad, pad))
    keys, views = [], []
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            crop = padded[:, dy : dy + h, dx : dx + w]
            keys.append((dy, dx, False))
            views.append(crop.float() / 255)
            if flips:
                keys.append((dy, dx, True))
                views.append(crop.flip(-1).float() / 255)
    return keys, torch.stack(views)


def identify(
    dataset, images: torch.Tensor, indices: list[int], pad: int, flips: bool
) -> list[tuple]:
    found = []
    for image, i in zip(images, indices, strict=True):
        keys, views = reference_views(dataset.images[i], pad, flips)
        close = (views - image).abs().flatten(1).amax(1) <= 1e-6
        matches = [key for key, ok in zip(keys, close.tolist(), strict=True) if ok]
        assert len(matches) == 1, f"item {i} is not exactly one crop/flip of its image: {matches}"
        found.append(matches[0])
    return found


def test_crop_and_flip_match_the_per_image_reference():
    dataset = make_dataset(n=200, augmentation=Augmentation(crop_padding=4, hflip=True))
    indices = list(range(200))
    images, labels = dataset.batch(indices)
    assert images.dtype == torch.float32 and images.shape == (200, 3, 12, 12)
    assert torch.equal(labels, dataset.targets)
    found = identify(dataset, images, indices, pad=4, flips=True)
    assert 60 <= sum(flip for _, _, flip in found) <= 140
    assert len({(dy, dx) for dy, dx, _ in found}) >= 50  # of 81 offsets
    # Zero padding really shows up as black borders somewhere.
    assert any(dy != 4 or dx != 4 for dy, dx, _ in found)


def test_crop_only_and_flip_only():
    crop = make_dataset(augmentation=Augmentation(crop_padding=2, hflip=False))
    found = identify(crop, crop.batch(range(64))[0], list(range(64)), pad=2, flips=True)
    assert not any(flip for *_, flip in found)
    flip = make_dataset(augmentation=Augmentation(crop_padding=0, hflip=True))
    found = identify(flip, flip.batch(range(64))[0], list(range(64)), pad=0, flips=True)
    assert {f for *_, f in found} == {False, True}


def test_normalisation_is_per_channel():
    dataset = make_dataset(normalize=True, train=False)
    image, label = dataset[5]
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    expected = (dataset.images[5].double() / 255 - mean.double()) / std.double()
    torch.testing.assert_close(image.double(), expected, rtol=0, atol=1e-5)
    assert label == 5 and isinstance(label, int)


@pytest.mark.parametrize("train", [False, True])
def test_getitems_equals_getitem_without_augmentation(train):
    dataset = make_dataset(
        normalize=True, train=train, augmentation=None if train else Augmentation(4, True)
    )
    assert not dataset.augments
    indices = [3, 0, 63, 3, -1]
    batch = dataset.__getitems__(indices)
    assert len(batch) == len(indices)
    for (image, label), i in zip(batch, indices, strict=True):
        single_image, single_label = dataset[i]
        assert torch.equal(image, single_image) and label == single_label


def test_augmentation_reproducible_per_seed_and_epoch():
    aug = Augmentation(crop_padding=4, hflip=True)
    a, b = make_dataset(augmentation=aug, seed=3), make_dataset(augmentation=aug, seed=3)
    idx = list(range(64))
    first, _ = a.batch(idx)
    assert torch.equal(first, b.batch(idx)[0])  # same seed, same draws
    assert torch.equal(first, a.batch(idx)[0])  # a batch's draws are its own
    a.set_epoch(1)
    epoch1 = a.batch(idx)[0]
    assert not torch.equal(first, epoch1)
    b.set_epoch(1)
    assert torch.equal(epoch1, b.batch(idx)[0])
    other = make_dataset(augmentation=aug, seed=4)
    assert not torch.equal(first, other.batch(idx)[0])
    a.set_seed(4)
    a.set_epoch(0)
    other.set_epoch(0)
    assert torch.equal(a.batch(idx)[0], other.batch(idx)[0])


def test_ranks_draw_different_augmentations(monkeypatch):
    aug = Augmentation(crop_padding=4, hflip=True)
    rank0 = make_dataset(augmentation=aug).batch(range(64))[0]
    monkeypatch.setattr(image_dataset_mod, "_distributed_rank", lambda: 1)
    assert not torch.equal(rank0, make_dataset(augmentation=aug).batch(range(64))[0])


def test_pickled_copy_replays_the_same_stream():
    dataset = make_dataset(augmentation=Augmentation(crop_padding=4, hflip=True))
    dataset.set_epoch(2)
    copy = pickle.loads(pickle.dumps(dataset))
    assert torch.equal(dataset.batch(range(10))[0], copy.batch(range(10))[0])


def test_dataloader_batches_are_the_batched_path():
    dataset = make_dataset(normalize=True, train=False)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    loader = DataLoader(dataset, batch_size=16, sampler=order)
    for k, (images, labels) in enumerate(loader):
        expected_images, expected_labels = dataset.batch(order[16 * k : 16 * (k + 1)])
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)


def test_augmentation_depends_on_the_batch_not_on_workers_or_order():
    """A batch's draws are a function of (seed, epoch, device, its indices): the same with 0
    or 2 loader workers and in any order of batches, so a run resumed mid-epoch augments as
    the uninterrupted run did."""
    dataset = make_dataset(n=32, augmentation=Augmentation(crop_padding=4, hflip=True))
    batches = [list(range(k, k + 8)) for k in (0, 8, 16, 24)]

    def run(epoch, workers, order):
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_sampler=[batches[i] for i in order], num_workers=workers)
        return dict(zip(order, (images for images, _ in loader), strict=True))

    first = run(0, 0, [0, 1, 2, 3])
    for again in (run(0, 2, [0, 1, 2, 3]), run(0, 0, [3, 1, 2, 0]), run(0, 2, [2, 3])):
        assert all(torch.equal(again[i], first[i]) for i in again)
    later = run(1, 0, [0, 1, 2, 3])
    assert not any(torch.equal(later[i], first[i]) for i in first)  # another epoch, other draws
    # samples 1..7 in a batch that starts at 0 and in one that starts at 1: other draws
    dataset.set_epoch(0)
    assert not torch.equal(dataset.batch(range(8))[0][1:], dataset.batch(range(1, 9))[0][:7])


def test_rejects_bad_storage():
    with pytest.raises(ValueError, match="uint8"):
        InMemoryImageDataset(torch.zeros(2, 1, 4, 4), torch.zeros(2), mean=(0.5,), std=(0.5,))
    with pytest.raises(ValueError, match="channels"):
        InMemoryImageDataset(
            torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2), mean=(0.5,), std=(0.5,)
        )
