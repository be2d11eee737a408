import collections

import pytest
import torch
from omegaconf import OmegaConf

from syncbn_lab.engine import checkpoint
from syncbn_lab.errors import ConfigError


def state(step=3, **extra):
    return {"model": {"w": torch.arange(4.0)}, "optimizer": {}, "epoch": 0, "step": step,
            "best_val_acc": 0.0, **extra}  # fmt: skip


def test_save_is_atomic_and_loads_weights_only(tmp_path):
    path = tmp_path / "checkpoints" / "last.pt"
    checkpoint.save_atomic(state(), path)
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temporary left
    loaded = checkpoint.load(path)
    torch.testing.assert_close(loaded["model"]["w"], torch.arange(4.0))


def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    checkpoint.save_atomic(state(step=1), path)

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save_atomic(state(step=2), path)
    assert checkpoint.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_resolve_run_dir(tmp_path):
    run = tmp_path / "run"
    checkpoint.save_atomic(state(), run / "checkpoints" / "last.pt")
    assert checkpoint.resolve(str(run)) == run / "checkpoints" / "last.pt"
    with pytest.raises(ConfigError, match="no checkpoint at"):
        checkpoint.resolve(str(tmp_path / "missing"))


def test_a_bad_checkpoint_is_one_line_that_says_what_is_wrong(tmp_path):
    good = tmp_path / "good.pt"
    checkpoint.save_atomic(state(), good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    foreign = tmp_path / "foreign.pt"  # a pickled object a weights-only load refuses
    torch.save({"model": collections.Counter(a=1)}, foreign)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    ours = "not a checkpoint of this project"
    cases = {truncated: "truncated or damaged", text: "not a checkpoint (not a torch.save",
             foreign: ours, other: ours}  # fmt: skip
    for path, what in cases.items():
        with pytest.raises(ConfigError) as info:
            checkpoint.load(path)
        message = str(info.value)
        assert what in message and str(path) in message and "\n" not in message
        assert "weights_only" not in message  # torch's advice to load unsafely is not passed on


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    cfg = OmegaConf.create(
        {"model": {"name": "resnet8", "width": 16}, "bn": {"name": "bn"},
         "data": {"name": "mnist"}, "parallel": {"name": "emulated", "devices": 4},
         "trainer": {"global_batch_size": 64, "accumulate": 1, "seed": 0, "resume": None}}
    )  # fmt: skip
    run = tmp_path / "run"
    checkpoint.save_atomic(
        state(resume_key=checkpoint.resume_key(cfg)), run / "checkpoints" / "last.pt"
    )
    cfg.trainer.resume = str(run)
    assert checkpoint.check_resume(cfg)["step"] == 3
    for key, value in (("model.width", 8), ("parallel.devices", 2), ("trainer.seed", 1)):
        changed = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{key}={value}"]))
        with pytest.raises(ConfigError, match=rf"{key}=.*this run has {key}={value};"):
            checkpoint.check_resume(changed)
    changed = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["trainer.epochs=20"]))
    assert checkpoint.check_resume(changed) is not None  # training longer is a resume


@pytest.mark.parametrize(
    "value, expected",
    [(None, (None, None)), (0, (None, None)), (200, (200, None)), ("5min", (None, 300.0)),
     ("90s", (None, 90.0)), ("1.5min", (None, 90.0))],
)  # fmt: skip
def test_checkpoint_every(value, expected):
    assert checkpoint.parse_every(value) == expected


@pytest.mark.parametrize("value", ["often", "-5min", "5h", True, -3])
def test_checkpoint_every_refuses_what_is_not_a_period(value):
    with pytest.raises(ConfigError, match="trainer.checkpoint_every=.* is not a period"):
        checkpoint.parse_every(value)
