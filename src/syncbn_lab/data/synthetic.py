"""Deterministic, learnable synthetic images for tests and smoke runs (no files, no download).

Each class has a fixed random mean image (the "prototype"); a sample is its class prototype
plus Gaussian noise, clipped to [0, 1] and stored as uint8. Labels are balanced. A tiny model
separates the classes within a few steps, so its loss visibly goes down. Everything is a pure
function of the config: the same ``seed`` gives the same tensors on every machine.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import DataError, DataSplits, require
from .image_dataset import InMemoryImageDataset, channel_stats, dataset_options, mix_seed

SPLITS = ("train", "val", "test")


def make_split(
    prototypes: torch.Tensor, num_samples: int, noise_std: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images and int64 labels: ``num_samples`` noisy copies of the class prototypes."""
    generator = torch.Generator().manual_seed(seed)
    num_classes = prototypes.shape[0]
    labels = (torch.arange(num_samples) % num_classes)[
        torch.randperm(num_samples, generator=generator)
    ]
    noise = torch.randn((num_samples, *prototypes.shape[1:]), generator=generator)
    images = (prototypes[labels] + noise_std * noise).clamp_(0, 1).mul_(255).round_()
    return images.to(torch.uint8), labels


def build_synthetic(cfg: Any) -> DataSplits:
    """Synthetic splits from a ``configs/data/synthetic.yaml`` node."""
    num_classes = int(require(cfg, "num_classes"))
    channels = int(require(cfg, "channels"))
    image_size = int(require(cfg, "image_size"))
    seed = int(require(cfg, "seed"))
    noise_std = float(require(cfg, "noise_std"))
    sizes = {split: int(require(cfg, f"num_{split}")) for split in SPLITS}
    if (
        num_classes < 2
        or channels < 1
        or image_size < 1
        or noise_std < 0
        or min(sizes.values()) < 1
    ):
        raise DataError(
            "synthetic data needs num_classes >= 2, channels >= 1, image_size >= 1, noise_std >= 0 "
            f"and num_train/num_val/num_test >= 1; got {dict(cfg)}"
        )
    prototype_gen = torch.Generator().manual_seed(mix_seed((seed, -1)))
    prototypes = torch.rand(
        (num_classes, channels, image_size, image_size), generator=prototype_gen
    )
    data = {
        split: make_split(prototypes, sizes[split], noise_std, mix_seed((seed, k)))
        for k, split in enumerate(SPLITS)
    }
    mean, std = channel_stats(data["train"][0])
    splits = {
        split: InMemoryImageDataset(*data[split], **dataset_options(cfg, mean, std, split))
        for split in SPLITS
    }
    return DataSplits(
        **splits, num_classes=num_classes, in_channels=channels, image_size=image_size
    )
