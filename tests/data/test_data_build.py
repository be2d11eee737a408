"""build_datasets for every family, the config files themselves, and the clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DATA_CONFIGS, data_cfg
from omegaconf import OmegaConf
from PIL import Image

from syncbn_lab.data import DATASET_NAMES, DataError, DataSplits, build_datasets

CONFIGS = DATA_CONFIGS


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(DataError) as info:
        build_datasets(OmegaConf.create({"name": "imagenet", "root": "data"}))
    message = str(info.value)
    assert "'imagenet'" in message and "\n" not in message
    assert all(
        name in message
        for name in ("mnist", "digits", "cifar10", "cifar100", "imagefolder", "synthetic")
    )


def test_every_config_exists_and_documents_every_key():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(DATASET_NAMES)
    for path in CONFIGS.glob("*.yaml"):
        cfg = OmegaConf.load(path)
        assert cfg.name == path.stem and "root" in cfg
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        assert len(lines) == len(cfg), f"{path.name}: one line per key expected"
        for line in lines:
            assert re.fullmatch(r"[a-z_]+: \S.*?  # \S.+", line), (
                f"{path.name}: undocumented: {line!r}"
            )


def test_a_missing_key_names_the_config_file():
    cfg = data_cfg("synthetic")
    del cfg["noise_std"]
    with pytest.raises(
        DataError, match=r"data.noise_std is not set; add it to configs/data/synthetic.yaml"
    ):
        build_datasets(cfg)


def check_items(splits: DataSplits, channels: int, size: int) -> None:
    for dataset in (splits.train, splits.val, splits.test):
        image, label = dataset[0]
        assert image.dtype == torch.float32 and image.shape == (channels, size, size)
        assert isinstance(label, int) and 0 <= label < splits.num_classes
        if hasattr(dataset, "images"):
            assert dataset.images.dtype == torch.uint8
    assert (splits.in_channels, splits.image_size) == (channels, size)


def test_synthetic_is_deterministic_normalised_and_learnable():
    cfg = data_cfg("synthetic", num_classes=3, channels=2, image_size=6, num_train=300)
    splits = build_datasets(cfg)
    check_items(splits, 2, 6)
    assert (len(splits.train), len(splits.val), len(splits.test), splits.num_classes) == (
        300,
        128,
        128,
        3,
    )
    assert torch.bincount(splits.train.targets).tolist() == [100, 100, 100]
    again = build_datasets(cfg)
    for split in ("train", "val", "test"):
        assert torch.equal(getattr(splits, split).images, getattr(again, split).images)
    assert not torch.equal(
        splits.train.images, build_datasets(data_cfg("synthetic", seed=1)).train.images
    )
    x, y = splits.train.batch(range(300))
    assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05
    # A linear classifier (the tiniest model) learns it: loss falls, held-out accuracy is high.
    torch.manual_seed(0)
    model = torch.nn.Linear(2 * 6 * 6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x.flatten(1)), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    xv, yv = splits.val.batch(range(len(splits.val)))
    assert (model(xv.flatten(1)).argmax(1) == yv).float().mean() > 0.9


def test_synthetic_rejects_nonsense():
    with pytest.raises(DataError, match="num_classes >= 2"):
        build_datasets(data_cfg("synthetic", num_classes=1))


@pytest.mark.parametrize("padding", [6, 7, 10**30])
def test_a_crop_padding_of_the_images_side_or_more_is_refused(padding):
    # a crop of 6-pixel images padded by 6 or more can hold padding only (then the model
    # trains on blank images); 10**30 overflowed the offsets' int64 in a traceback
    cfg = data_cfg("synthetic", image_size=6, augment=True, crop_padding=padding)
    with pytest.raises(DataError) as info:
        build_datasets(cfg)
    message = str(info.value)
    assert f"data.crop_padding={padding} is not smaller than the images' side (6" in message
    assert "\n" not in message


def test_a_crop_padding_one_below_the_images_side_is_taken():
    train = build_datasets(data_cfg("synthetic", image_size=6, augment=True, crop_padding=5)).train
    assert train.batch(range(8))[0].shape == (8, 1, 6, 6)


def test_digits_fixed_stratified_split():
    from sklearn.datasets import load_digits

    splits = build_datasets(data_cfg("digits"))
    check_items(splits, 1, 8)
    sizes = [len(splits.train), len(splits.val), len(splits.test)]
    assert (
        sum(sizes) == 1797
        and sizes[1] == pytest.approx(0.2 * 1797, abs=1)
        and splits.num_classes == 10
    )
    all_indices = torch.cat(
        [splits.train.source_indices, splits.val.source_indices, splits.test.source_indices]
    )
    assert torch.equal(all_indices.sort().values, torch.arange(1797))
    digits = load_digits()
    overall = np.bincount(digits.target) / 1797
    for dataset in (splits.val, splits.test):
        share = np.bincount(dataset.targets.numpy(), minlength=10) / len(dataset)
        assert np.abs(share - overall).max() < 0.01  # stratified
    again = build_datasets(data_cfg("digits"))
    assert torch.equal(again.test.source_indices, splits.test.source_indices)
    # Items are (pixels / 16 - mean) / std with the train split's statistics.
    x, _ = splits.train.batch(range(len(splits.train)))
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1) < 1e-3
    i = splits.val.source_indices[4].item()
    raw = torch.from_numpy(digits.images[i]).double() / 16
    mean, std = splits.val.mean[0], splits.val.std[0]
    torch.testing.assert_close(splits.val[4][0][0].double(), (raw - mean) / std, rtol=0, atol=1e-5)
    assert splits.val[4][1] == digits.target[i]


def write_image_tree(root: Path, classes=("cat", "dog"), splits=("train", "val", "test")) -> None:
    rng = np.random.default_rng(0)
    for split in splits:
        for c in classes:
            folder = root / split / c
            folder.mkdir(parents=True)
            for k in range(3):
                pixels = rng.integers(0, 256, (30 + 4 * k, 40, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{k}.png")


def test_imagefolder_lazy_equals_in_memory(tmp_path):
    import torchvision.transforms as T

    write_image_tree(tmp_path)
    cfg = data_cfg("imagefolder", root=str(tmp_path), image_size=16, augment=False)
    lazy = build_datasets(cfg)
    eager = build_datasets(OmegaConf.merge(cfg, {"in_memory": True}))
    check_items(lazy, 3, 16)
    assert lazy.num_classes == 2 and len(lazy.train) == 6 and lazy.train.classes == ["cat", "dog"]
    reference = T.Compose([T.Resize(16), T.CenterCrop(16), T.PILToTensor()])
    mean, std = (
        torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1),
        torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1),
    )
    for split in ("train", "val", "test"):
        a, b = getattr(lazy, split), getattr(eager, split)
        assert torch.equal(a.batch(range(6))[0], b.batch(range(6))[0])
        path, label = a.samples[4]
        with Image.open(path) as image:
            expected = (reference(image.convert("RGB")).float() / 255 - mean) / std
        torch.testing.assert_close(a[4][0], expected, rtol=0, atol=1e-5)
        assert a[4][1] == label
    grey = build_datasets(OmegaConf.merge(cfg, {"channels": 1, "mean": [0.5], "std": [0.25]}))
    assert grey.train[0][0].shape == (1, 16, 16) and grey.in_channels == 1


def test_imagefolder_errors(tmp_path):
    cfg = data_cfg("imagefolder", root=str(tmp_path))
    with pytest.raises(DataError, match=rf"image folder {tmp_path}/train does not exist; expected"):
        build_datasets(cfg)
    write_image_tree(tmp_path, splits=("train", "val"))
    (tmp_path / "test").mkdir()
    with pytest.raises(DataError, match="no images found under"):
        build_datasets(cfg)
    write_image_tree(tmp_path / "other", classes=("cat",), splits=("test",))
    with pytest.raises(DataError, match="every split needs the same class folders"):
        build_datasets(OmegaConf.merge(cfg, {"test_dir": "other/test"}))
    with pytest.raises(DataError, match="one data.mean/data.std value per channel"):
        build_datasets(OmegaConf.merge(cfg, {"channels": 1}))


def test_root_is_relative_to_the_launch_directory_and_expands_home(tmp_path, monkeypatch):
    from syncbn_lab.data.base import resolve_root

    monkeypatch.chdir(tmp_path)
    assert resolve_root("data") == tmp_path / "data"
    assert resolve_root("~/somewhere") == Path.home() / "somewhere"
    assert resolve_root(tmp_path / "abs") == tmp_path / "abs"


def test_fetch_mnist_is_exported_lazily():
    import syncbn_lab.data as data
    from syncbn_lab.data.mnist import fetch_mnist

    assert data.fetch_mnist is fetch_mnist
    with pytest.raises(AttributeError):
        data.no_such_thing  # noqa: B018
