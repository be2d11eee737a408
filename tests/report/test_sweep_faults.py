"""What a long study meets besides its runs' own failures: a full disk where the sweep packs
its archive or writes its report, an archive cut short or corrupted (an interrupted copy),
and a second sweep on the same archive or sweep dir. Each is one line and loses nothing that
was complete. scripts/sweep.py and scripts/report.py run in this process (their main), the
sweep that holds a lock in another."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from syncbn_lab import archive, disk
from syncbn_lab.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "reports" / "nbs_capacity" / "runs.tar.gz"  # 16 finished runs
CUT = 200_000  # bytes of it an interrupted copy leaves


def script(name: str) -> dict:
    """The globals of scripts/<name>.py, loaded without running it."""
    return runpy.run_path(str(ROOT / "scripts" / f"{name}.py"), run_name=f"{name}_under_test")


def main(name: str, args: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """``scripts/<name>.py <args>`` in this process: its exit status and its stderr lines."""
    monkeypatch.setattr(sys, "argv", [f"scripts/{name}.py", *map(str, args)])
    try:
        script(name)["main"]()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    return code, capsys.readouterr().err.strip().splitlines()


def cut_copy(tmp_path: Path, size: int = CUT) -> Path:
    cut = tmp_path / "runs.tar.gz"
    cut.write_bytes(COMMITTED.read_bytes()[:size])
    return cut


def runs_in(path: Path) -> list[str]:
    """The finished runs of an archive, read with tarfile alone (the reference)."""
    with tarfile.open(path) as tar:
        names = [m.name for m in tar.getmembers() if m.name.endswith("/summary.json")]
    return sorted(n.split("/")[1] for n in names)


def make_sweep(root: Path, runs: int) -> Path:
    sweep_dir = root / "2026-12-07_12-00-00"
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "nbs_256", "parts": []}))
    for i in range(runs):
        run = sweep_dir / f"{i}_bn_emulated1_s{i}"
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"test_acc": 90.0, "steps": 10}))
        (run / "metrics.jsonl").write_text("{}\n")
    return sweep_dir


# --- a full disk ----------------------------------------------------------------------------------


def test_a_full_disk_while_packing_keeps_the_archive_as_it_was(tmp_path, monkeypatch):
    sweep_dir = make_sweep(tmp_path / "multirun", 2)
    packed = tmp_path / "runs.tar.gz"
    archive.pack(sweep_dir, packed)
    before = packed.read_bytes()
    make_sweep(tmp_path / "more", 3)  # a third run finished: the next pack is larger
    real_open = open

    def full(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        if "w" in mode:
            file.write(b"\0" * 10)  # what fit
            file.flush()
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return file

    monkeypatch.setattr(disk, "open", full, raising=False)
    with pytest.raises(disk.DiskFull) as refused:
        archive.pack(tmp_path / "more" / sweep_dir.name, packed)
    line = str(refused.value)
    assert line.startswith(f"no space left on the disk of {packed} (")
    assert f"{packed} is kept as it was" in line
    assert packed.read_bytes() == before and not list(tmp_path.glob("*.tmp"))


def test_a_full_disk_while_writing_the_report_is_one_line(tmp_path, monkeypatch, capsys):
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "README.md":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    out = tmp_path / "report"
    code, lines = main("report", [COMMITTED, "--out", out], monkeypatch, capsys)
    assert code == 1
    assert len(lines) == 1 and lines[0].startswith(f"error: no space left on the disk of {out} (")
    assert lines[0].endswith("; free space there, or pass --out on another disk")


def test_a_bad_value_in_one_job_stops_the_sweep_before_any_run(tmp_path, monkeypatch, capsys):
    sweep_dir = tmp_path / "sweep"
    args = ["--experiment", "nbs_256", "--smoke", "--sweep-dir", sweep_dir, "parallel.devices=1,3"]
    code, lines = main("sweep", args, monkeypatch, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: run 2 of 7 (bn=bn parallel.devices=3 "), lines
    assert "trainer.global_batch_size=256 is not divisible by" in lines[0]
    assert lines[0].endswith("; no run was started")
    assert not sweep_dir.exists()


def test_jobs_a_slurm_launcher_sends_elsewhere_are_checked_there():
    from syncbn_lab.multirun import check_jobs

    # no CUDA here, but a SLURM node may have it; the same job on this machine is refused
    job = ["experiment=nbs_256", "trainer.device=cuda", "hydra.sweep.dir=x"]
    check_jobs([[*job, "hydra/launcher=submitit_slurm"]])
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA device is visible"):
            check_jobs([[*job, "hydra/launcher=joblib"]])


def test_a_report_folder_that_cannot_be_made_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a folder")
    out = tmp_path / "file" / "report"
    code, lines = main("report", [COMMITTED, "--out", out], monkeypatch, capsys)
    assert code == 2 and lines == [
        f"error: cannot make the folder {out} (Not a directory); pass --out a folder that can "
        "be written"
    ]


# --- a damaged archive ----------------------------------------------------------------------------


def test_a_cut_archive_is_one_line_that_counts_its_readable_runs(tmp_path):
    cut = cut_copy(tmp_path)
    contents = archive.read(cut)
    readable = contents.runs
    # the reference: the runs whose four files lie whole in the first 200 kB
    whole = [r for r in runs_in(COMMITTED) if _whole_within(r, CUT)]
    assert readable == whole and 0 < len(readable) < 16
    line = archive.damaged_line(cut, contents)
    assert line == (
        f"{cut} is damaged (cut short: its gzip stream ends early): {len(readable)} finished "
        "runs can be read from it; copy it again from where it came from (git does not track it)"
    )


def _whole_within(run: str, size: int) -> bool:
    """Whether every file of ``run`` ends within the first ``size`` compressed bytes of the
    committed archive (decompressing that prefix alone reaches its last byte)."""
    import zlib

    stream = zlib.decompressobj(wbits=31)
    raw = stream.decompress(COMMITTED.read_bytes()[:size])
    with tarfile.open(COMMITTED) as tar:
        ends = [
            m.offset_data + m.size
            for m in tar.getmembers()
            if m.name.split("/")[1:2] == [run] and m.isfile()
        ]
    return max(ends) <= len(raw)


def test_a_tracked_archive_is_restored_with_git_checkout(tmp_path):
    repo = tmp_path / "clone"
    repo.mkdir()
    packed = repo / "runs.tar.gz"
    packed.write_bytes(COMMITTED.read_bytes())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "runs.tar.gz"], check=True)
    subprocess.run([*git, "commit", "-qm", "archive"], check=True)
    packed.write_bytes(COMMITTED.read_bytes()[:CUT])
    with pytest.raises(archive.ArchiveDamaged, match=f"restore it with git checkout -- {packed}$"):
        archive.read_record(packed)


def test_a_corrupted_archive_is_damaged_not_silently_short(tmp_path):
    corrupted = bytearray(COMMITTED.read_bytes())
    corrupted[250_000:250_064] = bytes(64)  # bytes in the middle overwritten
    path = tmp_path / "runs.tar.gz"
    path.write_bytes(bytes(corrupted))
    contents = archive.read(path)
    assert contents.damage is not None and len(contents.runs) < 16


def test_report_of_a_cut_archive_is_one_line(tmp_path, monkeypatch, capsys):
    cut = cut_copy(tmp_path)
    code, lines = main("report", [cut, "--out", tmp_path / "report"], monkeypatch, capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: {cut} is damaged (")
    assert not (tmp_path / "report").exists()


def test_resume_of_a_cut_archive_is_refused_unless_told_what_reruns(tmp_path, monkeypatch, capsys):  # noqa: E501
    cut = cut_copy(tmp_path)
    n = len(archive.read(cut).runs)
    laid_out = tmp_path / "multirun"
    args = ["--resume", cut, "--sweep-dir", laid_out]
    code, lines = main("sweep", args, monkeypatch, capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: {cut} is damaged (")
    assert lines[0].endswith(
        f"or pass --rerun-unreadable to resume from those {n} runs (the others run again)"
    )
    assert not laid_out.exists() and cut.read_bytes() == COMMITTED.read_bytes()[:CUT]


def test_rerun_unreadable_lays_out_the_readable_runs_and_never_packs_fewer(tmp_path):
    cut = cut_copy(tmp_path)
    contents = archive.read(cut)
    sweep_dir = archive.unpack(cut, tmp_path / "multirun", damaged_ok=True)
    assert [p.name for p in archive.finished_runs(sweep_dir)] == contents.runs
    first = sorted(sweep_dir.iterdir())[0]
    for path in first.iterdir():  # a laid-out run lost here: the archive must not shrink
        path.unlink()
    before = cut.read_bytes()
    with pytest.raises(archive.UserError, match=f"{cut} is kept as it was: it holds"):
        archive.pack(sweep_dir, cut, at_least=len(contents.runs))
    assert cut.read_bytes() == before
    archive.unpack(cut, tmp_path / "multirun", damaged_ok=True)  # laid out again
    assert archive.pack(sweep_dir, cut, at_least=len(contents.runs)) == len(contents.runs)
    assert runs_in(cut) == contents.runs  # whole again, with every run it could read


# --- two sweeps at once ---------------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from syncbn_lab.sweep import locked
with locked(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    time.sleep(120)
"""


@contextlib.contextmanager
def another_sweep(path: Path, what: str):
    """A process that holds ``path``'s lock as a sweep does, until the block ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), what], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_second_sweep_on_a_sweep_dir_is_refused_naming_the_first(tmp_path, monkeypatch, capsys):  # noqa: E501
    sweep_dir = make_sweep(tmp_path, 1)
    with another_sweep(sweep_dir, "the sweep dir") as first:
        code, lines = main("sweep", ["--resume", sweep_dir], monkeypatch, capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(
        f"error: the sweep dir {sweep_dir} is in use by another sweep (pid {first.pid} on "
        f"{socket.gethostname()} since "
    )
    assert lines[0].endswith("; wait for it to end, or stop it")
    assert (tmp_path / f"{sweep_dir.name}.lock").exists()  # the first one's, left by its kill


def test_a_second_sweep_on_an_archive_is_refused_naming_the_first(tmp_path, monkeypatch, capsys):  # noqa: E501
    packed = tmp_path / "runs.tar.gz"
    archive.pack(make_sweep(tmp_path / "m", 1), packed)
    with another_sweep(packed, "the archive") as first:
        code, lines = main("sweep", ["--resume", packed], monkeypatch, capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(
        f"error: the archive {packed} is in use by another sweep (pid {first.pid} "
    )  # noqa: E501
    assert not (ROOT / "multirun" / "nbs_256" / "2026-12-07_12-00-00").exists()


@pytest.mark.parametrize("where", ["file", "file/sub", "/proc"])
def test_an_archive_where_no_lock_can_be_written_is_one_line(tmp_path, monkeypatch, capsys, where):
    # a file where its folder goes (no folder can be made), and a folder that takes no new
    # file (Linux's /proc)
    if where == "/proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    (tmp_path / "file").write_text("not a folder")
    packed = tmp_path / where / "runs.tar.gz"
    sweep_dir = tmp_path / "sweep"
    args = ["--experiment", "nbs_256", "--sweep-dir", sweep_dir, "--archive", packed]
    code, lines = main("sweep", args, monkeypatch, capsys)
    assert code == 2 and len(lines) == 1, lines
    made = f"error: cannot make the folder {packed.parent} ("
    written = f"error: cannot write {packed}.lock, the lock of the archive ("
    assert lines[0].startswith(written if where == "/proc" else made), lines
    assert lines[0].endswith("); put the archive in a writable folder"), lines
    assert not sweep_dir.exists() and not (tmp_path / "sweep.lock").exists()


def test_a_stale_lock_is_taken_over_and_released(tmp_path, monkeypatch, capsys):
    sweep_dir = tmp_path / "sweep"
    with another_sweep(sweep_dir, "the sweep dir") as first:
        os.kill(first.pid, signal.SIGKILL)  # killed: its lock stays behind
        first.wait()
    lock = tmp_path / "sweep.lock"
    assert json.loads(lock.read_text())["pid"] == first.pid
    code, lines = main("sweep", ["--resume", sweep_dir], monkeypatch, capsys)
    assert lines == [
        f"note: {lock} was left by pid {first.pid}, which is gone; taking it",
        f"error: {sweep_dir} holds no sweep.json; pass a sweep dir scripts/sweep.py wrote",
    ]
    assert code == 1 and not lock.exists()  # released when the sweep ended


def test_a_resume_writes_its_report_where_the_sweep_was_told_to(tmp_path):
    sweep = script("sweep")
    report_dir = tmp_path / "elsewhere"
    args = argparse.Namespace(
        resume=None, experiment="bn_vs_syncbn", smoke=True, parallel=None, launcher=None,
        overrides=[], sweep_dir=tmp_path / "s", archive=None, report_dir=report_dir,
        rerun_unreadable=False,
    )  # fmt: skip
    with contextlib.ExitStack() as locks:
        _, record, _ = sweep["settings"](args, locks)
    assert record["report_dir"] == str(report_dir)  # in sweep.json, and so in its archive
    resumed = argparse.Namespace(report_dir=None)
    assert sweep["report_dir_of"](resumed, record) == report_dir
    assert sweep["report_dir_of"](resumed, {"name": "x"}) == ROOT / "reports" / "x"
