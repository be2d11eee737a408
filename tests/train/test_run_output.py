"""What a run shows: the block that ends it, the copy of the terminal in train.log, and the
debug presets (debug=fast, debug=overfit)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY

from syncbn_lab.config import validate
from syncbn_lab.errors import ConfigError
from syncbn_lab.parallel.context import Runtime
from syncbn_lab.parallel.sampling import DeviceBatchSampler, RepeatedBatches
from syncbn_lab.train import run

TRAIN = str(ROOT / "scripts" / "train.py")


def block(stdout: str) -> dict[str, str]:
    """The end-of-run block's rows as {name: text} (continuation rows keep their order)."""
    lines = stdout.split("-- run finished ", 1)[1].splitlines()[1:]
    rows: dict[str, str] = {}
    for line in lines:
        name, text = line[:14].strip(), line[14:].strip()
        rows[name or f"{list(rows)[-1]}+"] = text
    return rows


def test_debug_fast_ddp_ends_with_the_block_and_train_log_holds_the_terminal(tmp_path):
    # debug=fast as a user adds it to a 2-rank DDP run: rank 0 is a spawned process whose
    # prints the parent never sees, so this is the case where train.log is hardest to get
    result = subprocess.run(
        [sys.executable, TRAIN, *TINY, "debug=fast", "parallel=ddp", "parallel.devices=2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "tmp" / "syncbn-lab-debug").iterdir()  # a temporary run dir
    assert not (tmp_path / "outputs").exists() and not (run_dir / "wandb").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["parallel"] == "ddp"

    rows = block(result.stdout)
    assert rows["test accuracy"] == f"{summary['test_acc']:.2f} % (EMA statistics)"
    assert rows["best val acc"] == f"{summary['best_val_acc']:.2f} %"
    assert rows["steps"] == "3 (1 epoch)"
    assert rows["wall time"] == f"{summary['wall_time_s']:.1f} s"
    assert rows["run dir"] == str(run_dir.relative_to(tmp_path))  # below the working dir
    assert rows["W&B"] == "off (logger=none)"

    log = (run_dir / "train.log").read_text().splitlines()
    terminal = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert [line for line in log if line in terminal] == terminal  # all of it, in order
    assert any(line.startswith("epoch 1 | step 3 |") for line in log)


def test_debug_overfit_fits_one_batch_repeated(tmp_path, tiny_cfg):
    preset = tiny_cfg("debug=overfit")
    assert (preset.trainer.overfit_batches, preset.trainer.epochs) == (1, 50)
    assert preset.logger.name == "none" and preset.data.augment is False
    run(tiny_cfg("debug=overfit", "trainer.epochs=15"), tmp_path)  # 15 of its 50 steps
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records}  # a step's last record: its epoch's
    assert sorted(by_step) == list(range(1, 16))  # one step per epoch
    assert {r["epoch"] for r in records} == set(range(1, 16))
    assert by_step[15]["train/loss"] < by_step[1]["train/loss"] / 4
    assert by_step[15]["train/acc"] == 100.0  # the 32 images are learnt by heart
    with pytest.raises(ConfigError, match=r"^trainer.overfit_batches=0 must be a positive integer"):
        validate(tiny_cfg("trainer.overfit_batches=0"))


def test_repeated_batches_are_the_first_batches_of_epoch_0():
    dataset = list(range(100))
    rt = Runtime(device=torch.device("cpu"), slices_per_process=4)

    def sampler():
        return DeviceBatchSampler(dataset, 5, rt.total_devices, rt.local_device_ranks, seed=3)

    reference = list(sampler())  # epoch 0, straight from the sampler every run uses
    repeated = RepeatedBatches(sampler(), 2)
    assert len(repeated) == 2
    for epoch in range(3):
        repeated.set_epoch(epoch)
        assert list(repeated) == reference[:2]
    assert reference[0] != reference[1]
