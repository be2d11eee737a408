"""ELPV: 2,624 electroluminescence photographs of solar-cell patches, 4 defect levels.

Buerhop-Lutz et al. (2018) and Deitsch et al. (2019) published the images: 300 x 300 8-bit
grayscale crops of single cells from mono- and polycrystalline modules, each labelled with the
probability an expert gave that the cell is defective (0, 1/3, 2/3 or 1; the four classes here,
in that order). They ship inside the PyPI wheel ``elpv-dataset==1.0.0.post1`` under
CC BY-NC-SA 4.0 (non-commercial use, attribution, share-alike): see docs/data.md.
:mod:`syncbn_lab.data.wheels` downloads the wheel, checks its sha256 and keeps it in
``<root>/elpv/``; the labels file and the PNGs are read from the zip. Each image is shrunk to
64 x 64 by area averaging (PIL's box filter), which a CPU affords. The pool is split once,
within each (class, cell type) stratum, into 65 % train, 10 % val and 25 % test (seed 0), and
cached as ``<root>/elpv/elpv.npz``. From a shell or a Makefile::

    python -m syncbn_lab.data.elpv --root data
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np

from .base import DataError
from .wheels import WheelDataset, read_members

FOLDER_IN_WHEEL = "elpv_dataset/data"
LABELS = f"{FOLDER_IN_WHEEL}/labels.csv"
POOL_SIZE = 2_624
SOURCE_SIZE = 300
IMAGE_SIZE = 64
NUM_CLASSES = 4
CELL_TYPES = ("mono", "poly")


def parse_labels(text: str, fix: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """labels.csv (``images/cellNNNN.png  probability  type`` a line): the image paths inside
    the wheel, the class (probability x 3) and the cell type's index."""
    paths, classes, types = [], [], []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            path, probability, cell_type = fields
            level = float(probability) * (NUM_CLASSES - 1)
            if abs(level - round(level)) > 0.01 or not 0 <= round(level) < NUM_CLASSES:
                raise ValueError(f"probability {probability}")
            types.append(CELL_TYPES.index(cell_type))
        except ValueError as exc:
            raise DataError(f"{LABELS}, line {number}: {line.strip()!r} is malformed ({exc}); "
                            f"{fix}") from exc  # fmt: skip
        paths.append(f"{FOLDER_IN_WHEEL}/{path}")
        classes.append(round(level))
    if len(paths) != POOL_SIZE:
        raise DataError(f"{LABELS} lists {len(paths)} images, expected {POOL_SIZE}; {fix}")
    return paths, np.array(classes, dtype=np.int64), np.array(types, dtype=np.int64)


def shrink(png: bytes, source: str, fix: str) -> np.ndarray:
    """One 300 x 300 grayscale PNG as a 64 x 64 uint8 array (area averaging)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(png)) as image:
            if image.mode != "L" or image.size != (SOURCE_SIZE, SOURCE_SIZE):
                raise DataError(f"{source} is {image.mode} {image.size[0]}x{image.size[1]}, "
                                f"expected L {SOURCE_SIZE}x{SOURCE_SIZE}; {fix}")  # fmt: skip
            small = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)
            return np.asarray(small, dtype=np.uint8)
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"{source} is not a readable PNG ({exc}); {fix}") from exc


def read_pool(wheel: Path, fix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 2,624 images at 64 x 64, their classes, and (class, cell type) strata."""
    labels_text = read_members(wheel, [LABELS], fix=fix)[LABELS].decode("ascii", "replace")
    paths, classes, types = parse_labels(labels_text, fix)
    pngs = read_members(wheel, paths, fix=fix)
    images = np.stack([shrink(pngs[path], f"{wheel}:{path}", fix) for path in paths])
    return images, classes, classes * len(CELL_TYPES) + types


ELPV = WheelDataset(
    name="elpv",
    requirement="elpv-dataset==1.0.0.post1",
    sha256="85e31c1126ee9b48e62d3a0232c58f58b2d189b0814a45c13642fa0415af4a4c",
    image_size=IMAGE_SIZE,
    num_classes=NUM_CLASSES,
    read_pool=read_pool,
    fractions={"train": 0.65, "val": 0.1, "test": 0.25},
    split_seed=0,
    mean=0.5974,
    std=0.1584,
)
build_elpv, fetch_elpv, load_elpv_arrays = ELPV.build, ELPV.fetch, ELPV.load

if __name__ == "__main__":
    sys.exit(ELPV.main())
