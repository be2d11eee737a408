"""A full disk at each place a run writes (its checkpoint, metrics.jsonl, summary.json): one
line that names the file, the space left and what to do, exit status 1, error.json where it
still fits (a sweep's job) and the sweep's line for the run; what was complete stays (the
last checkpoint, the records before). The full disk is an OSError(ENOSPC) raised by the
write itself, after it wrote part of its bytes, as a full file system does."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch

from syncbn_lab import disk
from syncbn_lab import logging as run_logging
from syncbn_lab.cli import exit_on_user_error
from syncbn_lab.disk import DiskFull
from syncbn_lab.engine import checkpoint
from syncbn_lab.multirun import SweepProgress, run_job
from syncbn_lab.train import run

FAST = ["trainer.max_steps=3", "trainer.checkpoint_every=1", "trainer.preflight=false"]


def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


class FillsUp:
    """A file whose writes fail once ``room`` bytes are written, or at its ``writes``-th
    write, as on a full disk: the write that does not fit writes what fits (half of it),
    then raises ENOSPC."""

    def __init__(self, file, room: int | None = None, writes: int | None = None):
        self.file, self.room, self.writes = file, room, writes

    def write(self, data):
        if self.writes is not None:
            self.writes -= 1
            fits = len(data) // 2 if self.writes == 0 else len(data)
        else:
            fits = max(min(self.room, len(data)), 0)
            self.room -= len(data)
        if fits < len(data):
            self.file.write(data[:fits])
            self.file.flush()
            raise no_space(self.file.name)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def fill_checkpoint(monkeypatch) -> str:
    """The second checkpoint finds the disk full after 100 of its bytes."""
    save, calls = torch.save, []

    def fake(state, f):
        calls.append(1)
        save(state, FillsUp(f, room=100) if len(calls) == 2 else f)

    monkeypatch.setattr(checkpoint.torch, "save", fake)
    return "checkpoints/last.pt"


def fill_metrics(monkeypatch) -> str:
    """metrics.jsonl fills up in the middle of its third record."""

    def fake(path, *args, **kwargs):
        return FillsUp(open(path, *args, **kwargs), writes=3)  # noqa: SIM115

    monkeypatch.setattr(run_logging, "open", fake, raising=False)
    return "metrics.jsonl"


def fill_summary(monkeypatch) -> str:
    """summary.json does not fit: its temporary file fills up after 10 bytes."""

    def fake(path, *args, **kwargs):
        file = open(path, *args, **kwargs)  # noqa: SIM115
        return FillsUp(file, room=10) if Path(path).name == "summary.json.tmp" else file

    monkeypatch.setattr(disk, "open", fake, raising=False)
    return "summary.json"


FILLS = {"checkpoint": fill_checkpoint, "metrics": fill_metrics, "summary": fill_summary}


def assert_full_disk_line(line: str, path: Path) -> None:
    assert "\n" not in line.strip()
    assert line.startswith(f"no space left on the disk of {path} (")
    assert re.search(r"\(\d+(\.\d)? (B|kB|MB|GB) free there\); ", line), line


def records(metrics: Path) -> list[dict]:
    """Every line of metrics.jsonl as JSON (a line cut short fails here)."""
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.parametrize("where", FILLS)
def test_a_full_disk_is_one_line_and_keeps_what_was_complete(
    where, tmp_path, tiny_cfg, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    target = run_dir / FILLS[where](monkeypatch)
    with pytest.raises(SystemExit) as stopped, exit_on_user_error():
        run(tiny_cfg(*FAST), run_dir)
    assert stopped.value.code == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert_full_disk_line(line.removeprefix("error: "), target)
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    last = run_dir / "checkpoints" / "last.pt"
    kept = checkpoint.load(last)  # the checkpoint before the full disk, whole
    assert kept["step"] == {"checkpoint": 1, "metrics": 2, "summary": 3}[where]
    if where == "checkpoint":
        assert "last.pt is kept as it was" in line and f"trainer.resume={run_dir}" in line
    monkeypatch.undo()  # space again: the run continues from its checkpoint to the end
    summary = run(tiny_cfg(*FAST, f"trainer.resume={run_dir}"), run_dir)
    assert summary["steps"] == 3
    steps = [r["step"] for r in records(run_dir / "metrics.jsonl") if "val/acc" not in r]
    assert steps == [1, 2, 3]  # each step's record once, none cut short


def test_a_sweeps_job_on_a_full_disk_leaves_error_json_and_the_sweeps_line(
    tmp_path, tiny_cfg, monkeypatch
):
    sweep_dir = tmp_path / "sweep"
    run_dir = sweep_dir / "0_bn_single1_s0"
    progress = SweepProgress(sweep_dir, 1)
    fill_checkpoint(monkeypatch)
    assert run_job(tiny_cfg(*FAST), run_dir, run) is None
    error = json.loads((run_dir / "error.json").read_text())
    assert error["reason"] == "disk full"
    assert_full_disk_line(error["error"], run_dir / "checkpoints" / "last.pt")
    (line,) = progress.poll()
    assert line.startswith("[1/1] bn, single x1 (32 images per device), seed 0 | failed: no space")


def test_error_json_that_does_not_fit_leaves_the_line_alone(tmp_path, tiny_cfg, monkeypatch):
    from syncbn_lab.multirun import record_failure

    def full(path, *args, **kwargs):
        raise no_space(path)

    monkeypatch.setattr(disk, "open", full, raising=False)
    record_failure(tiny_cfg(), tmp_path, "no space left on the disk of x", reason="disk full")
    assert not list(tmp_path.iterdir())  # no error.json, no half of one, no traceback


def test_the_terminal_keeps_its_lines_when_train_log_cannot_be_written(tmp_path, capsys):
    from syncbn_lab.logging.console import log_terminal

    log = tmp_path / "train.log"
    with log_terminal(log):
        import sys

        sys.stdout.log = FillsUp(sys.stdout.log, room=5)
        sys.stderr.log = sys.stdout.log
        print("a line longer than five bytes")
        print("error: the line that says why", file=sys.stderr)
    captured = capsys.readouterr()
    assert captured.out == "a line longer than five bytes\n"
    assert captured.err == "error: the line that says why\n"


def test_disk_full_names_the_free_space_of_the_nearest_folder(tmp_path):
    line = str(DiskFull(tmp_path / "not" / "yet" / "there.pt", "do this"))
    free = disk.free_space(tmp_path)
    assert (
        line
        == f"no space left on the disk of {tmp_path}/not/yet/there.pt ({free} free there); do this"
    )  # noqa: E501
