"""Where a run's time goes: the phases outside the training steps (engine.loop.PhaseClock)
and the summary's time_*_s figures, which with the steps' time account for the wall time."""

import json

from syncbn_lab.engine.loop import PhaseClock
from syncbn_lab.train import run


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_phase_inside_another_counts_only_towards_the_inner_one():
    now = FakeClock()
    clock = PhaseClock(now)
    with clock("validation"):
        now.t += 2.0
        with clock("checkpoints"):  # best.pt written during a validation
            now.t += 3.0
        now.t += 1.0
    now.t += 10.0  # outside any phase: counted nowhere
    with clock("checkpoints"):
        now.t += 0.5
    assert clock.summary() == {"time_validation_s": 3.0, "time_checkpoints_s": 3.5}


def test_a_runs_phases_and_steps_account_for_its_wall_time(tmp_path, tiny_cfg):
    cfg = tiny_cfg("trainer.epochs=2", "trainer.eval_every=0.5", "trainer.precise_bn_batches=2")
    cfg.trainer.eval_batch_stats = True
    run(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    phases = {k: v for k, v in summary.items() if k.startswith("time_") and k != "time_steps_s"}
    assert set(phases) == {
        "time_startup_s",
        "time_validation_s",
        "time_checkpoints_s",
        "time_logging_s",
        "time_test_s",
        "time_test_batch_stats_s",
        "time_precise_bn_s",
    }
    assert all(v > 0 for v in phases.values())
    assert summary["time_steps_s"] == summary["train_time_s"]  # not resumed: the same steps
    accounted = summary["time_steps_s"] + sum(phases.values()) + summary.get("preflight_s", 0)
    assert accounted <= summary["wall_time_s"]
    assert accounted > 0.8 * summary["wall_time_s"]  # what is left is callbacks, the agree step
