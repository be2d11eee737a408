"""CIFAR from tiny files in CIFAR's own on-disk format, checked against torchvision's reader."""

from __future__ import annotations

import hashlib
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from omegaconf import OmegaConf

from syncbn_lab.data import DataError, build_datasets
from syncbn_lab.data import cifar as cifar_mod

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"
PER_BATCH = 6  # images per CIFAR-10 training batch file in these tests


def write_pickle(path: Path, obj: dict, byte_keys: bool) -> None:
    if byte_keys:
        obj = {k.encode(): v for k, v in obj.items()}
    path.write_bytes(pickle.dumps(obj, protocol=2))


def write_cifar10(root: Path, *, byte_keys: bool = False, seed: int = 0) -> np.ndarray:
    """cifar-10-batches-py/ with 5 train batches and a test batch; returns the train data."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train = []
    for name, n in [*((f"data_batch_{i}", PER_BATCH) for i in range(1, 6)), ("test_batch", 7)]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        entry = {
            "batch_label": name,
            "labels": labels,
            "data": data,
            "filenames": [f"{i}.png" for i in range(n)],
        }
        write_pickle(folder / name, entry, byte_keys)
        if name != "test_batch":
            train.append(data)
    names = [
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    ]
    meta = {"num_cases_per_batch": PER_BATCH, "label_names": names, "num_vis": 3072}
    write_pickle(folder / "batches.meta", meta, byte_keys)
    return np.concatenate(train)


def write_cifar100(root: Path) -> None:
    rng = np.random.default_rng(1)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    for name, n in (("train", 40), ("test", 9)):
        fine = [int(v) for v in rng.integers(0, 100, n)]
        entry = {
            "filenames": [f"{i}.png" for i in range(n)],
            "batch_label": name,
            "fine_labels": fine,
            "coarse_labels": [v // 5 for v in fine],
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        }
        write_pickle(folder / name, entry, byte_keys=True)
    meta = {
        "fine_label_names": [f"c{i}" for i in range(100)],
        "coarse_label_names": [f"s{i}" for i in range(20)],
    }
    write_pickle(folder / "meta", meta, byte_keys=True)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def cfg_for(root: Path, name: str = "cifar10", **overrides):
    base = OmegaConf.load(CONFIGS / f"{name}.yaml")
    return OmegaConf.merge(
        base, {"root": str(root), "verify_checksums": False, "val_size": 8}, overrides
    )


def test_matches_torchvision_reader(tmp_path):
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"

    class TinyCIFAR10(torchvision.datasets.CIFAR10):
        # torchvision checks md5s from these class tables; point them at the test's files.
        train_list = [[f"data_batch_{i}", md5(folder / f"data_batch_{i}")] for i in range(1, 6)]
        test_list = [["test_batch", md5(folder / "test_batch")]]
        meta = {
            "filename": "batches.meta",
            "key": "label_names",
            "md5": md5(folder / "batches.meta"),
        }

    reference_train = TinyCIFAR10(str(tmp_path), train=True)
    reference_test = TinyCIFAR10(str(tmp_path), train=False)
    splits = build_datasets(cfg_for(tmp_path))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (10, 3, 32)
    assert len(splits.train) == 5 * PER_BATCH - 8 and len(splits.val) == 8
    # train + val, in original order, equal torchvision's training set (HWC -> CHW).
    order = torch.argsort(torch.cat([splits.train.source_indices, splits.val.source_indices]))
    images = torch.cat([splits.train.images, splits.val.images])[order]
    labels = torch.cat([splits.train.targets, splits.val.targets])[order]
    assert torch.equal(images, torch.from_numpy(reference_train.data).permute(0, 3, 1, 2))
    assert labels.tolist() == reference_train.targets
    assert torch.equal(
        splits.test.images, torch.from_numpy(reference_test.data).permute(0, 3, 1, 2)
    )
    assert splits.test.targets.tolist() == reference_test.targets
    assert splits.train.classes == reference_train.classes
    # The md5 check passes on genuine files: feed it the table of these files.
    cifar_mod.verify_md5s(folder, {name: md5(folder / name) for name in cifar_mod.CIFAR10.files})


def test_bytes_keys_as_written_by_cifar_itself(tmp_path):
    data = write_cifar10(tmp_path, byte_keys=True)
    splits = build_datasets(cfg_for(tmp_path))
    assert len(splits.train) + len(splits.val) == len(data)
    first = splits.val.source_indices[0].item()
    assert torch.equal(splits.val.images[0], torch.from_numpy(data[first]).view(3, 32, 32))


def test_val_split_fixed_disjoint_and_seeded(tmp_path):
    write_cifar10(tmp_path)
    a, b = build_datasets(cfg_for(tmp_path)), build_datasets(cfg_for(tmp_path))
    assert torch.equal(a.val.source_indices, b.val.source_indices) and torch.equal(
        a.val.images, b.val.images
    )
    union = torch.cat([a.train.source_indices, a.val.source_indices]).sort().values
    assert torch.equal(union, torch.arange(5 * PER_BATCH))
    other = build_datasets(cfg_for(tmp_path, split_seed=1))
    assert not torch.equal(a.val.source_indices, other.val.source_indices)
    with pytest.raises(DataError, match="val_size=30 must be between 1 and 29"):
        build_datasets(cfg_for(tmp_path, val_size=30))


def test_normalisation_and_augmentation_only_on_train(tmp_path):
    write_cifar10(tmp_path)
    splits = build_datasets(cfg_for(tmp_path))
    assert splits.train.augments and not splits.val.augments and not splits.test.augments
    mean = torch.tensor(cifar_mod.CIFAR10.mean).view(3, 1, 1)
    std = torch.tensor(cifar_mod.CIFAR10.std).view(3, 1, 1)
    for dataset in (splits.val, splits.test):
        image, label = dataset[2]
        assert (
            image.dtype == torch.float32 and image.shape == (3, 32, 32) and isinstance(label, int)
        )
        expected = (dataset.images[2].float() / 255 - mean) / std
        torch.testing.assert_close(image, expected, rtol=0, atol=1e-5)
        batch = dataset.__getitems__([2, 0, 2])
        torch.testing.assert_close(batch[0][0], image, rtol=0, atol=0)


def test_cifar100_fine_labels(tmp_path):
    write_cifar100(tmp_path)
    splits = build_datasets(cfg_for(tmp_path, name="cifar100", val_size=10))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (100, 3, 32)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (30, 10, 9)
    assert max(splits.train.targets.max(), splits.test.targets.max()) < 100
    assert splits.test.classes[7] == "c7"


def test_checksums_are_verified_by_default(tmp_path):
    write_cifar10(tmp_path)
    with pytest.raises(DataError, match=r"data_batch_1 has md5 [0-9a-f]{32}, expected c99cafc1"):
        build_datasets(cfg_for(tmp_path, verify_checksums=True))


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_missing_files_without_download(tmp_path, name):
    spec = cifar_mod.SPECS[name]
    start = time.monotonic()
    with pytest.raises(DataError) as info:
        build_datasets(cfg_for(tmp_path, name=name, download=False))
    message = str(info.value)
    assert str(tmp_path / spec.folder) in message and "\n" not in message
    assert all(f in message for f in spec.files)
    assert time.monotonic() - start < 30


def test_missing_files_with_download_offline(tmp_path, monkeypatch):
    calls = []

    def offline(root, spec, timeout):
        calls.append((root, spec.name, timeout))
        raise OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(cifar_mod, "download_with_torchvision", offline)
    start = time.monotonic()
    with pytest.raises(DataError) as info:
        build_datasets(cfg_for(tmp_path, download=True))
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "download failed: [Errno -3]" in message
    assert str(tmp_path / "cifar-10-batches-py") in message and "data_batch_5" in message
    assert calls == [(tmp_path, "cifar10", 30.0)]


def test_download_subprocess_is_bounded(tmp_path, monkeypatch):
    import subprocess

    seen = {}

    def hanging(command, **kwargs):
        seen.update(kwargs)
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(cifar_mod.subprocess, "run", hanging)
    with pytest.raises(TimeoutError, match="within 30 s"):
        cifar_mod.download_with_torchvision(tmp_path, cifar_mod.CIFAR10, 30.0)
    assert seen["timeout"] == 30.0


def test_tampered_batch_cannot_run_code(tmp_path):
    write_cifar10(tmp_path)

    class Evil:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pwned')",))

    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(pickle.dumps({"data": Evil()}))
    with pytest.raises(DataError, match=r"data_batch_3 refers to the global builtins\.exec"):
        build_datasets(cfg_for(tmp_path))
