"""A sweep's finished runs as one committed file, so a study that outlasts its machine resumes
on any machine from what is committed.

A sweep dir is ``<stamp>/`` with sweep.json (the settings it was started with), wall_time_s,
attempts.json (each start or resume: when, on which machine, for how long) and one run dir
per job. :func:`pack` writes the finished runs of it (config.yaml, summary.json,
metrics.jsonl, train.log: what the report reads and what ``skip_finished`` checks) with
the sweep's own files into a ``.tar.gz``; runs not finished, failed or still training are
left out, so they run again when the sweep resumes. The archive is byte-for-byte the same
when the runs are (sorted members, no times or owners), so packing again after nothing new
finished changes no committed file. :func:`unpack` lays an archive out as a sweep dir again;
``scripts/sweep.py --resume <archive>`` does it and continues the sweep there.
"""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import tarfile
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from syncbn_lab.disk import write_atomic, writing
from syncbn_lab.errors import UserError
from syncbn_lab.multirun import SUMMARY_KEYS, finished_summary

RUN_FILES = ("config.yaml", "summary.json", "metrics.jsonl", "train.log")
SWEEP_FILES = ("sweep.json", "wall_time_s", "attempts.json")
ATTEMPTS = "attempts.json"


def finished_runs(sweep_dir: Path) -> list[Path]:
    """The run dirs under ``sweep_dir`` whose summary.json is complete, sorted by name."""
    return sorted(p.parent for p in sweep_dir.glob("*/summary.json") if finished_summary(p.parent))


def pack(sweep_dir: Path, archive: Path, at_least: int = 0) -> int:
    """Write ``archive`` (a .tar.gz) from the sweep's files and its finished runs; returns how
    many runs it holds. Written beside and renamed into place: a reader never sees half, and
    a full disk (one DiskFull line) leaves the archive as it was. An archive of fewer than
    ``at_least`` runs (those a resume read from it) does not replace it: a UserError."""
    top = sweep_dir.name
    members = [(f"{top}/{name}", sweep_dir / name) for name in SWEEP_FILES]
    runs = finished_runs(sweep_dir)
    if len(runs) < at_least:
        raise UserError(
            f"{archive} is kept as it was: it holds {at_least} finished runs and {sweep_dir} "
            f"only {len(runs)}; resume from the archive again (scripts/sweep.py --resume "
            f"{archive}) to lay its runs out there"
        )
    for run_dir in runs:
        members += [(f"{top}/{run_dir.name}/{n}", run_dir / n) for n in RUN_FILES]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in members:
            if not path.is_file():
                continue
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    with writing(archive, f"{archive} is kept as it was; free space there"):
        archive.parent.mkdir(parents=True, exist_ok=True)
    fix = f"{archive} is kept as it was; free space there, then resume the sweep to pack it"
    packed = io.BytesIO()  # the gzip header names the file as the archive always did
    with gzip.GzipFile(archive.name + ".tmp", "wb", fileobj=packed, mtime=0) as gz:
        gz.write(buffer.getvalue())
    write_atomic(archive, packed.getvalue(), fix)
    return len(runs)


@dataclass
class Contents:
    """What could be read of an archive: its sweep dir's name and sweep.json, the files of
    its sweep and of each run read whole (name -> bytes), the finished runs among them, and
    why the rest could not be read (None: the archive is whole)."""

    top: str
    record: dict[str, Any]
    files: dict[str, bytes]
    runs: list[str]
    damage: str | None


class ArchiveDamaged(UserError):
    """The archive ends early or is corrupted: the runs before the damage can be read."""


def read(archive: Path) -> Contents:
    """Every member of ``archive`` that can be read, in order; a run cut by the damage (not
    every one of its files read) is left out whole. A file that is no sweep's archive is a
    UserError line."""
    raw, damage = _gunzip(archive)
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r|") as tar:
            for member in tar:
                if member.isfile():
                    files[member.name] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError) as e:
        damage = damage or str(e) or type(e).__name__
    if not files:
        raise UserError(
            f"{archive} is not a sweep's archive ({damage or 'no files'}); pass a runs.tar.gz "
            "that scripts/sweep.py --archive wrote, or a sweep dir"
        )
    last = Path(next(reversed(files))).parent  # the run being read when it broke
    if damage is not None and any(f"{last}/{name}" not in files for name in RUN_FILES):
        files = {name: data for name, data in files.items() if Path(name).parent != last}
    tops = {Path(name).parts[0] for name in files}
    if len(tops) != 1 or f"{next(iter(tops))}/sweep.json" not in files:
        raise UserError(
            f"{archive} is not a sweep's archive (it holds {len(tops)} folders at its top and "
            "no sweep.json under one); pass a runs.tar.gz that scripts/sweep.py --archive "
            "wrote, or a sweep dir"
        )
    (top,) = tops
    try:
        record = json.loads(files[f"{top}/sweep.json"])
    except ValueError as e:
        raise UserError(f"{archive}: its sweep.json is not JSON ({e})") from None
    runs = sorted(
        name.split("/")[1]
        for name, data in files.items()
        if name.count("/") == 2 and name.endswith("/summary.json") and _finished(data)
    )
    return Contents(top, record, files, runs, damage)


def _gunzip(archive: Path) -> tuple[bytes, str | None]:
    """The bytes ``archive`` decompresses to, as far as they go, and what stopped them (None:
    the whole stream, its checksum verified)."""
    stream = zlib.decompressobj(wbits=31)  # gzip
    out, data = [], archive.read_bytes()
    try:
        for start in range(0, len(data), 1 << 16):
            out.append(stream.decompress(data[start : start + (1 << 16)]))
    except zlib.error as e:
        return b"".join(out), str(e)
    if not stream.eof:
        return b"".join(out), "cut short: its gzip stream ends early"
    return b"".join(out), None


def _finished(summary: bytes) -> bool:
    try:
        record = json.loads(summary)
    except ValueError:
        return False
    return isinstance(record, dict) and all(record.get(k) is not None for k in SUMMARY_KEYS)


def damaged_line(archive: Path, contents: Contents) -> str:
    """The one line about a damaged archive: what is wrong, how many runs can be read, and
    how to get the whole file back."""
    if _tracked(archive):
        restore = f"restore it with git checkout -- {archive}"
    else:
        restore = "copy it again from where it came from (git does not track it)"
    return (
        f"{archive} is damaged ({contents.damage}): {len(contents.runs)} finished runs can "
        f"be read from it; {restore}"
    )


def _tracked(path: Path) -> bool:
    """Whether git tracks ``path`` in the checkout that holds it."""
    folder = path.resolve().parent
    try:
        found = subprocess.run(
            ["git", "ls-files", "--error-unmatch", path.resolve().name],
            cwd=folder,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return found.returncode == 0


def read_record(archive: Path) -> tuple[str, dict[str, Any]]:
    """The archive's sweep dir name and its sweep.json (a damaged archive: the one line of
    :func:`damaged_line`, as ArchiveDamaged)."""
    contents = read(archive)
    if contents.damage is not None:
        raise ArchiveDamaged(damaged_line(archive, contents))
    return contents.top, contents.record


def unpack(archive: Path, parent: Path, damaged_ok: bool = False) -> Path:
    """Lay ``archive`` out as ``parent/<its sweep dir>`` and return that dir. Files already
    there are kept (a run finished here and not yet packed stays), the rest are added. A
    damaged archive is refused (ArchiveDamaged) unless ``damaged_ok``: then what can be read
    of it is laid out."""
    contents = read(archive)
    if contents.damage is not None and not damaged_ok:
        raise ArchiveDamaged(damaged_line(archive, contents))
    for name, data in contents.files.items():
        path = parent / name
        if not path.resolve().is_relative_to(parent.resolve()):
            raise UserError(f"{archive} holds {name}, outside its sweep dir; it is no archive")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return parent / contents.top


def start_attempt(sweep_dir: Path, machine: dict[str, Any]) -> int:
    """Add this start or resume of the sweep to attempts.json; returns its index."""
    attempts = read_attempts(sweep_dir)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    attempts.append({"started": started, "machine": machine, "wall_time_s": 0.0, "runs_ended": 0})
    _write_attempts(sweep_dir, attempts)
    return len(attempts) - 1


def end_of_attempt(sweep_dir: Path, index: int, wall_time_s: float, runs_ended: int) -> None:
    """Record how long attempt ``index`` has run so far and how many runs ended in it
    (finished or failed)."""
    attempts = read_attempts(sweep_dir)
    attempts[index].update(wall_time_s=round(wall_time_s, 1), runs_ended=runs_ended)
    _write_attempts(sweep_dir, attempts)


def read_attempts(sweep_dir: Path) -> list[dict[str, Any]]:
    """attempts.json of ``sweep_dir``: one record per start or resume, oldest first."""
    path = sweep_dir / ATTEMPTS
    return json.loads(path.read_text()) if path.exists() else []


def _write_attempts(sweep_dir: Path, attempts: list[dict[str, Any]]) -> None:
    write_atomic(sweep_dir / ATTEMPTS, json.dumps(attempts, indent=1) + "\n")
