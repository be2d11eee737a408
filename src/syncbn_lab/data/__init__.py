"""Datasets: ``build_datasets(cfg.data)`` -> :class:`DataSplits` of uint8-backed image datasets.

Every dataset item is ``(image float32 C x H x W, normalised; label int)``, and
every dataset also builds whole batches with tensor ops through ``__getitems__`` (see
:mod:`syncbn_lab.data.image_dataset`). Families, selected by ``cfg.name`` (one config each in
``configs/data/``): mnist, fashion_mnist, animal_mnist, elpv, digits, cifar10, cifar100,
imagefolder, synthetic.
"""

from __future__ import annotations

import importlib

from omegaconf import DictConfig

from .base import DataError, DataSplits, require
from .image_dataset import Augmentation, ImageDataset, InMemoryImageDataset

# name -> "module:function"; modules are imported only when their dataset is built.
_BUILDERS = {
    "mnist": "syncbn_lab.data.mnist:build_mnist",
    "animal_mnist": "syncbn_lab.data.animal_mnist:build_animal_mnist",
    "elpv": "syncbn_lab.data.elpv:build_elpv",
    "fashion_mnist": "syncbn_lab.data.fashion_mnist:build_fashion_mnist",
    "digits": "syncbn_lab.data.digits:build_digits",
    "cifar10": "syncbn_lab.data.cifar:build_cifar10",
    "cifar100": "syncbn_lab.data.cifar:build_cifar100",
    "imagefolder": "syncbn_lab.data.imagefolder:build_imagefolder",
    "synthetic": "syncbn_lab.data.synthetic:build_synthetic",
}
DATASET_NAMES = tuple(sorted(_BUILDERS))
# name -> (module, fetch, load) of the families that fetch files into <root> and cache them.
_FETCHERS = {
    "mnist": ("syncbn_lab.data.mnist", "fetch_mnist", "load_mnist_arrays"),
    "fashion_mnist": (
        "syncbn_lab.data.fashion_mnist",
        "fetch_fashion_mnist",
        "load_fashion_mnist_arrays",
    ),
    "animal_mnist": (
        "syncbn_lab.data.animal_mnist",
        "fetch_animal_mnist",
        "load_animal_mnist_arrays",
    ),
    "elpv": ("syncbn_lab.data.elpv", "fetch_elpv", "load_elpv_arrays"),
}


def prepare_data(cfg: DictConfig) -> None:
    """Fetch and check the files of a dataset that ``build_datasets`` would fetch, so that a
    missing, corrupted or wrong file stops a run before it writes anything (and a DDP run
    fetches once, not once per rank). Other families check their files when built."""
    name = cfg.get("name") if hasattr(cfg, "get") else None
    if name not in _FETCHERS:
        return
    module_name, fetch, load = _FETCHERS[name]
    module = importlib.import_module(module_name)
    cache = getattr(module, fetch)(require(cfg, "root"), download=bool(require(cfg, "download")))
    getattr(module, load)(cache)


def build_datasets(cfg: DictConfig) -> DataSplits:
    """Train/val/test datasets for the ``data`` config group node ``cfg``."""
    name = cfg.get("name") if hasattr(cfg, "get") else None
    if name not in _BUILDERS:
        raise DataError(
            f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)} "
            "(choose one with data=<name>)"
        )
    module, function = _BUILDERS[name].split(":")
    splits = getattr(importlib.import_module(module), function)(cfg)
    augmentation = getattr(splits.train, "augmentation", None)
    if augmentation is not None and augmentation.crop_padding >= splits.image_size:
        # a crop can then hold padding only; a padding near 2**63 overflows the offsets
        raise DataError(
            f"data.crop_padding={augmentation.crop_padding} is not smaller than the images' "
            f"side ({splits.image_size} pixels) of data={name}; pick a padding below it "
            "(4 on 32 pixels is the usual choice)"
        )
    return splits


def __getattr__(name: str):
    # Import mnist.py on first use only, so `python -m syncbn_lab.data.mnist` runs it cleanly.
    if name == "fetch_mnist":
        from .mnist import fetch_mnist

        return fetch_mnist
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DATASET_NAMES",
    "Augmentation",
    "DataError",
    "DataSplits",
    "ImageDataset",
    "InMemoryImageDataset",
    "build_datasets",
    "prepare_data",
    "fetch_mnist",
]
