"""One job of a multirun (syncbn_lab.multirun.run_job): a failure is recorded, not raised;
with skip_finished a finished run is kept and an unfinished one is run again from scratch."""

import json

from conftest import TINY, compose_config
from omegaconf import open_dict

from syncbn_lab.multirun import ERROR_FILE, run_job
from syncbn_lab.train import run

RUN = [*TINY, "trainer.max_steps=2"]


def resumable(*overrides):
    cfg = compose_config([*RUN, *overrides])
    with open_dict(cfg):
        cfg.skip_finished = True
    return cfg


def never_run(cfg, run_dir):
    raise AssertionError("a finished run was run again")


def test_a_failed_job_records_its_reason_and_cell(tmp_path, capsys):
    cfg = compose_config([*RUN, "parallel=emulated", "parallel.devices=3"])
    assert run_job(cfg, tmp_path, run) is None
    record = json.loads((tmp_path / ERROR_FILE).read_text())
    reason = (
        "trainer.global_batch_size=32 is not divisible by parallel.devices x "
        "trainer.accumulate = 3 x 1; pick a global batch that is a multiple of their product"
    )
    assert record["error"] == reason
    assert {k: record[k] for k in ("bn", "parallel", "devices", "seed")} == {
        "bn": "bn",
        "parallel": "emulated",
        "devices": 3,
        "seed": 0,
    }
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {reason}"


def test_skip_finished_keeps_a_finished_run_and_reruns_an_unfinished_one(tmp_path):
    first = run_job(resumable(), tmp_path, run)
    assert first is not None and first["steps"] == 2
    records = len((tmp_path / "metrics.jsonl").read_text().splitlines())
    assert run_job(resumable(), tmp_path, never_run) == json.loads(
        (tmp_path / "summary.json").read_text()
    )

    # an interrupted run: metrics and a checkpoint, no summary; run again from scratch
    (tmp_path / "summary.json").unlink()
    (tmp_path / ERROR_FILE).write_text('{"error": "an earlier attempt"}')
    again = run_job(resumable(), tmp_path, run)
    assert again is not None and not (tmp_path / ERROR_FILE).exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == records  # not appended
    assert again["train_loss"] == first["train_loss"]


def test_skip_finished_refuses_a_finished_run_of_another_config(tmp_path):
    run_job(resumable(), tmp_path, run)
    assert run_job(resumable("trainer.max_steps=3"), tmp_path, never_run) is None
    error = json.loads((tmp_path / ERROR_FILE).read_text())["error"]
    assert error.startswith(f"{tmp_path} holds a finished run of another config (differs in ")
    assert "trainer.max_steps)" in error
