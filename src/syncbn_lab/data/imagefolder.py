"""Any ``root/{train,val,test}/<class>/<image>`` tree, via torchvision's ``ImageFolder`` scan.

Images are decoded with PIL, converted to RGB (``channels: 3``) or grey (``channels: 1``),
resized so the shorter side is ``image_size`` and centre-cropped to a square, giving uint8
``C x image_size x image_size``. With ``in_memory: true`` every image is decoded once at build
time and batches are cut from one uint8 tensor (fast; needs N x C x S x S bytes of RAM);
otherwise each item is decoded when requested (use DataLoader workers). Augmentation and
normalisation are the same batched tensor ops as for the other datasets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .base import DataError, DataSplits, require, resolve_root
from .image_dataset import ImageDataset, InMemoryImageDataset, dataset_options

SPLITS = ("train", "val", "test")


def decode_image(path: str | Path, image_size: int, channels: int) -> torch.Tensor:
    """uint8 ``C x image_size x image_size``: shorter side resized, then centre-cropped."""
    import torchvision.transforms.functional as TF
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image = image.convert("RGB" if channels == 3 else "L")
    except (OSError, UnidentifiedImageError) as exc:
        raise DataError(f"cannot read image {path} ({exc}); remove or replace it") from exc
    image = TF.resize(image, image_size, antialias=True)
    image = TF.center_crop(image, [image_size, image_size])
    return TF.pil_to_tensor(image)


class ImageFolderDataset(ImageDataset):
    """Decodes each requested image from disk; items as for every :class:`ImageDataset`."""

    def __init__(
        self, samples: list[tuple[str, int]], *, image_size: int, channels: int, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.samples = list(samples)
        self.targets = torch.tensor([label for _, label in self.samples], dtype=torch.long)
        self.image_size = image_size
        self.channels = channels

    def _load(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        paths = [self.samples[i][0] for i in indices.tolist()]
        images = [decode_image(p, self.image_size, self.channels) for p in paths]
        empty = torch.empty((0, self.channels, self.image_size, self.image_size), dtype=torch.uint8)
        return (torch.stack(images) if images else empty), self.targets.index_select(0, indices)

    def __len__(self) -> int:
        return len(self.samples)


def scan(folder: Path, layout: str) -> tuple[list[tuple[str, int]], list[str]]:
    """``(samples, classes)`` of one split folder, or a DataError explaining the layout."""
    from torchvision.datasets import ImageFolder

    if not folder.is_dir():
        raise DataError(f"image folder {folder} does not exist; expected {layout}")
    try:
        found = ImageFolder(str(folder))
    except FileNotFoundError as exc:
        raise DataError(f"no images found under {folder} ({exc}); expected {layout}") from exc
    return found.samples, found.classes


def build_imagefolder(cfg: Any) -> DataSplits:
    """Image-folder splits from a ``configs/data/imagefolder.yaml`` node."""
    root = resolve_root(require(cfg, "root"))
    image_size = int(require(cfg, "image_size"))
    channels = int(require(cfg, "channels"))
    mean, std = list(require(cfg, "mean")), list(require(cfg, "std"))
    if channels not in (1, 3) or len(mean) != channels or len(std) != channels:
        raise DataError(
            f"data.channels={channels} must be 1 or 3 with one data.mean/data.std value per "
            f"channel (got mean {mean}, std {std})"
        )
    dirs = {split: str(require(cfg, f"{split}_dir")) for split in SPLITS}
    layout = f"{root}/{{{','.join(dirs.values())}}}/<class>/<image> (set data.root / data.*_dir)"
    scanned = {split: scan(root / dirs[split], layout) for split in SPLITS}
    classes = scanned["train"][1]
    for split in ("val", "test"):
        if scanned[split][1] != classes:
            raise DataError(
                f"{root / dirs[split]} has classes {scanned[split][1]} but {root / dirs['train']} "
                f"has {classes}; every split needs the same class folders"
            )
    in_memory = bool(require(cfg, "in_memory"))

    def make(split: str) -> ImageDataset:
        samples, options = scanned[split][0], dataset_options(cfg, mean, std, split)
        if not in_memory:
            return ImageFolderDataset(samples, image_size=image_size, channels=channels, **options)
        images = torch.stack([decode_image(p, image_size, channels) for p, _ in samples])
        labels = torch.tensor([label for _, label in samples], dtype=torch.long)
        return InMemoryImageDataset(images, labels, **options)

    splits = {split: make(split) for split in SPLITS}
    for dataset in splits.values():
        dataset.classes = classes
    return DataSplits(
        **splits, num_classes=len(classes), in_channels=channels, image_size=image_size
    )
