"""One job of a multirun (syncbn_lab.multirun.run_job): a failure is recorded, not raised;
with skip_finished a finished run is kept and an unfinished one is run again from scratch."""

import json
import os

from conftest import TINY, compose_config
from omegaconf import open_dict

from syncbn_lab.multirun import ERROR_FILE, SweepProgress, jobs, run_job, varied_keys
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

    # an interrupted run: metrics and a checkpoint, no summary; it continues from there
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
    assert error.startswith(f"{tmp_path} holds a run of another config (differs in ")
    assert "trainer.max_steps)" in error


def test_the_jobs_are_the_product_of_the_sweeps_comma_lists():
    # configs/experiment/bn_vs_syncbn_1epoch.yaml: bn, sync x devices 1 ... 64 x seeds 0 ... 3
    assert len(jobs(["experiment=bn_vs_syncbn_1epoch"])) == 2 * 7 * 4
    # the command line wins for a key the experiment sweeps too
    assert len(jobs(["experiment=bn_vs_syncbn_1epoch", "bn=brn", "parallel.devices=8,16"])) == 2 * 4
    assert len(jobs([*TINY, "bn=bn,sync,gn", "trainer.seed=0,1"])) == 3 * 2


def test_varied_keys_are_the_settings_that_tell_the_jobs_apart_beyond_the_cell():
    # configs/experiment/nbs_depth.yaml sweeps seeds, model.width and parallel.devices
    def planned(*parts):
        return [job for part in parts for job in jobs(part)]

    assert varied_keys(planned(["experiment=nbs_depth"])) == ["model.width"]
    assert varied_keys(planned(["experiment=bn_vs_syncbn_1epoch"])) == []  # bn, devices, seeds
    widths = [*TINY, "model.width=4,8", "data.heterogeneity=0.4"]
    assert varied_keys(planned(widths)) == ["model.width"]
    parts = [[*TINY, "parallel.devices=8"], [*TINY, "bn=sync", "bn.group_size=16"]]
    assert varied_keys(planned(*parts)) == ["bn.group_size"]  # set in one part only
    assert varied_keys(planned([*TINY, "~study"], [*TINY, "study=a"])) == ["study"]
    joblib = [*TINY, "hydra/launcher=joblib"]
    launched = [[*joblib, "hydra.launcher.n_jobs=2"], [*joblib, "hydra.launcher.n_jobs=1"]]
    assert varied_keys(planned(*launched)) == []  # how the jobs launch, not what they train


def test_sweep_progress_names_the_varied_settings_from_each_run_s_config(tmp_path):
    record = {"bn": "bn", "parallel": "emulated", "devices": 128, "per_device_batch_size": 2}
    result = {"test_acc": 93.62, "train_loss": 0.03, "steps": 6, "wall_time_s": 5.0}
    finished = {**record, "seed": 3, **result}
    ran, failed = tmp_path / "0_bn_emulated128_s3", tmp_path / "1_bn_emulated128_s3"
    ran.mkdir()
    failed.mkdir()
    (ran / "config.yaml").write_text("model:\n  name: resnet20\n  width: 16\n")
    progress = SweepProgress(tmp_path, total=2, varied=["model", "model.width"], clock=lambda: 0.0)
    (ran / "summary.json").write_text(json.dumps(finished))
    (failed / ERROR_FILE).write_text(json.dumps({**record, "error": "boom"}))
    os.utime(ran / "summary.json", (100, 100))  # it landed first
    assert progress.poll() == [
        "[1/2] bn, emulated x128 (2 images per device), model=resnet20, model.width=16, seed 3 "
        "| test error 6.38 % | 5.0 s | about 0.0 s left",
        "[2/2] bn, emulated x128 (2 images per device), model=?, model.width=?, seed ? "
        "| failed: boom | ? | all runs done",
    ]


def test_sweep_progress_says_each_run_once_with_its_result_and_the_time_left(tmp_path):
    def write(name, file, record, mtime):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / file).write_text(json.dumps(record))
        os.utime(tmp_path / name / file, (mtime, mtime))

    cell = {"bn": "sync", "parallel": "emulated", "devices": 2, "per_device_batch_size": 32}
    finished = {**cell, "seed": 0, "test_acc": 91.5, "steps": 6, "train_loss": 0.3}
    write("0_sync_emulated2_s0", "summary.json", {**finished, "wall_time_s": 9.0}, 100)
    write("1_bn_emulated3_s0", ERROR_FILE, {"error": "an earlier attempt"}, 101)
    clock = [1000.0]
    progress = SweepProgress(tmp_path, total=4, clock=lambda: clock[0])
    assert progress.done == 1 and progress.poll() == []  # finished before: no line

    clock[0] += 30
    write("2_sync_emulated2_s1", "summary.json", {**finished, "seed": 1, "wall_time_s": 12.5}, 200)
    assert progress.poll() == [
        "[2/4] sync, emulated x2 (32 images per device), seed 1 | test error 8.50 % | 12.5 s "
        "| about 1 min 0 s left"  # 30 s for one run, two to go
    ]
    clock[0] += 30
    diverged = {**finished, "seed": 2, "train_loss": None, "wall_time_s": 70.0}
    write("3_sync_emulated2_s2", "summary.json", diverged, 301)
    failure = {"error": "rank 1 failed: boom", "bn": "bn", "parallel": "emulated", "devices": 3}
    write("1_bn_emulated3_s0", ERROR_FILE, {**failure, "per_device_batch_size": 64 / 3}, 300)
    assert progress.poll() == [
        "[3/4] bn, emulated x3 (21.3 images per device), seed ? | failed: rank 1 failed: boom "
        "| ? | about 30.0 s left",
        "[4/4] sync, emulated x2 (32 images per device), seed 2 | diverged (the training loss "
        "is not finite) | 1 min 10 s | all runs done",
    ]
    assert progress.poll() == []


def test_sweep_progress_says_a_stopped_run_without_counting_it(tmp_path):
    cell = {"bn": "bn", "parallel": "emulated", "devices": 2, "per_device_batch_size": 32}
    progress = SweepProgress(tmp_path, total=2, clock=lambda: 0.0)
    run_dir = tmp_path / "0_bn_emulated2_s0"
    run_dir.mkdir()
    stopped = "stopped by SIGTERM at step 3; checkpoint x; continue with trainer.resume=y"
    (run_dir / ERROR_FILE).write_text(json.dumps({**cell, "error": stopped, "reason": "preempted"}))
    assert progress.poll() == [
        f"[0/2] bn, emulated x2 (32 images per device), seed ? | {stopped} (it continues when "
        "requeued or resumed) | ?"
    ]
    assert progress.poll() == [] and progress.done == 0  # said once; not an outcome
    (run_dir / ERROR_FILE).unlink()  # the requeued job resumes, then diverges
    diverged = "diverged at step 9: the training loss is nan (learning rate 0.1); lower optim.lr"
    (run_dir / ERROR_FILE).write_text(json.dumps({**cell, "error": diverged, "reason": "diverged"}))
    assert progress.poll() == [
        f"[1/2] bn, emulated x2 (32 images per device), seed ? | {diverged} | ? | about 0.0 s left"
    ]
