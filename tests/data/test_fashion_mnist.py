"""Fashion-MNIST: the strict IDX reader on generated files (every malformed case), the fetch
from an installed package folder and from a .deb (built here with dpkg-deb), the splits, the
dataset, and one test on Debian's real package."""

from __future__ import annotations

import gzip
import hashlib
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from syncbn_lab.data import DataError, build_datasets
from syncbn_lab.data import fashion_mnist as fm
from syncbn_lab.data.fashion_mnist import fetch_fashion_mnist, load_fashion_mnist_arrays
from syncbn_lab.data.idx import parse_idx, read_idx_gz

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"
TRAIN, VAL, TEST = 6, 3, 4  # tiny splits: TRAIN_SIZE is patched to 6 of 9 training images


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file written from the format's definition (independent of the reader)."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += b"".join(struct.pack(">I", size) for size in array.shape)
    return header + array.astype(np.uint8).tobytes()


def fake_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (TRAIN + VAL, 28, 28)),
        "train-labels-idx1-ubyte.gz": rng.integers(0, 10, TRAIN + VAL),
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (TEST, 28, 28)),
        "t10k-labels-idx1-ubyte.gz": rng.integers(0, 10, TEST),
    }


def write_files(folder: Path, contents: dict[str, bytes]) -> dict[str, str]:
    """Write gzip files; returns name -> sha256 of the decompressed content."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in contents.items():
        (folder / name).write_bytes(gzip.compress(content))
    return {name: hashlib.sha256(content).hexdigest() for name, content in contents.items()}


@pytest.fixture
def package(tmp_path, monkeypatch):
    """(package folder with the four generated files, their checksums, the arrays)."""
    monkeypatch.setattr(fm, "TRAIN_SIZE", TRAIN)
    arrays = fake_arrays()
    folder = tmp_path / "usr/share/datasets/fashion-mnist"
    sums = write_files(folder, {name: idx_bytes(a) for name, a in arrays.items()})
    return folder, sums, arrays


def assert_splits(cache: Path, arrays: dict[str, np.ndarray]) -> None:
    got = load_fashion_mnist_arrays(cache)
    images, labels = arrays["train-images-idx3-ubyte.gz"], arrays["train-labels-idx1-ubyte.gz"]
    np.testing.assert_array_equal(got["x_train"], images[:TRAIN])
    np.testing.assert_array_equal(got["x_val"], images[TRAIN:])
    np.testing.assert_array_equal(got["y_train"], labels[:TRAIN])
    np.testing.assert_array_equal(got["y_val"], labels[TRAIN:])
    np.testing.assert_array_equal(got["x_test"], arrays["t10k-images-idx3-ubyte.gz"])
    np.testing.assert_array_equal(got["y_test"], arrays["t10k-labels-idx1-ubyte.gz"])
    assert got["x_train"].dtype == np.uint8 and got["y_train"].dtype == np.int64


def test_round_trip_from_an_installed_package_folder(tmp_path, package):
    folder, sums, arrays = package
    root = tmp_path / "data"
    cache = fetch_fashion_mnist(root, package_dir=folder, checksums=sums, download=False)
    assert cache == root / "fashion_mnist" / "fashion_mnist.npz"
    assert_splits(cache, arrays)
    assert sorted(p.name for p in cache.parent.iterdir()) == sorted([*fm.FILES, cache.name])
    for name in fm.FILES:  # the files themselves are copied, byte for byte
        assert (cache.parent / name).read_bytes() == (folder / name).read_bytes()
    shutil.rmtree(folder)  # the cache is reused; nothing else is read
    assert fetch_fashion_mnist(root, package_dir=folder, download=False) == cache


def test_files_already_in_the_data_folder_are_used_first(tmp_path, package):
    folder, sums, arrays = package
    own = tmp_path / "data" / "fashion_mnist"
    write_files(own, {name: idx_bytes(a) for name, a in arrays.items()})
    cache = fetch_fashion_mnist(tmp_path / "data", package_dir=tmp_path / "nowhere",
                                checksums=sums, download=False)  # fmt: skip
    assert_splits(cache, arrays)


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed")
def test_fetch_extracts_the_package_file_with_dpkg_deb(tmp_path, package):
    folder, sums, arrays = package
    tree = tmp_path / "tree"
    shutil.copytree(folder.parents[3], tree)
    (tree / "DEBIAN").mkdir()
    (tree / "DEBIAN/control").write_text(
        "Package: dataset-fashion-mnist\nVersion: 1\nArchitecture: all\n"
        "Maintainer: test <t@example.org>\nDescription: test\n"
    )
    deb = tmp_path / "store" / "dataset-fashion-mnist_1_all.deb"
    deb.parent.mkdir()
    subprocess.run(["dpkg-deb", "--build", str(tree), str(deb)], check=True, capture_output=True)
    calls = []

    def downloader(dest: Path) -> Path:
        calls.append(dest)
        return Path(shutil.copy(deb, dest))

    root = tmp_path / "data"
    cache = fetch_fashion_mnist(root, package_dir=tmp_path / "none", downloader=downloader,
                                checksums=sums)  # fmt: skip
    assert len(calls) == 1 and not calls[0].exists()  # the temporary folder is gone
    assert_splits(cache, arrays)


def malformed_cases() -> dict[str, tuple[bytes, int, str]]:
    """name -> (IDX content, dims expected, what the error line says)."""
    good = idx_bytes(np.zeros((2, 28, 28)))
    UBYTE3 = "expected 00000803 (unsigned bytes)"  # noqa: N806
    return {
        "empty": (b"", 3, "0 bytes, shorter than the 4-byte magic number"),
        "magic": (
            b"\x01" + good[1:],
            3,
            "magic number 01000803, " + UBYTE3,
        ),
        "type": (
            good[:2] + b"\x0d" + good[3:],
            3,
            "magic number 00000d03, " + UBYTE3,
        ),
        "dims": (idx_bytes(np.zeros((2, 784))), 3, "2 dimensions, expected 3"),
        "header": (good[:10], 3, "10 bytes, shorter than its 16-byte header"),
        "truncated": (good[:-1], 3, "sizes 2x28x28 need 1584 bytes, the file has 1583"),
        "trailing": (good + b"\x00", 3, "sizes 2x28x28 need 1584 bytes, the file has 1585"),
    }


@pytest.mark.parametrize("case", list(malformed_cases()))
def test_every_malformed_idx_file_is_one_line_naming_it(tmp_path, case):
    content, ndim, problem = malformed_cases()[case]
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(content))
    with pytest.raises(DataError) as info:
        read_idx_gz(path, ndim, expected_sha256=None, fix="FIX")
    message = str(info.value)
    assert message == f"{path} is not a valid IDX file ({problem}); FIX"
    assert "\n" not in message
    with pytest.raises(DataError, match="not a valid IDX file"):
        parse_idx(content, ndim, source="x", fix="FIX")


def test_gzip_errors_and_checksum(tmp_path):
    content = idx_bytes(np.arange(12).reshape(3, 2, 2))
    path = tmp_path / "ok.gz"
    path.write_bytes(gzip.compress(content))
    np.testing.assert_array_equal(
        read_idx_gz(path, 3, expected_sha256=hashlib.sha256(content).hexdigest(), fix="F"),
        np.arange(12).reshape(3, 2, 2),
    )
    with pytest.raises(DataError, match=f"sha256 mismatch for the decompressed content of {path}"
                       ": expected 0{64}, got [0-9a-f]{64}; F$"):  # fmt: skip
        read_idx_gz(path, 3, expected_sha256="0" * 64, fix="F")
    for broken in (content, gzip.compress(content)[:-9]):  # not gzip; gzip cut short
        path.write_bytes(broken)
        with pytest.raises(DataError, match=f"{path} is not a readable gzip file .*; F$"):
            read_idx_gz(path, 3, expected_sha256=None, fix="F")


def broken_package(tmp_path: Path, name: str, content: bytes) -> tuple[Path, dict[str, str]]:
    arrays = fake_arrays()
    contents = {n: idx_bytes(a) for n, a in arrays.items()} | {name: content}
    folder = tmp_path / "pkg"
    return folder, write_files(folder, contents)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("train-labels-idx1-ubyte.gz", idx_bytes(np.array([1, 2, 10] + [0] * 6)),
         "holds label 10, outside 0..9"),
        ("t10k-labels-idx1-ubyte.gz", idx_bytes(np.zeros(TEST + 1)), "holds 5 labels for 4 images"),
        ("t10k-images-idx3-ubyte.gz", idx_bytes(np.zeros((TEST, 28, 27))),
         "holds 28x27 images, expected 28x28"),
        ("train-images-idx3-ubyte.gz", idx_bytes(np.zeros((TRAIN + VAL, 28, 28)))[:-5],
         "is not a valid IDX file"),
    ],
)  # fmt: skip
def test_bad_package_files_write_nothing(tmp_path, monkeypatch, name, content, message):
    monkeypatch.setattr(fm, "TRAIN_SIZE", TRAIN)
    folder, sums = broken_package(tmp_path, name, content)
    root = tmp_path / "data"
    with pytest.raises(DataError, match=message) as info:
        fetch_fashion_mnist(root, package_dir=folder, checksums=sums)
    assert str(folder / name) in str(info.value) and "by hand" in str(info.value)
    assert not (root / "fashion_mnist").exists() or not any((root / "fashion_mnist").iterdir())


def test_wrong_checksum_writes_nothing_and_a_bad_own_file_says_delete_it(tmp_path, package):
    folder, sums, arrays = package
    root = tmp_path / "data"
    with pytest.raises(DataError, match="sha256 mismatch.*t10k-labels"):
        fetch_fashion_mnist(root, package_dir=folder, checksums=sums | {
            "t10k-labels-idx1-ubyte.gz": "f" * 64})  # fmt: skip
    assert not (root / "fashion_mnist").exists()
    own = root / "fashion_mnist"
    write_files(own, {"t10k-images-idx3-ubyte.gz": b"\x00\x00\x08\x03"})
    with pytest.raises(DataError, match=f"{own}/t10k-images.*delete it and run `python -m "
                       "syncbn_lab.data.fashion_mnist --root"):  # fmt: skip
        fetch_fashion_mnist(root, package_dir=folder, checksums=sums)
    assert sorted(p.name for p in own.iterdir()) == ["t10k-images-idx3-ubyte.gz"]


def test_missing_data_without_download(tmp_path):
    with pytest.raises(DataError, match="Fashion-MNIST is missing.*data.download=true.*by hand"):
        fetch_fashion_mnist(tmp_path, package_dir=tmp_path / "none", download=False)


def test_apt_failures_are_one_line(tmp_path, monkeypatch):
    seen = {}

    def unknown(command, **kwargs):
        seen["command"], seen["cwd"] = command, kwargs["cwd"]
        err = "E: Unable to locate package dataset-fashion-mnist\n"
        return subprocess.CompletedProcess(command, 100, "", "Reading package lists...\n" + err)

    monkeypatch.setattr(fm.subprocess, "run", unknown)
    unknown_package = (
        r"apt knows no package dataset-fashion-mnist; run `apt-get update` \(as root\).*by hand "
        r"\(the official downloads"
    )
    with pytest.raises(DataError, match=unknown_package):
        fetch_fashion_mnist(tmp_path, package_dir=tmp_path / "none")
    assert seen["command"] == ["apt-get", "download", "dataset-fashion-mnist"]
    assert not Path(seen["cwd"]).exists()  # a temporary folder, removed again

    def absent(command, **kwargs):
        raise FileNotFoundError(command[0])

    monkeypatch.setattr(fm.subprocess, "run", absent)
    with pytest.raises(DataError, match="`apt-get` is not installed here.*by hand"):
        fetch_fashion_mnist(tmp_path, package_dir=tmp_path / "none")

    def slow(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(fm.subprocess, "run", slow)
    with pytest.raises(DataError, match="did not finish within 7 s"):
        fm.apt_download(tmp_path, timeout=7)
    assert not list((tmp_path).glob("fashion_mnist"))


def test_build_datasets_and_command_line(tmp_path, package, monkeypatch, capsys):
    folder, sums, arrays = package
    monkeypatch.setattr(fm, "PACKAGE_DIR", folder)
    monkeypatch.setattr(fm, "FILES", sums)
    cfg = OmegaConf.merge(OmegaConf.load(CONFIGS / "fashion_mnist.yaml"), {"root": str(tmp_path)})
    splits = build_datasets(cfg)
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (10, 1, 28)
    assert [len(getattr(splits, s)) for s in ("train", "val", "test")] == [TRAIN, VAL, TEST]
    image, label = splits.val[1]
    raw = torch.from_numpy(arrays["train-images-idx3-ubyte.gz"][TRAIN + 1]).double() / 255
    torch.testing.assert_close(image[0].double(), (raw - 0.2855) / 0.3528, rtol=0, atol=1e-5)
    assert label == arrays["train-labels-idx1-ubyte.gz"][TRAIN + 1]
    assert fm.main(["--root", str(tmp_path / "cli")]) == 0
    assert f"train {TRAIN}, val {VAL}, test {TEST}" in capsys.readouterr().out


@pytest.mark.slow
def test_the_real_debian_package(tmp_path):
    """The installed package, else `apt-get download` (31 MB); skipped where apt cannot get it."""
    try:
        cache = fetch_fashion_mnist(tmp_path)
    except DataError as exc:
        if fm.PACKAGE_DIR.is_dir() or "sha256" in str(exc) or "IDX" in str(exc):
            raise
        pytest.skip(f"apt cannot fetch {fm.PACKAGE}: {exc}")
    arrays = load_fashion_mnist_arrays(cache)  # the checksums were checked on the way
    assert [len(arrays[f"y_{s}"]) for s in ("train", "val", "test")] == [50_000, 10_000, 10_000]
    train = arrays["x_train"].astype(np.float64) / 255
    assert round(train.mean(), 4) == fm.MEAN and round(train.std(), 4) == fm.STD
    for split in ("train", "val", "test"):
        counts = np.bincount(arrays[f"y_{split}"], minlength=10)
        assert counts.min() > 0.9 * counts.mean()  # every split holds all ten classes evenly


def test_a_run_with_a_bad_file_stops_before_writing_anything(tmp_path, package, monkeypatch):
    from conftest import compose_config

    from syncbn_lab.train import run

    folder, sums, arrays = package
    monkeypatch.setattr(fm, "PACKAGE_DIR", folder)
    monkeypatch.setattr(fm, "FILES", sums)
    own = tmp_path / "data" / "fashion_mnist"
    write_files(own, {"train-labels-idx1-ubyte.gz": idx_bytes(np.full(TRAIN + VAL, 12))})
    cfg = compose_config(["data=fashion_mnist", f"data.root={tmp_path / 'data'}", "logger=none"])
    with pytest.raises(DataError, match="sha256 mismatch .*train-labels.*; delete it and run"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert sorted(p.name for p in own.iterdir()) == ["train-labels-idx1-ubyte.gz"]
