"""trainer.eval_images: val and test evaluated on their first N images, shared over ranks."""

import pytest
from torch.utils.data import TensorDataset

from syncbn_lab.errors import ConfigError
from syncbn_lab.parallel.context import Runtime
from syncbn_lab.parallel.sampling import eval_loader
from syncbn_lab.train import run


def test_the_ranks_share_exactly_the_first_images():
    import torch

    dataset = TensorDataset(torch.arange(20))
    seen = []
    for rank in range(3):
        loader = eval_loader(dataset, Runtime(rank=rank, world_size=3), 4, 0, limit=7)
        seen += [int(i) for (batch,) in loader for i in batch]
    assert sorted(seen) == list(range(7))
    everything = eval_loader(dataset, Runtime(), 4, 0, limit=None)
    assert [int(i) for (batch,) in everything for i in batch] == list(range(20))


def test_eval_images_changes_the_evaluation_and_nothing_else(tmp_path, tiny_cfg):
    full = run(tiny_cfg("trainer.max_steps=3"), tmp_path / "full")
    same = run(tiny_cfg("trainer.max_steps=3", "trainer.eval_images=64"), tmp_path / "same")
    part = run(tiny_cfg("trainer.max_steps=3", "trainer.eval_images=5"), tmp_path / "part")
    assert same["test_loss"] == full["test_loss"]  # 64 = the whole test split
    assert part["test_loss"] != full["test_loss"]
    assert part["train_loss"] == full["train_loss"]
    assert round(part["test_acc"] * 5 / 100, 9).is_integer()  # a share of 5 images


def test_eval_images_must_be_positive(tmp_path, tiny_cfg):
    with pytest.raises(ConfigError, match="trainer.eval_images=0"):
        run(tiny_cfg("trainer.eval_images=0"), tmp_path)
