"""CIFAR-10 / CIFAR-100 from their on-disk python format, held in memory as uint8.

Layout (what ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz`` extract to, and where
``torchvision.datasets.CIFAR10(root)`` looks)::

    <root>/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}
    <root>/cifar-100-python/{train, test, meta}

The batches are read with :mod:`syncbn_lab.data.safe_pickle` rather than torchvision's plain
``pickle.load``, so a tampered file cannot run code; the md5 of every file is still checked
against torchvision's published table (``verify_checksums``). When files are missing and
``download: true``, torchvision downloads them in a subprocess that is killed after
``download_timeout`` seconds, so an offline machine fails quickly with a message saying where
to put the files.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .base import DataError, DataSplits, require, resolve_root
from .image_dataset import InMemoryImageDataset, dataset_options
from .safe_pickle import safe_load


@dataclass(frozen=True)
class CifarSpec:
    """Where one CIFAR variant lives on disk and how its batches are keyed."""

    name: str
    title: str
    folder: str
    archive: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    meta_file: str
    label_key: str
    class_names_key: str
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    torchvision_class: str

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.train_files, *self.test_files, self.meta_file)


# Per-channel mean and std over all training pixels (for CIFAR-10 this is not the widely copied
# 0.2023/0.1994/0.2010, which does not match the pixel std of the data).
CIFAR10 = CifarSpec(
    name="cifar10",
    title="CIFAR-10",
    folder="cifar-10-batches-py",
    archive="cifar-10-python.tar.gz",
    train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test_files=("test_batch",),
    meta_file="batches.meta",
    label_key="labels",
    class_names_key="label_names",
    num_classes=10,
    mean=(0.4914, 0.4822, 0.4465),
    std=(0.2470, 0.2435, 0.2616),
    torchvision_class="CIFAR10",
)
CIFAR100 = CifarSpec(
    name="cifar100",
    title="CIFAR-100",
    folder="cifar-100-python",
    archive="cifar-100-python.tar.gz",
    train_files=("train",),
    test_files=("test",),
    meta_file="meta",
    label_key="fine_labels",
    class_names_key="fine_label_names",
    num_classes=100,
    mean=(0.5071, 0.4865, 0.4409),
    std=(0.2673, 0.2564, 0.2762),
    torchvision_class="CIFAR100",
)
SPECS = {spec.name: spec for spec in (CIFAR10, CIFAR100)}

#: Downloads a CIFAR variant into ``root`` within ``timeout`` seconds, raising on failure.
Downloader = Callable[[Path, CifarSpec, float], None]


def torchvision_md5s(spec: CifarSpec) -> dict[str, str]:
    """File name -> md5 of the genuine files, as published by torchvision."""
    import torchvision.datasets

    cls = getattr(torchvision.datasets, spec.torchvision_class)
    table = {name: md5 for name, md5 in (*cls.train_list, *cls.test_list)}
    table[cls.meta["filename"]] = cls.meta["md5"]
    return table


def download_with_torchvision(root: Path, spec: CifarSpec, timeout: float) -> None:
    """Run torchvision's CIFAR download in a subprocess that is killed after ``timeout`` s."""
    code = (
        "import socket, sys; socket.setdefaulttimeout(float(sys.argv[3])); "
        "import torchvision.datasets as d; getattr(d, sys.argv[1])(sys.argv[2], download=True)"
    )
    socket_timeout = str(max(1.0, min(10.0, timeout / 3)))
    command = [sys.executable, "-c", code, spec.torchvision_class, str(root), socket_timeout]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"torchvision download did not finish within {timeout:g} s") from None
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        raise OSError(lines[-1] if lines else f"torchvision download exited with {proc.returncode}")


def placement_message(folder: Path, spec: CifarSpec, missing: list[str]) -> str:
    return (
        f"{spec.title} files missing in {folder}: {', '.join(missing)}; place the python "
        f"version of {spec.title} there (folder {folder} with {', '.join(spec.files)}, as "
        f"extracted from {spec.archive}) or set data.download=true where the internet is reachable"
    )


def ensure_files(
    root: Path,
    spec: CifarSpec,
    *,
    download: bool,
    timeout: float,
    downloader: Downloader | None = None,
) -> Path:
    """The folder holding every file of ``spec``; downloads them if allowed, else DataError."""
    folder = root / spec.folder
    missing = [name for name in spec.files if not (folder / name).is_file()]
    if not missing:
        return folder
    if not download:
        raise DataError(placement_message(folder, spec, missing))
    try:
        root.mkdir(parents=True, exist_ok=True)
        (downloader or download_with_torchvision)(root, spec, timeout)
    except Exception as exc:  # any failure becomes the placement message
        raise DataError(
            f"{placement_message(folder, spec, missing)} (download failed: {exc})"
        ) from exc
    missing = [name for name in spec.files if not (folder / name).is_file()]
    if missing:
        raise DataError(
            placement_message(folder, spec, missing) + " (download finished without them)"
        )
    return folder


def verify_md5s(folder: Path, expected: dict[str, str]) -> None:
    for name, md5 in expected.items():
        path = folder / name
        digest = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != md5:
            raise DataError(
                f"{path} has md5 {digest.hexdigest()}, expected {md5}; replace it with the file "
                "from the original archive, or set data.verify_checksums=false for a deliberately "
                "different copy"
            )


def _str_keys(entry: Any, path: Path) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise DataError(
            f"{path} does not hold a CIFAR dict; replace it with the file from the original archive"
        )
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}


def read_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images ``N x 3 x 32 x 32`` and int64 labels of one CIFAR batch file."""
    with open(path, "rb") as f:
        entry = _str_keys(safe_load(f, source=str(path)), path)
    if "data" not in entry or label_key not in entry:
        raise DataError(
            f"{path} lacks the keys 'data' and '{label_key}'; replace it with the file from the "
            "original archive"
        )
    data = np.asarray(entry["data"])
    labels = np.asarray(entry[label_key], dtype=np.int64)
    if (
        data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3 * 32 * 32
        or labels.shape != (data.shape[0],)
    ):
        raise DataError(
            f"{path} holds data {data.dtype} {data.shape} and labels {labels.shape}, expected "
            "uint8 N x 3072 and N"
        )
    return data.reshape(-1, 3, 32, 32), labels


def read_class_names(path: Path, key: str) -> list[str]:
    with open(path, "rb") as f:
        meta = _str_keys(safe_load(f, source=str(path)), path)
    names = meta.get(key)
    if not isinstance(names, list):
        raise DataError(
            f"{path} lacks the list '{key}'; replace it with the file from the original archive"
        )
    return [n.decode("latin1") if isinstance(n, bytes) else str(n) for n in names]


def read_split(
    folder: Path, files: tuple[str, ...], label_key: str
) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [read_batch(folder / name, label_key) for name in files]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return torch.from_numpy(images), torch.from_numpy(labels)


def split_train_val(num_train: int, val_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (train, val) indices: a fixed random ``val_size`` of the training set is held out."""
    if not 0 < val_size < num_train:
        raise DataError(
            f"data.val_size={val_size} must be between 1 and {num_train - 1} (the training set "
            f"has {num_train} images)"
        )
    order = torch.randperm(num_train, generator=torch.Generator().manual_seed(seed))
    return order[val_size:].sort().values, order[:val_size].sort().values


def build_cifar(cfg: Any, spec: CifarSpec, *, downloader: Downloader | None = None) -> DataSplits:
    root = resolve_root(require(cfg, "root"))
    folder = ensure_files(
        root,
        spec,
        download=bool(require(cfg, "download")),
        timeout=float(require(cfg, "download_timeout")),
        downloader=downloader,
    )
    if require(cfg, "verify_checksums"):
        verify_md5s(folder, torchvision_md5s(spec))
    class_names = read_class_names(folder / spec.meta_file, spec.class_names_key)
    if len(class_names) != spec.num_classes:
        raise DataError(
            f"{folder / spec.meta_file} lists {len(class_names)} classes, expected "
            f"{spec.num_classes}"
        )
    train_images, train_labels = read_split(folder, spec.train_files, spec.label_key)
    test_images, test_labels = read_split(folder, spec.test_files, spec.label_key)
    for labels in (train_labels, test_labels):
        if labels.numel() and (labels.min() < 0 or labels.max() >= spec.num_classes):
            raise DataError(
                f"labels in {folder} fall outside 0..{spec.num_classes - 1}; the files are not "
                f"{spec.title}"
            )
    train_idx, val_idx = split_train_val(
        len(train_labels), int(require(cfg, "val_size")), int(require(cfg, "split_seed"))
    )

    def options(split: str) -> dict[str, Any]:
        return dataset_options(cfg, spec.mean, spec.std, split)

    train = InMemoryImageDataset(
        train_images[train_idx], train_labels[train_idx], **options("train")
    )
    val = InMemoryImageDataset(train_images[val_idx], train_labels[val_idx], **options("val"))
    test = InMemoryImageDataset(test_images, test_labels, **options("test"))
    train.source_indices, val.source_indices = train_idx, val_idx  # rows of the 50k training set
    for dataset in (train, val, test):
        dataset.classes = class_names
    return DataSplits(
        train=train, val=val, test=test, num_classes=spec.num_classes, in_channels=3, image_size=32
    )


def build_cifar10(cfg: Any) -> DataSplits:
    """CIFAR-10 splits from a ``configs/data/cifar10.yaml`` node."""
    return build_cifar(cfg, CIFAR10)


def build_cifar100(cfg: Any) -> DataSplits:
    """CIFAR-100 splits from a ``configs/data/cifar100.yaml`` node."""
    return build_cifar(cfg, CIFAR100)
