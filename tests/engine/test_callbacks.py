"""trainer.callbacks: Hydra nodes instantiated in every process and called after each
optimizer step; syncbn_lab.faults.Fault is the one tests use to make a rank fail."""

import json

import pytest

from syncbn_lab.errors import ConfigError
from syncbn_lab.faults import Fault, fault_override
from syncbn_lab.train import run


def test_a_fault_callback_raises_after_its_step_and_not_before(tmp_path, tiny_cfg):
    cfg = tiny_cfg("trainer.max_steps=5", fault_override("raise", rank=0, step=3))
    with pytest.raises(RuntimeError, match="injected fault on rank 0 at step 3"):
        run(cfg, tmp_path)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == [1, 2]  # step 3 ran, then the callback raised before it was logged


def test_a_fault_for_another_rank_does_nothing_here(tmp_path, tiny_cfg):
    summary = run(
        tiny_cfg("trainer.max_steps=3", fault_override("raise", rank=1, step=2)), tmp_path
    )
    assert summary["steps"] == 3


def test_an_unknown_fault_action_is_refused():
    with pytest.raises(ValueError, match="explode"):
        Fault("explode", rank=0, step=1)


def test_a_callback_that_cannot_be_imported_fails_validation(tmp_path, tiny_cfg):
    cfg = tiny_cfg("trainer.callbacks=[{_target_:syncbn_lab.faults.NoSuchThing}]")
    with pytest.raises(ConfigError, match="syncbn_lab.faults.NoSuchThing"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
