"""data.heterogeneity: per-image brightness and contrast, fixed per image, against a per-image
reference computed in float64 from the raw uint8 pixels."""

from __future__ import annotations

import pytest
import torch
from helpers import data_cfg

from syncbn_lab.data import DataError, build_datasets
from syncbn_lab.data.image_dataset import Heterogeneity


def _reference(dataset, index: int, gain: float, offset: float) -> torch.Tensor:
    """(gain * u / 255 + offset - mean) / std of one image, in float64."""
    raw = dataset.images[index].to(torch.float64) / dataset.pixel_max
    mean = torch.tensor(dataset.mean, dtype=torch.float64).view(-1, 1, 1)
    std = torch.tensor(dataset.std, dtype=torch.float64).view(-1, 1, 1)
    return (gain * raw + offset - mean) / std


def test_each_image_gets_one_gain_and_offset_in_every_batch_and_split():
    strength = 0.6
    splits = build_datasets(data_cfg("synthetic", heterogeneity=strength, heterogeneity_seed=3))
    plain = build_datasets(data_cfg("synthetic"))
    for name in ("train", "val", "test"):
        dataset, reference = getattr(splits, name), getattr(plain, name)
        assert torch.equal(dataset.images, reference.images)  # the stored images are unchanged
        gain, offset = Heterogeneity(strength, 3, name).factors(len(dataset))
        assert float(gain.min()) >= 1 - strength and float(gain.max()) <= 1 + strength
        assert float(offset.abs().max()) <= strength / 2
        assert float(gain.std()) > 0.25 * strength  # spread over the range, not constant
        # A batch in any order and of any size gives each image its own factors, every time.
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(1))[:37]
        for indices in (order.tolist(), order.flip(0).tolist()[:5]):
            x, _ = dataset.batch(indices)
            for row, i in zip(x, indices, strict=True):
                expected = _reference(dataset, i, float(gain[i]), float(offset[i]))
                torch.testing.assert_close(row.double(), expected, rtol=0, atol=1e-5)
    # The splits draw apart; the seed decides the draws.
    assert not torch.equal(*(Heterogeneity(strength, 3, s).factors(64)[0] for s in ("val", "test")))
    again = build_datasets(data_cfg("synthetic", heterogeneity=strength, heterogeneity_seed=3))
    other = build_datasets(data_cfg("synthetic", heterogeneity=strength, heterogeneity_seed=4))
    batch = list(range(16))
    assert torch.equal(splits.train.batch(batch)[0], again.train.batch(batch)[0])
    assert not torch.equal(splits.train.batch(batch)[0], other.train.batch(batch)[0])


def test_zero_strength_is_the_plain_dataset_bitwise_in_float32_and_float64():
    plain = build_datasets(data_cfg("synthetic")).train
    zero = build_datasets(data_cfg("synthetic", heterogeneity=0.0, heterogeneity_seed=9)).train
    assert zero.heterogeneity is None
    for dtype in (torch.float32, torch.float64):
        plain.set_dtype(dtype)
        zero.set_dtype(dtype)
        assert torch.equal(plain.batch(range(64))[0], zero.batch(range(64))[0])


def test_heterogeneity_widens_the_spread_of_per_image_means():
    """What the option is for: the per-image mean brightness varies more across images."""
    plain = build_datasets(data_cfg("synthetic")).train.batch(range(512))[0]
    varied = build_datasets(data_cfg("synthetic", heterogeneity=0.8)).train.batch(range(512))[0]
    assert varied.mean((1, 2, 3)).std() > 2 * plain.mean((1, 2, 3)).std()


@pytest.mark.parametrize("strength", [-0.1, 1.0, 1.5])
def test_a_strength_outside_zero_to_one_is_one_line(strength):
    with pytest.raises(DataError, match=r"data.heterogeneity=.* outside \[0, 1\)"):
        build_datasets(data_cfg("synthetic", heterogeneity=strength))
