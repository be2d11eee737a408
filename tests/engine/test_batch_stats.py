"""trainer.eval_batch_stats: the test set evaluated with each group of b test images
normalised by its own statistics, against torch's BatchNorm2d without running statistics (it
normalises every input with its own statistics) fed one group of b images at a time."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, TensorDataset

from syncbn_lab import models
from syncbn_lab.config import compose
from syncbn_lab.data import build_datasets
from syncbn_lab.engine import checkpoint
from syncbn_lab.engine.batch_stats import batch_statistics
from syncbn_lab.errors import ConfigError
from syncbn_lab.nn.registry import norm_layer
from syncbn_lab.parallel.context import Runtime
from syncbn_lab.parallel.sampling import eval_loader
from syncbn_lab.report.collect import collect_runs
from syncbn_lab.train import run


def reference_logits(model: nn.Module, images: torch.Tensor, group: int) -> torch.Tensor:
    """``model`` with every BN layer replaced by torch's BatchNorm2d without running
    statistics (same affine parameters and eps), fed ``group`` images at a time."""
    reference = copy.deepcopy(model).eval()
    for module in list(reference.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm):
                bn = nn.BatchNorm2d(child.num_features, eps=child.eps, track_running_stats=False)
                bn.load_state_dict({"weight": child.weight, "bias": child.bias})
                setattr(module, name, bn)
    with torch.no_grad():
        return torch.cat([reference(chunk) for chunk in images.split(group)])


@pytest.mark.parametrize(
    "bn,device_slices", [("bn", 1), ("bn", 4), ("sync", 4), ("brn", 4)]
)  # torch's BatchNorm2d, our BatchNorm and SyncBatchNorm over 4 slices, Batch Renormalization
def test_each_group_of_b_test_images_is_normalised_with_its_own_statistics(bn, device_slices):
    torch.manual_seed(0)
    factory = norm_layer(compose([f"bn={bn}"]).bn, device_slices, training_batches=10)
    model = models.build(compose(["model.width=4"]).model, factory, num_classes=3, in_channels=1)
    with torch.no_grad():  # affine parameters and running statistics away from 1 and 0
        for layer in (m for m in model.modules() if isinstance(m, _BatchNorm)):
            for tensor in (layer.weight, layer.bias, layer.running_mean):
                tensor.normal_()
            layer.running_var.uniform_(0.5, 2.0)
    model.eval()
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    images, labels = torch.randn(70, 1, 8, 8), torch.randint(0, 3, (70,))
    # groups of 8: loader batches of 16 (eval_batch_size 20 rounded down), 8 groups and 6 left
    loader = eval_loader(TensorDataset(images, labels), Runtime(), 20, 0, group=8)
    with batch_statistics(model, 8) as layers, torch.no_grad():
        logits = torch.cat([model(x) for x, _ in loader])
    assert layers == 9  # resnet8: a stem and 4 blocks of 2
    torch.testing.assert_close(logits, reference_logits(model, images, 8), rtol=1e-5, atol=1e-5)
    for key, value in model.state_dict().items():  # running stats, num_batches_tracked, ...
        assert torch.equal(value, buffers[key]), key
    assert not any("forward" in vars(m) for m in model.modules())  # the class's forward again
    assert not model.training


def test_the_ranks_share_whole_groups_of_the_test_set():
    dataset = TensorDataset(torch.arange(30))
    batches = []
    for rank in range(3):
        loader = eval_loader(dataset, Runtime(rank=rank, world_size=3), 10, 0, group=4)
        batches += [[int(i) for i in batch] for (batch,) in loader]
    groups = [batch[i : i + 4] for batch in batches for i in range(0, len(batch), 4)]
    assert sorted(groups) == [list(range(s, min(s + 4, 30))) for s in range(0, 30, 4)]
    assert all(len(batch) in (8, 4, 2) for batch in batches)  # whole groups (8 = 10 rounded)


def trained(cfg, run_dir):
    """The run's final model (last.pt) with torch's BatchNorm2d, and its test split in order."""
    splits = build_datasets(cfg.data)
    model = models.build(cfg.model, nn.BatchNorm2d, splits.num_classes, splits.in_channels)
    model.load_state_dict(checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"])
    images, labels = next(iter(DataLoader(splits.test, batch_size=len(splits.test))))
    return model, images, labels


TINY_RUN = ["trainer.max_steps=3", "trainer.threads=1", "data.num_test=70",
            "trainer.eval_batch_size=20"]  # fmt: skip


@pytest.mark.parametrize("bn,group", [("bn", 8), ("sync", 32)])  # per device / the global batch
def test_the_run_reports_test_batch_statistics_and_its_checkpoints_are_unchanged(
    tmp_path, tiny_cfg, bn, group
):
    settings = (*TINY_RUN, f"bn={bn}", "parallel=emulated", "parallel.devices=4")
    cfg = tiny_cfg(*settings, "trainer.eval_batch_stats=true")
    summary = run(cfg, tmp_path / "with")
    assert summary["normalization_batch_size"] == group
    model, images, labels = trained(cfg, tmp_path / "with")
    logits = reference_logits(model, images, group)  # 70 = 2 x 32 + 6 = 8 x 8 + 6
    assert summary["test_loss_batch_stats"] == pytest.approx(
        F.cross_entropy(logits, labels).item(), rel=1e-5
    )
    correct = (logits.argmax(1) == labels).sum().item()
    assert summary["test_acc_batch_stats"] == pytest.approx(100 * correct / len(labels))
    with torch.no_grad():  # last.pt holds the model the EMA test evaluated
        ema = F.cross_entropy(model.eval()(images), labels).item()
    assert summary["test_loss"] == pytest.approx(ema, rel=1e-5)
    if bn == "bn":  # nothing that a run without the extra evaluation writes differs
        without = run(tiny_cfg(*settings), tmp_path / "without")
        for name in ("last.pt", "best.pt"):
            a, b = (
                checkpoint.load(tmp_path / d / "checkpoints" / name) for d in ("with", "without")
            )
            assert a.keys() == b.keys()
            for key, value in a["model"].items():
                assert torch.equal(value, b["model"][key]), (name, key)
        for key in ("test_acc", "test_loss", "best_val_acc", "train_loss"):
            assert summary[key] == without[key], key
        runs = {r.run_dir.name: r for r in collect_runs(tmp_path)}  # the report's columns
        error = runs["with"].row()["test_error_batch_stats"]
        assert error == 100 - summary["test_acc_batch_stats"]
        assert math.isnan(runs["without"].row()["test_error_batch_stats"])


def test_group_norm_has_no_batch_statistics_the_numbers_are_the_ema_ones(tmp_path, tiny_cfg):
    summary = run(tiny_cfg(*TINY_RUN, "bn=gn", "trainer.eval_batch_stats=true"), tmp_path)
    assert summary["test_acc_batch_stats"] == summary["test_acc"]
    assert summary["test_loss_batch_stats"] == summary["test_loss"]


def test_eval_batch_stats_is_true_or_false(tmp_path, tiny_cfg):
    with pytest.raises(ConfigError, match="trainer.eval_batch_stats=1 must be true or false"):
        run(tiny_cfg("trainer.eval_batch_stats=1"), tmp_path)
