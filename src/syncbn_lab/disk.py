"""Writing files on a disk that may fill up: a full disk is one line that names the file, the
space left and what to do (:class:`DiskFull`), never a traceback; what was complete before
stays (every file that is replaced is written beside it and renamed into place)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from syncbn_lab.errors import OneLineError, UserError

FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, disk quota exceeded
DEFAULT_FIX = "free space there or write to another disk"


class DiskFull(OneLineError):
    """A write failed because the disk (or the user's quota) is full."""

    reason = "disk full"

    def __init__(self, path: str | Path, fix: str = DEFAULT_FIX):
        self.init_args = (str(path), fix)  # pickled as these (a rank sends it to its parent)
        super().__init__(
            f"no space left on the disk of {path} ({free_space(Path(path))} free there); {fix}"
        )


def free_space(path: Path) -> str:
    """The free space of the file system holding ``path`` (or its nearest existing parent),
    e.g. ``12 kB``; ``?`` where it cannot be read."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                free = shutil.disk_usage(folder).free
            except OSError:
                return "?"
            for unit in ("B", "kB", "MB", "GB"):
                if free < 1000 or unit == "GB":
                    return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
                free /= 1000
    return "?"


def make_folder(folder: Path, fix: str) -> None:
    """``folder`` and its parents, made where missing. One that cannot be made (a file in its
    place, a parent that takes no new folder) is a :class:`UserError` line naming it and
    ``fix``; a full disk is :class:`DiskFull`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in FULL:
            raise DiskFull(folder) from None
        raise UserError(f"cannot make the folder {folder} ({e.strerror}); {fix}") from None


@contextlib.contextmanager
def writing(path: str | Path, fix: str = DEFAULT_FIX) -> Iterator[None]:
    """Inside, an OSError of a full disk becomes :class:`DiskFull` naming ``path``, also where
    it caused the error that leaves the block (torch.save's writer fails in its turn)."""
    try:
        yield
    except Exception as e:
        if _full(e):
            raise DiskFull(path, fix) from None
        raise


def _full(error: BaseException | None) -> bool:
    """Whether ``error`` or an error it came from is a full disk's OSError."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in FULL:
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def write_atomic(path: Path, data: str | bytes, fix: str = DEFAULT_FIX) -> None:
    """Write ``data`` to ``path`` through a file beside it renamed into place: a reader never
    sees half of it, and a full disk (:class:`DiskFull`) leaves ``path`` as it was."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with writing(path, fix), open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
