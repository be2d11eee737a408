"""A strict reader of IDX files (the format of MNIST and Fashion-MNIST), gzip-compressed.

An IDX file is a 4-byte magic number ``00 00 <type> <ndim>``, then ``ndim`` big-endian
uint32 sizes, then the values in C order. Only unsigned bytes (type ``0x08``) are read,
which is all the MNIST family uses. Every deviation (magic, dimension count, a size that
does not match the file length, a label out of range, a checksum) is a one-line
:class:`DataError` naming the file and the fix.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import zlib
from pathlib import Path

import numpy as np

from .base import DataError

UBYTE = 0x08


def read_idx_gz(path: Path, ndim: int, *, expected_sha256: str | None, fix: str) -> np.ndarray:
    """The uint8 array of the gzip-compressed IDX file ``path``, which must have ``ndim`` dims.

    ``expected_sha256`` is checked against the *decompressed* content (recompressing, as
    Debian does, changes the .gz bytes but not the content). ``fix`` ends every error line.
    """
    try:
        with gzip.open(path, "rb") as f:
            content = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path} is not a readable gzip file ({exc}); {fix}") from exc
    array = parse_idx(content, ndim, source=path, fix=fix)
    if expected_sha256 is not None:
        actual = hashlib.sha256(content).hexdigest()
        if actual != expected_sha256:
            raise DataError(
                f"sha256 mismatch for the decompressed content of {path}: expected "
                f"{expected_sha256}, got {actual}; {fix}"
            )
    return array


def parse_idx(content: bytes, ndim: int, *, source: Path | str, fix: str) -> np.ndarray:
    """Parse IDX bytes holding unsigned bytes in ``ndim`` dimensions (see the module doc)."""

    def fail(problem: str) -> DataError:
        return DataError(f"{source} is not a valid IDX file ({problem}); {fix}")

    if len(content) < 4:
        raise fail(f"{len(content)} bytes, shorter than the 4-byte magic number")
    zero, kind, dims = content[:2], content[2], content[3]
    if zero != b"\x00\x00" or kind != UBYTE:
        raise fail(
            f"magic number {content[:4].hex()}, expected 0000{UBYTE:02x}{ndim:02x} (unsigned bytes)"
        )
    if dims != ndim:
        raise fail(f"{dims} dimensions, expected {ndim}")
    header = 4 + 4 * ndim
    if len(content) < header:
        raise fail(f"{len(content)} bytes, shorter than its {header}-byte header")
    shape = tuple(int.from_bytes(content[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + math.prod(shape)
    if len(content) != expected:
        raise fail(
            f"sizes {'x'.join(map(str, shape))} need {expected} bytes, the file has {len(content)}"
        )
    return np.frombuffer(content, dtype=np.uint8, offset=header).reshape(shape)


def check_labels(
    labels: np.ndarray, images: np.ndarray, num_classes: int, *, source: Path, fix: str
) -> np.ndarray:
    """``labels`` as int64 after checking their count against ``images`` and their range."""
    if labels.shape[0] != images.shape[0]:
        raise DataError(
            f"{source} holds {labels.shape[0]} labels for {images.shape[0]} images; {fix}"
        )
    if labels.size and labels.max() >= num_classes:
        raise DataError(
            f"{source} holds label {int(labels.max())}, outside 0..{num_classes - 1}; {fix}"
        )
    return labels.astype(np.int64)
