"""End-to-end runs on synthetic data: outputs, checkpoints, resume, W&B offline."""

import json

import pytest
import torch

from syncbn_lab.engine import checkpoint
from syncbn_lab.errors import UserError
from syncbn_lab.provenance import git_commit, training_code
from syncbn_lab.train import run

SUMMARY_KEYS = {
    "test_acc",
    "test_loss",
    "val_acc",
    "best_val_acc",
    "train_loss",
    "epochs",
    "steps",
    "wall_time_s",
    "images_per_s",
    "global_batch_size",
    "per_device_batch_size",
    "devices",
    "parallel",
    "bn",
    "dataset",
    "model",
    "seed",
    "git_commit",
    "torch_version",
}


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_outputs_and_learns(tmp_path, tiny_cfg):
    cfg = tiny_cfg("trainer.epochs=3", "optim.lr=0.05")
    summary = run(cfg, tmp_path)
    assert SUMMARY_KEYS <= summary.keys()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == summary["steps"]
    assert summary["steps"] == 3 * (256 // 32)
    # the code this process loaded: the checkout's (tests/test_provenance.py tests the hash)
    assert summary["training_code"] == training_code() and summary["git_commit"] == git_commit()
    assert (tmp_path / "config.yaml").exists()
    rows = records(tmp_path)
    step_rows = [r for r in rows if "val/acc" not in r]
    epoch_rows = [r for r in rows if "val/acc" in r]
    assert [r["step"] for r in step_rows] == list(range(1, summary["steps"] + 1))
    assert len(epoch_rows) == 3
    for key in (
        "step",
        "epoch",
        "lr",
        "train/loss",
        "train/acc",
        "val/loss",
        "val/acc",
        "images_per_s",
    ):
        assert key in epoch_rows[-1]
    assert epoch_rows[-1]["train/loss"] < epoch_rows[0]["train/loss"]
    assert summary["test_acc"] > 50  # 4 learnable classes; chance is 25 %
    for name in ("last.pt", "best.pt"):
        state = checkpoint.load(tmp_path / "checkpoints" / name)
        assert "conv1.weight" in str(list(state["model"])) or state["model"]


def test_max_steps_stops_early(tmp_path, tiny_cfg):
    summary = run(tiny_cfg("trainer.epochs=5", "trainer.max_steps=3"), tmp_path)
    assert summary["steps"] == 3 and summary["epochs"] == 1


def test_resume_is_bitwise_identical(tmp_path, tiny_cfg):
    # a schedule that does not depend on the run's length (a constant lr), so that the
    # 1-epoch run is the first half of the 2-epoch one
    constant = ("sched=step", "sched.milestones=[]")
    full = run(tiny_cfg("trainer.epochs=2", *constant), tmp_path / "full")
    run(tiny_cfg("trainer.epochs=1", *constant), tmp_path / "first")
    resumed = run(
        tiny_cfg("trainer.epochs=2", *constant, f"trainer.resume={tmp_path / 'first'}"),
        tmp_path / "second",
    )
    assert resumed["steps"] == full["steps"]
    a = checkpoint.load(tmp_path / "full" / "checkpoints" / "last.pt")["model"]
    b = checkpoint.load(tmp_path / "second" / "checkpoints" / "last.pt")["model"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_rerun_into_same_dir_is_refused_and_keeps_files(tmp_path, tiny_cfg):
    from syncbn_lab.errors import ConfigError

    run(tiny_cfg("trainer.max_steps=2"), tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="already holds a run"):
        run(tiny_cfg("trainer.max_steps=2"), tmp_path)
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert before == after


def test_wandb_online_without_a_key_is_one_line_before_any_record(tmp_path, tiny_cfg, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY"):  # no key anywhere: W&B refuses at once
        monkeypatch.delenv(name, raising=False)
    for name in ("HOME", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.setenv(name, str(tmp_path / "home"))
    with pytest.raises(UserError) as info:
        run(tiny_cfg("logger=wandb", "logger.mode=online", "trainer.max_steps=1"), tmp_path)
    message = str(info.value)
    assert message.startswith("W&B cannot start a run in mode online (UsageError: "), message
    assert "logger.mode=offline" in message and "\n" not in message
    assert not (tmp_path / "metrics.jsonl").exists()  # the same run dir takes the fixed command


def test_wandb_offline_run(tmp_path, tiny_cfg, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    summary = run(tiny_cfg("logger=wandb", "trainer.max_steps=3", "logger.tags=[smoke]"), tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "one offline W&B run inside the run dir"
    # the end-of-run block names the run's folder and the command that uploads it
    folder = runs[0].relative_to(tmp_path)
    out = capsys.readouterr().out
    assert f"W&B            offline run in {folder}\n" in out, out
    assert f"               upload it: wandb sync {folder}\n" in out, out
    # wandb >= 0.19 writes offline runs as one protobuf log (run-*.wandb) that `wandb sync`
    # uploads; the summary, config and tags are records in it
    (log,) = runs[0].glob("run-*.wandb")
    data = log.read_bytes()
    for token in (b"test_acc", b"best_val_acc", b"smoke", b"bn=bn", b"train/loss"):
        assert token in data, token
    assert summary["steps"] == 3
