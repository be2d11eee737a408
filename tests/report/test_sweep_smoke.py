"""`make sweep-smoke`: the whole sweep pipeline at tiny scale, then its report; a run that
fails does not stop the others, and a sweep killed midway and resumed ends with the report
of an uninterrupted one."""

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest
import torch
from conftest import ROOT
from helpers import as_in_a_terminal, live_members

from syncbn_lab import archive
from syncbn_lab.engine.precision import resolve
from syncbn_lab.faults import fault_override

SWEEP = str(ROOT / "scripts" / "sweep.py")
# The runs over 8 devices raise at their first step (an injected fault: a run that fails as
# it runs; a bad value is refused before any run starts), and the sweep goes on.
WITH_FAILING_CELL = ["parallel.devices=1,4,8", fault_override("raise", rank=0, step=1, devices=8)]
FAULT = "RuntimeError: injected fault on rank 0 at step 1"
# The grid (bn, sync at 1 and 4 devices), brn at 4, GroupNorm once, one 2-rank DDP run.
FINISHED = [("bn", 1), ("bn", 4), ("brn", 4), ("gn", 1), ("sync", 1), ("sync", 2), ("sync", 4)]


def sweep_command(report_dir, *extra):
    return [sys.executable, SWEEP, "--report-dir", str(report_dir), *extra]


def finished(sweep_dir):
    return sorted(
        (s["bn"], s["devices"])
        for s in (json.loads(p.read_text()) for p in sweep_dir.rglob("summary.json"))
    )


def progress_lines(stdout):
    """The sweep's line per finished run, ``[k/N] cell | result | time | time left``."""
    return [line for line in stdout.splitlines() if re.match(r"\[\d+/\d+\] ", line)]


def line_of(summary):
    """The line a finished run gets, written out from its summary.json."""
    cell = (
        f"{summary['bn']}, {summary['parallel']} x{summary['devices']} "
        f"({summary['per_device_batch_size']} images per device), seed {summary['seed']}"
    )
    return f"{cell} | test error {100 - summary['test_acc']:.2f} % | {summary['wall_time_s']:.1f} s"


def comparable_rows(report_dir):
    """results.csv without what differs between two sweeps of the same runs."""
    rows = list(csv.DictReader(open(report_dir / "results.csv")))
    for row in rows:
        row.pop("wall_time_s")
        row.pop("step_time_s")
        row["run_dir"] = os.path.basename(row["run_dir"])
    return rows


def comparable_readme(report_dir):
    """README.md without the timings (the provenance line with the wall time, the DDP cost
    table's step times)."""
    text = (report_dir / "README.md").read_text()
    before, cost = text.split("## Cost under real DDP")
    cost_rows = cost.split("\n## ", 1)[0]
    kept = before + cost.replace(cost_rows, "")
    assert "| sync | 2 | 1 |" in cost_rows  # the DDP run is in the cost table
    return [line for line in kept.splitlines() if not line.startswith("Produced by")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    sweep_dir, report_dir = tmp / "sweep", tmp / "report"
    packed = tmp / "runs.tar.gz"
    result = subprocess.run(
        [
            *sweep_command(
                report_dir, "--smoke", "--sweep-dir", str(sweep_dir), "--archive", str(packed)
            )
        ]
        + WITH_FAILING_CELL,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    return sweep_dir, report_dir, result


@pytest.mark.slow
def test_sweep_smoke_writes_report_and_marks_the_failed_cells(uninterrupted):
    sweep_dir, report_dir, result = uninterrupted
    assert result.returncode == 1, result.stderr[-3000:]  # two runs failed
    assert "error: some runs failed" in result.stderr  # and the report did not
    assert "the report failed" not in result.stderr
    log = (sweep_dir / "sweep.log").read_text()  # the jobs' own output
    assert log.count("error: job ") == 2, log[-3000:]
    assert f"error: job 2_bn_emulated8_s0 failed: {FAULT}" in log
    summaries = [json.loads(p.read_text()) for p in sweep_dir.rglob("summary.json")]
    # trainer.precision=auto resolved once and pinned in every part (and so kept by --resume)
    pinned = {f"trainer.precision={resolve('auto', torch.device('cpu'))}"}
    record = json.loads((sweep_dir / "sweep.json").read_text())
    assert all(pinned <= set(part["overrides"]) for part in record["parts"]), record["parts"]
    assert {f"trainer.precision={s['precision']}" for s in summaries} == pinned

    # the terminal: one line per run as it finished, none of the jobs' output
    lines = progress_lines(result.stdout)
    assert [line.split("]")[0] for line in lines] == [f"[{k}/9" for k in range(1, 10)], lines
    assert "epoch " not in result.stdout + result.stderr
    failed = [line for line in lines if f"| failed: {FAULT} |" in line]
    assert len(failed) == 2 and all("x8 (8 images per device)" in line for line in failed)
    for summary in summaries:
        assert sum(line_of(summary) in line for line in lines) == 1, (line_of(summary), lines)
    assert all(" left" in line for line in lines[:-1]) and lines[-1].endswith("| all runs done")
    for summary_file in sweep_dir.rglob("summary.json"):  # each job's lines in its train.log
        run_log = (summary_file.parent / "train.log").read_text()
        assert "epoch 1 | step 6 |" in run_log and "-- run finished" in run_log
    assert finished(sweep_dir) == FINISHED  # the 8-device runs failed
    assert sorted(s["parallel"] for s in summaries) == ["ddp"] + ["emulated"] * 6
    assert all(s["steps"] == 6 for s in summaries)
    ddp = next(s for s in summaries if s["parallel"] == "ddp")
    assert ddp["comm_norm_statistics_bytes_per_step"] > 0 and ddp["step_time_s"] > 0
    assert all(s["per_device_batch_size"] * s["devices"] == 64 for s in summaries)
    assert all(s.get("test_acc_precise_bn") is not None for s in summaries if s["bn"] != "gn")
    errors = sorted(p.parent.name for p in sweep_dir.rglob("error.json"))
    assert errors == ["2_bn_emulated8_s0", "5_sync_emulated8_s0"]
    rows = list(csv.DictReader(open(report_dir / "results.csv")))
    assert len(rows) == 7
    text = (report_dir / "README.md").read_text()
    first = summaries[0]
    machine = f"{first['cpu_model']} ({first['cpu_isa']}, {first['precision']})"
    assert f"Machines: {machine}: 7 runs." in text
    assert "## Which claims survive" not in text  # a smoke sweep is set beside no study
    assert "| images per device |" in text and "| 16 |" in text and "| 64 |" in text
    assert "**2 run(s) failed**" in text
    assert f"| bn | emulated | 8 | 8 | 0 | {FAULT} |" in text
    assert float((sweep_dir / "wall_time_s").read_text()) > 0
    # the archive: the finished runs' files and the sweep's own, packed as runs finished
    with tarfile.open(sweep_dir.parent / "runs.tar.gz") as tar:
        packed = sorted(m.name for m in tar.getmembers())
    runs = sorted(p.parent.name for p in sweep_dir.rglob("summary.json"))
    assert packed == sorted(
        [f"sweep/{n}" for n in ("sweep.json", "wall_time_s", "attempts.json")]
        + [f"sweep/{r}/{f}" for r in runs for f in archive.RUN_FILES]
    )
    (attempt,) = json.loads((sweep_dir / "attempts.json").read_text())
    assert attempt["runs_ended"] == 9 and attempt["machine"]["cpu_isa"] == first["cpu_isa"]
    assert 0 < attempt["wall_time_s"] <= float((sweep_dir / "wall_time_s").read_text())
    for png in ("test_error_vs_per_device_batch.png", "train_loss_curves.png"):
        assert (report_dir / png).stat().st_size > 1000


@pytest.mark.slow
def test_a_sweep_stopped_by_ctrl_c_leaves_no_process_and_resumes_to_the_same_report(
    uninterrupted, tmp_path
):
    sweep_dir, report_dir = tmp_path / "sweep", tmp_path / "report"
    proc = subprocess.Popen(
        [*sweep_command(report_dir, "--smoke", "--sweep-dir", str(sweep_dir))] + WITH_FAILING_CELL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
        start_new_session=True,  # its own process group: the kill reaches every job
        preexec_fn=as_in_a_terminal,
    )
    try:
        deadline = time.monotonic() + 240
        while not finished(sweep_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
        proc.wait(timeout=60)
        time.sleep(2)
        alive = live_members(proc.pid)
        assert alive == [], f"Ctrl-C left processes of the sweep behind: {alive}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    before = finished(sweep_dir)
    assert 1 <= len(before) < len(FINISHED), before  # killed midway
    kept = {p: p.stat().st_mtime_ns for p in sweep_dir.rglob("summary.json")}

    result = subprocess.run(  # --verbose: the jobs' own output on the terminal too
        sweep_command(report_dir, "--resume", str(sweep_dir), "--verbose"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]  # the 8-device runs fail again
    assert finished(sweep_dir) == FINISHED
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in kept.items())  # not rerun
    assert result.stderr.count("skipped: ") == len(before), result.stderr[-3000:]
    assert "epoch 1 | step 6 |" in result.stdout  # the jobs' epoch lines
    assert f"resumed: {len(before)} of 9 runs finished before" in result.stdout
    lines = progress_lines(result.stdout)  # only the runs still to do, numbered on from there
    assert [line.split("]")[0] for line in lines] == [
        f"[{k}/9" for k in range(len(before) + 1, 10)
    ], lines
    assert comparable_rows(report_dir) == comparable_rows(uninterrupted[1])
    assert comparable_readme(report_dir) == comparable_readme(uninterrupted[1])


@pytest.mark.slow
def test_a_sweep_resumes_from_its_archive_on_a_fresh_checkout(uninterrupted, tmp_path):
    """Only the archive is left (a new session's checkout): --resume lays it out, runs only
    what it lacks (the failing cells), and the report is the uninterrupted one."""
    sweep_dir, report_dir = uninterrupted[0], tmp_path / "report"
    packed = tmp_path / "runs.tar.gz"
    shutil.copy(sweep_dir.parent / "runs.tar.gz", packed)
    result = subprocess.run(
        sweep_command(report_dir, "--resume", str(packed), "--sweep-dir", str(tmp_path / "new")),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]  # the 8-device runs fail again
    laid_out = tmp_path / "new" / sweep_dir.name
    assert finished(laid_out) == FINISHED
    assert "resumed: 7 of 9 runs finished before" in result.stdout
    assert len(progress_lines(result.stdout)) == 2  # only the two failing cells ran
    assert comparable_rows(report_dir) == comparable_rows(uninterrupted[1])
    attempts = json.loads((laid_out / "attempts.json").read_text())
    assert [a["runs_ended"] for a in attempts] == [9, 2]
    with tarfile.open(packed) as tar:  # the same archive, now with both attempts
        record = json.loads(tar.extractfile(f"{sweep_dir.name}/attempts.json").read())
    assert record == attempts


def test_resume_refuses_new_settings_and_unknown_dirs(tmp_path):
    result = subprocess.run(
        [sys.executable, SWEEP, "--resume", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds no sweep.json; pass a sweep dir scripts/sweep.py wrote"
    ]
    (tmp_path / "sweep.json").write_text("{}")
    result = subprocess.run(
        [sys.executable, SWEEP, "--resume", str(tmp_path), "--smoke"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: --resume runs the sweep with the settings it was")


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["--experiment", "nope"],
            "error: --experiment nope is unknown; choose one of "
            + ", ".join(sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))),
        ),
        (  # an override that no run can take: Hydra's message, before any run
            ["--smoke", "trainer.nosuch=1"],
            "error: Could not override 'trainer.nosuch'. To append to your config use "
            "+trainer.nosuch=1",
        ),
    ],
)
def test_bad_input_is_one_line_before_anything_is_written(tmp_path, args, line):
    result = subprocess.run(
        [sys.executable, SWEEP, *args, "--sweep-dir", str(tmp_path / "s")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "s").exists()
