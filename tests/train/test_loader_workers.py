"""With DataLoader worker processes, an epoch's augmented batches depend only on the seed
and the epoch: epoch 1 after epoch 0 equals epoch 1 of a fresh loader (as after a resume),
which needs the workers to see the dataset's set_epoch."""

import torch

from syncbn_lab.data import build_datasets
from syncbn_lab.parallel.context import Runtime
from syncbn_lab.parallel.sampling import train_loader


def loader_and_dataset(cfg):
    splits = build_datasets(cfg.data)
    return train_loader(splits.train, Runtime(), 16, seed=0, num_workers=1), splits.train


def run_epoch(loader, dataset, epoch):
    loader.batch_sampler.set_epoch(epoch)
    dataset.set_epoch(epoch)
    return [x for x, _ in loader]


def test_epoch_batches_do_not_depend_on_earlier_epochs(tiny_cfg):
    cfg = tiny_cfg("data.augment=true", "data.hflip=true", "data.num_train=64")
    loader, dataset = loader_and_dataset(cfg)
    first = run_epoch(loader, dataset, 0)
    continued = run_epoch(loader, dataset, 1)
    fresh = run_epoch(*loader_and_dataset(cfg), 1)
    assert len(continued) == len(fresh) == 4
    for a, b in zip(continued, fresh, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], continued[0])
