"""Fashion-MNIST (Xiao et al. 2017) from Debian's ``dataset-fashion-mnist`` package.

The four official IDX files are kept in ``<root>/fashion_mnist/``. When some are missing
they are taken from ``/usr/share/datasets/fashion-mnist/`` if the package is installed, or
else from the package file itself: ``apt-get download dataset-fashion-mnist`` into a
temporary folder (no install, no root) and ``dpkg-deb -x``. The sha256 of each file's
decompressed content is checked (Debian recompresses the files, so the .gz bytes differ
from the official downloads; the content is the same, and those downloads work too).

Splits: train = images 0..49,999 of the official training file, val = images
50,000..59,999 of it, test = the official 10,000 test images. They are converted once to
a uint8 cache ``<root>/fashion_mnist/fashion_mnist.npz``; every write is atomic. From a
shell or a Makefile::

    python -m syncbn_lab.data.fashion_mnist --root data
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .base import DataError, DataSplits, require, resolve_root
from .files import copy_atomic, fetch_main, load_image_cache, write_npz_atomic
from .idx import check_labels, read_idx_gz
from .image_dataset import uint8_splits

PACKAGE = "dataset-fashion-mnist"
DEB_FOLDER = "usr/share/datasets/fashion-mnist"  # where the package puts the four files
PACKAGE_DIR = Path("/") / DEB_FOLDER
FOLDER = "fashion_mnist"
CACHE_NAME = "fashion_mnist.npz"
#: file name -> sha256 of its decompressed content (the same for Debian's and the official .gz)
FILES = {
    "train-images-idx3-ubyte.gz": (
        "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"
    ),
    "train-labels-idx1-ubyte.gz": (
        "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"
    ),
    "t10k-images-idx3-ubyte.gz": (
        "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"
    ),
    "t10k-labels-idx1-ubyte.gz": (
        "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"
    ),
}
TRAIN_SIZE = 50_000  # the first 50,000 official training images; the other 10,000 are val
#: measured on the 50,000 train-split images (pixels in [0, 1]); tests check both
MEAN, STD = 0.2855, 0.3528
SPLITS = ("train", "val", "test")
IMAGE_SIZE = 28
NUM_CLASSES = 10

#: Fetches the package file into the given (empty, temporary) folder and returns its path.
Downloader = Callable[[Path], Path]


def _fetch_command(root: Path) -> str:
    return f"python -m syncbn_lab.data.fashion_mnist --root {root}"


def _by_hand(folder: Path) -> str:
    return (
        f"put {', '.join(FILES)} into {folder} by hand (the official downloads of "
        "zalandoresearch/fashion-mnist work too)"
    )


def _run(command: list[str], what: str, how_to: str, *, cwd: Path, timeout: float) -> str:
    """Run ``command``; its failure is one DataError line ending in ``how_to``."""
    try:
        proc = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise DataError(
            f"`{command[0]}` is not installed here (needed to {what}); {how_to}"
        ) from None
    except subprocess.TimeoutExpired:
        raise DataError(
            f"`{' '.join(command)}` did not finish within {timeout:.0f} s; {how_to}"
        ) from None
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("E:")] or lines
        reason = errors[-1] if errors else f"exit status {proc.returncode}"
        if "Unable to locate package" in reason or "has no installation candidate" in reason:
            raise DataError(
                f"apt knows no package {PACKAGE}; run `apt-get update` (as root) and try again, "
                f"or {how_to}"
            )
        raise DataError(f"`{' '.join(command)}` failed ({reason}); {how_to}")
    return proc.stdout


def apt_download(dest_dir: Path, *, timeout: float = 600.0, how_to: str = "") -> Path:
    """``apt-get download dataset-fashion-mnist`` into ``dest_dir`` (nothing is installed)."""
    how_to = how_to or _by_hand(Path("data") / FOLDER)
    command = ["apt-get", "download", PACKAGE]
    _run(command, "download the package", how_to, cwd=dest_dir, timeout=timeout)
    debs = sorted(dest_dir.glob("*.deb"))
    if len(debs) != 1:
        raise DataError(f"`apt-get download {PACKAGE}` left {len(debs)} .deb files, expected 1")
    return debs[0]


def extract_deb(deb: Path, dest_dir: Path, *, how_to: str, timeout: float = 300.0) -> Path:
    """``dpkg-deb -x`` the package into ``dest_dir``; returns the folder of the four files."""
    _run(["dpkg-deb", "-x", str(deb), str(dest_dir)], "unpack the package", how_to,
         cwd=deb.parent, timeout=timeout)  # fmt: skip
    folder = dest_dir / DEB_FOLDER
    missing = [name for name in FILES if not (folder / name).is_file()]
    if missing:
        raise DataError(f"{deb.name} holds no {', '.join(missing)} under /{DEB_FOLDER}; {how_to}")
    return folder


def read_splits(
    files: dict[str, Path], fix: Callable[[Path], str], checksums: dict[str, str] = FILES
) -> dict[str, np.ndarray]:
    """The three splits from the four IDX files (name -> path), every file strictly checked
    (``checksums``: name -> sha256 of the decompressed content)."""
    arrays: dict[str, np.ndarray] = {}
    for prefix, splits in (("train", ("train", "val")), ("t10k", ("test",))):
        image_path = files[f"{prefix}-images-idx3-ubyte.gz"]
        label_path = files[f"{prefix}-labels-idx1-ubyte.gz"]
        images = read_idx_gz(
            image_path, 3, expected_sha256=checksums[image_path.name], fix=fix(image_path)
        )
        if images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
            raise DataError(
                f"{image_path} holds {images.shape[1]}x{images.shape[2]} images, expected "
                f"{IMAGE_SIZE}x{IMAGE_SIZE}; {fix(image_path)}"
            )
        labels = read_idx_gz(
            label_path, 1, expected_sha256=checksums[label_path.name], fix=fix(label_path)
        )
        labels = check_labels(labels, images, NUM_CLASSES, source=label_path, fix=fix(label_path))
        if prefix == "train":
            bounds = {"train": slice(0, TRAIN_SIZE), "val": slice(TRAIN_SIZE, None)}
        else:
            bounds = {"test": slice(None)}
        for split in splits:
            arrays[f"x_{split}"] = np.ascontiguousarray(images[bounds[split]])
            arrays[f"y_{split}"] = labels[bounds[split]]
    return arrays


def fetch_fashion_mnist(
    root: str | os.PathLike = "data",
    *,
    download: bool = True,
    package_dir: Path | None = None,
    downloader: Downloader | None = None,
    checksums: dict[str, str] | None = None,
) -> Path:
    """Make sure ``<root>/fashion_mnist/fashion_mnist.npz`` exists and return its path.

    An existing cache is returned as is. Otherwise the four files come from
    ``<root>/fashion_mnist/``, then ``package_dir`` (the installed package), then the
    package file ``downloader`` fetches (default: ``apt-get download``), in that order per
    file; each is checked before it is copied into ``<root>/fashion_mnist/``. Tests inject
    ``package_dir`` (default :data:`PACKAGE_DIR`), ``downloader`` and ``checksums``
    (default :data:`FILES`).
    """
    package_dir = PACKAGE_DIR if package_dir is None else package_dir
    root_path = resolve_root(root)
    folder = root_path / FOLDER
    cache = folder / CACHE_NAME
    if cache.is_file():
        return cache
    how_to = _by_hand(folder)
    fetch_again = f"delete it and run `{_fetch_command(root_path)}` to fetch it again"

    def fix(path: Path) -> str:
        return fetch_again if path.parent == folder else how_to

    files = {name: folder / name for name in FILES if (folder / name).is_file()}
    missing = [name for name in FILES if name not in files]
    with tempfile.TemporaryDirectory(prefix="fashion-mnist-") as tmp:
        if missing and all((package_dir / name).is_file() for name in missing):
            files |= {name: package_dir / name for name in missing}
        elif missing and not download:
            raise DataError(
                f"Fashion-MNIST is missing: no {cache} and no {', '.join(missing)} in {folder}; "
                f"run `{_fetch_command(root_path)}` or set data.download=true, or {how_to}"
            )
        elif missing:
            deb = (downloader or (lambda d: apt_download(d, how_to=how_to)))(Path(tmp))
            extracted = extract_deb(deb, Path(tmp) / "extracted", how_to=how_to)
            files |= {name: extracted / name for name in missing}
        arrays = read_splits(
            files, fix, checksums or FILES
        )  # every file checked before anything is written
        folder.mkdir(parents=True, exist_ok=True)
        for name in missing:
            copy_atomic(files[name], folder / name)
    write_npz_atomic(arrays, cache)
    return cache


def load_fashion_mnist_arrays(cache: Path) -> dict[str, np.ndarray]:
    """Read and check the uint8 cache written by :func:`fetch_fashion_mnist`."""
    return load_image_cache(cache, SPLITS, IMAGE_SIZE, NUM_CLASSES, "the four IDX files")


def build_fashion_mnist(cfg: Any) -> DataSplits:
    """Fashion-MNIST splits from a ``configs/data/fashion_mnist.yaml`` node."""
    cache = fetch_fashion_mnist(require(cfg, "root"), download=bool(require(cfg, "download")))
    splits = uint8_splits(load_fashion_mnist_arrays(cache), cfg, (MEAN,), (STD,))
    return DataSplits(**splits, num_classes=NUM_CLASSES, in_channels=1, image_size=IMAGE_SIZE)


def main(argv: list[str] | None = None) -> int:
    return fetch_main(
        argv,
        f"Fetch Fashion-MNIST (from Debian's {PACKAGE}) into ROOT/{FOLDER}/.",
        fetch_fashion_mnist,
        load_fashion_mnist_arrays,
    )


if __name__ == "__main__":
    sys.exit(main())
