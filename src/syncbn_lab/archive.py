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
import os
import tarfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from syncbn_lab.errors import UserError
from syncbn_lab.multirun import finished_summary

RUN_FILES = ("config.yaml", "summary.json", "metrics.jsonl", "train.log")
SWEEP_FILES = ("sweep.json", "wall_time_s", "attempts.json")
ATTEMPTS = "attempts.json"


def finished_runs(sweep_dir: Path) -> list[Path]:
    """The run dirs under ``sweep_dir`` whose summary.json is complete, sorted by name."""
    return sorted(p.parent for p in sweep_dir.glob("*/summary.json") if finished_summary(p.parent))


def pack(sweep_dir: Path, archive: Path) -> int:
    """Write ``archive`` (a .tar.gz) from the sweep's files and its finished runs; returns how
    many runs it holds. Written beside and renamed into place: a reader never sees half."""
    top = sweep_dir.name
    members = [(f"{top}/{name}", sweep_dir / name) for name in SWEEP_FILES]
    runs = finished_runs(sweep_dir)
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
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(buffer.getvalue())
    os.replace(tmp, archive)
    return len(runs)


def read_record(archive: Path) -> tuple[str, dict[str, Any]]:
    """The archive's sweep dir name and its sweep.json."""
    try:
        with tarfile.open(archive) as tar:
            tops = {Path(m.name).parts[0] for m in tar.getmembers()}
            if len(tops) != 1:
                raise UserError(
                    f"{archive} holds {len(tops)} folders at its top, not one sweep dir"
                )
            (top,) = tops
            record = tar.extractfile(f"{top}/sweep.json")
            return top, json.loads(record.read())
    except (tarfile.TarError, KeyError, OSError, ValueError) as e:
        raise UserError(
            f"{archive} is not a sweep's archive ({e}); pass a runs.tar.gz that "
            "scripts/sweep.py --archive wrote, or a sweep dir"
        ) from None


def unpack(archive: Path, parent: Path) -> Path:
    """Lay ``archive`` out as ``parent/<its sweep dir>`` and return that dir. Files already
    there are kept (a run finished here and not yet packed stays), the rest are added."""
    top, _ = read_record(archive)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.isfile() and not (parent / member.name).exists():
                tar.extract(member, parent, filter="data")
    return parent / top


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
    tmp = sweep_dir / (ATTEMPTS + ".tmp")
    tmp.write_text(json.dumps(attempts, indent=1) + "\n")
    os.replace(tmp, sweep_dir / ATTEMPTS)
