"""File helpers shared by the dataset families that fetch and cache files (MNIST, Fashion-MNIST).

Every write is atomic (a temporary file next to the target, then ``os.replace``), so an
interrupted fetch or conversion never leaves a partial file under the final name.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .base import DataError


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_target(dest: Path) -> tuple[int, Path]:
    """A temporary file next to ``dest`` (for ``os.replace``), readable like a normal new file."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, Path(tmp)


def copy_atomic(source: Path, dest: Path) -> None:
    """Copy ``source`` to ``dest`` so that ``dest`` is either absent or complete."""
    fd, tmp = atomic_target(dest)
    try:
        with os.fdopen(fd, "wb") as dst, open(source, "rb") as src:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def write_npz_atomic(arrays: dict[str, np.ndarray], dest: Path) -> None:
    """``np.savez_compressed(dest, **arrays)``, atomically."""
    fd, tmp = atomic_target(dest)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def load_image_cache(
    cache: Path, splits: tuple[str, ...], image_size: int, num_classes: int, rebuilt_from: str
) -> dict[str, np.ndarray]:
    """Read a uint8 image cache (``x_<split>`` N x H x W, ``y_<split>`` int64) and check it.

    ``rebuilt_from`` names what the cache is rebuilt from once deleted (for the error line).
    """
    delete = f"delete {cache} and it is rebuilt from {rebuilt_from}"
    try:
        with np.load(cache, allow_pickle=False) as npz:
            arrays = {f"{k}_{s}": npz[f"{k}_{s}"] for s in splits for k in ("x", "y")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise DataError(f"{cache} is unreadable ({type(exc).__name__}: {exc}); {delete}") from exc
    for split in splits:
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        ok = (
            x.dtype == np.uint8
            and x.ndim == 3
            and x.shape[1:] == (image_size, image_size)
            and y.dtype == np.int64
            and y.shape == (x.shape[0],)
            and (y.size == 0 or (y.min() >= 0 and y.max() < num_classes))
        )
        if not ok:
            raise DataError(
                f"{cache} has a malformed {split} split (images {x.shape} {x.dtype}, labels "
                f"{y.shape} {y.dtype}); {delete}"
            )
    return arrays


def fetch_main(
    argv: list[str] | None,
    description: str,
    fetch: Callable[[str], Path],
    load: Callable[[Path], dict[str, np.ndarray]],
) -> int:
    """The command line of a fetcher: ``--root``, then one line of split sizes or the error."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", default="data", help="data folder (default: data)")
    args = parser.parse_args(argv)
    try:
        cache = fetch(args.root)
        arrays = load(cache)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    splits = [key[2:] for key in arrays if key.startswith("x_")]
    counts = ", ".join(f"{split} {arrays[f'x_{split}'].shape[0]}" for split in splits)
    print(f"{cache}: {counts}")
    return 0
