"""Bad input from the command line: one line naming the problem and the fix, exit 2,
and nothing already written is touched."""

from pathlib import Path

import pytest
from conftest import TINY
from helpers import assert_one_line_error, train_cli


def train(*args, cwd=None):
    return train_cli(*args, cwd=cwd, timeout=120)


@pytest.mark.parametrize(
    "overrides,fragments",
    [
        (["trainer.nonexistent=1"], ["trainer.nonexistent", "+trainer.nonexistent=1"]),
        (["bn=nosuch"], ["bn/nosuch", "Available options"]),
        (["trainer.global_batch_size=0"], ["trainer.global_batch_size=0", "positive"]),
        (["trainer.epochs=-1"], ["trainer.epochs=-1", "positive"]),
        (
            ["parallel=emulated", "parallel.devices=4", "trainer.global_batch_size=30"],
            ["not divisible"],
        ),
        (["trainer.precision=fp8"], ["trainer.precision=fp8", "fp64"]),
        (["model.name=nosuch"], ["model.name=nosuch", "model=<name>", "resnet20"]),
        (["bn.name=nosuch"], ["bn.name=nosuch", "bn=<name>", "sync"]),
        (["data.name=nosuch"], ["data.name=nosuch", "data=<name>", "mnist"]),
        (["sched.name=nosuch"], ["sched.name=nosuch", "sched=<name>", "cosine"]),
        (["optim.name=nosuch"], ["optim.name=nosuch", "optim=<name>", "adamw"]),
        (["model.width=0"], ["model.width=0", "positive"]),
        (["bn.eps=-1"], ["bn.eps=-1", "(0, inf)"]),
        (["optim.lr=-0.1"], ["optim.lr=-0.1", "[0, inf)"]),
        (["optim=adamw", "optim.betas=[0.9]"], ["optim.betas=[0.9]", "two numbers"]),
        (["sched=step", "sched.milestones=3"], ["sched.milestones=3", "[0.5,0.75]"]),
        (["bn=gn", "bn.groups=0"], ["bn.groups=0", "positive"]),
        (["bn=sync", "bn.impl=bogus"], ["bn.impl=bogus", "reference"]),
        (
            ["bn=sync", "bn.group_size=3", "parallel=emulated", "parallel.devices=4"],
            ["bn.group_size=3", "parallel.devices=4", "divisor"],
        ),
        (["trainer.callbacks=[{_target_:nosuch.thing}]"], ["nosuch.thing", "importable"]),
    ],
)
def test_bad_config_is_one_line_before_the_run_dir_exists(tmp_path, overrides, fragments):
    result = train(*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "run").exists()  # Hydra never started: nothing written


@pytest.mark.parametrize(
    "overrides,fragments",
    [  # TINY: 256 images of 8 x 8 pixels, 8 batches of 32 an epoch
        (["trainer.precise_bn_batches=9"], ["trainer.precise_bn_batches=9", "pick at most 8"]),
        (
            ["data.augment=true", "data.crop_padding=8"],
            ["data.crop_padding=8", "images' side (8 pixels)"],
        ),
    ],
)
def test_a_value_the_data_refuses_is_one_line_before_training(tmp_path, overrides, fragments):
    result = train(*TINY, *overrides, f"hydra.run.dir={tmp_path}")
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_group_norm_groups_that_do_not_divide_the_channels_is_one_line(tmp_path):
    # the default width 16: resnet20's norm layers have 16, 32 and 64 channels
    result = train(
        "model=resnet20", "bn=gn", "bn.groups=7", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert_one_line_error(
        result, "bn.groups=7", "(16, 32, 64)", "choose bn.groups from 1, 2, 4, 8, 16, 32, 64"
    )
    assert not (tmp_path / "run").exists()


def test_missing_data_is_one_line(tmp_path):
    result = train(
        "data=cifar10",
        f"data.root={tmp_path / 'nodata'}",
        "data.download=false",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert_one_line_error(result, "cifar")


def test_unwritable_output_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    result = train(*TINY, f"hydra.run.dir={blocker / 'run'}")
    assert_one_line_error(result, "cannot write the run dir", "hydra.run.dir")


def test_existing_run_dir_is_untouched(tmp_path):
    run_dir = tmp_path / "run"
    first = train(*TINY, "debug=fast", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    second = train(*TINY, "debug=fast", f"hydra.run.dir={run_dir}")
    assert_one_line_error(second, "already holds a run")
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert before == after
    assert Path(run_dir / "summary.json").exists()


def test_corrupt_data_file_is_one_line(tmp_path):
    cache = tmp_path / "data" / "mnist" / "mnist.npz"
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"this is not an npz archive")
    result = train(
        "data=mnist",
        f"data.root={tmp_path / 'data'}",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert_one_line_error(result, str(cache), "delete")
    assert cache.read_bytes() == b"this is not an npz archive"  # left for the user to inspect
