"""scikit-learn's bundled 8x8 handwritten digits: 1,797 images, no download, a fixed split.

``load_digits`` gives 8x8 images with integer values 0..16; they are kept as uint8 and scaled
by 1/16. The split is stratified (``train_test_split`` with ``split_seed``), and the
normalisation mean/std are measured on the training split.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import DataError, DataSplits, require
from .image_dataset import InMemoryImageDataset, channel_stats, dataset_options

PIXEL_MAX = 16.0


def split_indices(
    labels: np.ndarray, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stratified, deterministic (train, val, test) index arrays."""
    from sklearn.model_selection import train_test_split

    if not (0 < val_fraction and 0 < test_fraction and val_fraction + test_fraction < 1):
        raise DataError(
            f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction} must be > 0 "
            "with a sum below 1"
        )
    index = np.arange(len(labels))
    held_out = val_fraction + test_fraction
    train, rest = train_test_split(index, test_size=held_out, stratify=labels, random_state=seed)
    val, test = train_test_split(
        rest, test_size=test_fraction / held_out, stratify=labels[rest], random_state=seed
    )
    return np.sort(train), np.sort(val), np.sort(test)


def build_digits(cfg: Any) -> DataSplits:
    """Digits splits from a ``configs/data/digits.yaml`` node."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.uint8)).unsqueeze(1)  # N x 1 x 8 x 8, 0..16
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    train_idx, val_idx, test_idx = split_indices(
        bunch.target,
        float(require(cfg, "val_fraction")),
        float(require(cfg, "test_fraction")),
        int(require(cfg, "split_seed")),
    )
    mean, std = channel_stats(images[train_idx], pixel_max=PIXEL_MAX)

    def subset(index: np.ndarray, split: str) -> InMemoryImageDataset:
        idx = torch.from_numpy(index)
        options = dataset_options(cfg, mean, std, split)
        dataset = InMemoryImageDataset(images[idx], labels[idx], pixel_max=PIXEL_MAX, **options)
        dataset.source_indices = idx  # rows of load_digits()
        return dataset

    return DataSplits(
        train=subset(train_idx, "train"),
        val=subset(val_idx, "val"),
        test=subset(test_idx, "test"),
        num_classes=10,
        in_channels=1,
        image_size=8,
    )
