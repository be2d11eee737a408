"""trainer.eval_every as a fraction of an epoch: val records within epochs, at the steps the
fraction names, with the values of the model at that step, logged again alike by a run
resumed from within an epoch."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from syncbn_lab import models
from syncbn_lab.data import build_datasets
from syncbn_lab.engine import checkpoint
from syncbn_lab.engine.loop import val_steps_in_epoch
from syncbn_lab.errors import ConfigError
from syncbn_lab.faults import fault_override
from syncbn_lab.train import run

# 256 images, 32 a step: 8 steps an epoch, 2 epochs; a quarter epoch is 2 steps.
QUARTERS = ["trainer.epochs=2", "trainer.threads=1", "trainer.eval_every=0.25",
            "trainer.checkpoint_every=3"]  # fmt: skip


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "images_per_s"} for line in lines]


def val_records(run_dir):
    return [r for r in records(run_dir) if "val/acc" in r]


def test_the_steps_of_a_fraction_of_an_epoch():
    assert val_steps_in_epoch(0.25, 781) == {195, 390, 585}  # then the epoch's end, 781
    assert val_steps_in_epoch(0.5, 8) == {4}
    assert val_steps_in_epoch(0.3, 10) == {3, 6, 9}
    assert val_steps_in_epoch(0.1, 4) == {1, 2, 3}  # each step once, none at 0
    assert val_steps_in_epoch(1, 781) == val_steps_in_epoch(3, 781) == set()


def test_val_within_epochs_is_the_model_of_that_step_and_a_resume_logs_it_alike(tmp_path, tiny_cfg):
    whole = run(tiny_cfg(*QUARTERS), tmp_path / "whole")
    logged = val_records(tmp_path / "whole")
    assert [(r["step"], r["epoch"]) for r in logged] == [
        (2 * k, k / 4) for k in range(1, 9)
    ]  # steps 2, 4, 6 within each epoch, 8 and 16 at its end (with the epoch's training)
    assert [set(r) for r in logged if r["step"] % 8] == [
        {"step", "epoch", "val/loss", "val/acc"}
    ] * 6
    best = checkpoint.load(tmp_path / "whole" / "checkpoints" / "best.pt")
    assert best["best_val_acc"] == whole["best_val_acc"] == max(r["val/acc"] for r in logged)
    assert best["step"] == next(r["step"] for r in logged if r["val/acc"] == best["best_val_acc"])

    # stopped by a failure at step 7: last.pt is step 6's, written after its val record
    with pytest.raises(RuntimeError, match="injected fault"):
        run(tiny_cfg(*QUARTERS, fault_override("raise", 0, 7)), tmp_path / "stopped")
    saved = checkpoint.load(tmp_path / "stopped" / "checkpoints" / "last.pt")
    assert (saved["step"], saved["step_in_epoch"]) == (6, 6)
    assert saved["best_val_acc"] == max(r["val/acc"] for r in logged[:3])  # step 6's included
    at_6 = val_records(tmp_path / "stopped")[-1]
    assert at_6 == logged[2]
    cfg = tiny_cfg(*QUARTERS)
    splits = build_datasets(cfg.data)  # step 6's model, evaluated here on val in eval mode
    model = models.build(cfg.model, nn.BatchNorm2d, splits.num_classes, splits.in_channels)
    model.load_state_dict(saved["model"])
    images, labels = next(iter(DataLoader(splits.val, batch_size=len(splits.val))))
    with torch.no_grad():
        logits = model.eval()(images)
    assert at_6["val/loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert at_6["val/acc"] == pytest.approx(100 * (logits.argmax(1) == labels).sum().item() / 64)

    resumed = run(tiny_cfg(*QUARTERS, f"trainer.resume={tmp_path / 'stopped'}"), tmp_path / "b")
    assert records(tmp_path / "b") == [r for r in records(tmp_path / "whole") if r["step"] > 6]
    for key in ("best_val_acc", "val_acc", "test_loss", "train_loss"):
        assert resumed[key] == whole[key], key


def test_dense_epochs_validate_within_the_first_epochs_only(tmp_path, tiny_cfg):
    """trainer.eval_dense_epochs=1: quarters in epoch 1, then the ends of epochs 2 and 3; the
    values at those steps are the full schedule's (validation does not change training)."""
    three = [*QUARTERS, "trainer.epochs=3"]
    run(tiny_cfg(*three), tmp_path / "full")
    run(tiny_cfg(*three, "trainer.eval_dense_epochs=1"), tmp_path / "dense")
    sparse = val_records(tmp_path / "dense")
    assert [r["step"] for r in sparse] == [2, 4, 6, 8, 16, 24]
    full = {r["step"]: r for r in val_records(tmp_path / "full")}
    assert all(r["val/acc"] == full[r["step"]]["val/acc"] for r in sparse)
    assert sparse[-1]["val/loss"] == full[24]["val/loss"]
    with pytest.raises(ConfigError, match="trainer.eval_dense_epochs=0 must be a positive"):
        run(tiny_cfg(*QUARTERS, "trainer.eval_dense_epochs=0"), tmp_path / "bad")


def test_after_the_dense_epochs_val_comes_every_sparse_epochs_and_at_the_end(tmp_path, tiny_cfg):
    """eval_dense_epochs=1, eval_sparse_every=2 over 4 epochs of 8 steps: the quarters of
    epoch 1 and its end, then the end of epoch 3 and of the last (4), not of epoch 2."""
    four = [*QUARTERS, "trainer.epochs=4", "trainer.eval_dense_epochs=1"]
    run(tiny_cfg(*four, "trainer.eval_sparse_every=2"), tmp_path / "sparse")
    assert [r["step"] for r in val_records(tmp_path / "sparse")] == [2, 4, 6, 8, 24, 32]
    with pytest.raises(ConfigError, match="trainer.eval_sparse_every=0 must be a positive"):
        run(tiny_cfg(*four, "trainer.eval_sparse_every=0"), tmp_path / "bad")


@pytest.mark.parametrize("value", [0, 1.5, True, "quarter"])
def test_eval_every_is_whole_epochs_or_a_fraction_of_one(tmp_path, tiny_cfg, value):
    with pytest.raises(ConfigError, match=f"trainer.eval_every={value} must be a whole number"):
        run(tiny_cfg(f"trainer.eval_every={value}"), tmp_path)
    assert not tmp_path.joinpath("config.yaml").exists()
