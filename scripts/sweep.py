"""Run a study's sweep (or its smoke version) and write its report.

    python scripts/sweep.py                       # the Fashion-MNIST study (`make sweep`)
    python scripts/sweep.py --experiment bn_vs_syncbn_mnist   # the MNIST study
    python scripts/sweep.py --parallel ddp        # the grid with real DDP (GPUs or gloo)
    python scripts/sweep.py --smoke               # tiny: synthetic data, few steps
    python scripts/sweep.py --launcher slurm ...  # one SLURM job per run (submitit)
    python scripts/sweep.py --resume SWEEP_DIR    # finish an interrupted or failed sweep
    python scripts/sweep.py --experiment nbs_256 --archive reports/nbs_256/runs.tar.gz
    python scripts/sweep.py --resume reports/nbs_256/runs.tar.gz   # on any machine
    (an archive is laid out under multirun/<study>/, or under --sweep-dir where given)
    python scripts/sweep.py --experiment calibration_epochs   # how long bn_vs_syncbn trains
    python scripts/sweep.py --experiment fast_vs_fp32   # the fast configuration's check

A study is a few Hydra multiruns into one sweep dir, as its experiment declares them
(configs/experiment/<name>.yaml): its own grid (bn, sync x devices x seeds), then its
``sweep.parts``, e.g. Batch Renormalization at the small per-device batches, GroupNorm once
per seed (it does not depend on the device count), and real gloo DDP runs one at a time (the
cost table and the spot check against their emulated twins); syncbn_lab.sweep runs them.
Then scripts/report.py writes the report into reports/<study>/ (--report-dir), as the
experiment declares it (``sweep.report``: its writer, cells and comparisons).
A run that fails does not stop the others: it leaves <run dir>/error.json with its one-line
reason and the report shows its cell as missing with that reason. --resume runs the same
sweep again in its dir (the settings recorded in <sweep dir>/sweep.json, trainer.precision
among them: ``auto`` is resolved once, when the sweep starts, and pinned): runs whose
summary.json is complete are skipped, the rest run afresh. The wall time of all attempts is
written to <sweep dir>/wall_time_s and stated in the report; attempts.json records each
attempt (when, on which CPU, how long, how many runs it finished).

A study that outlasts its machine: --archive packs the finished runs into one .tar.gz each time
a run finishes (syncbn_lab.archive), to commit as they land; --resume <that archive> lays it
out under multirun/<study>/ on a fresh checkout and runs the rest, packing into the same
archive. Runs cut off when the machine goes away are not in it and run again.

One sweep at a time works on a sweep dir and on an archive: it holds <sweep dir>.lock and
<archive>.lock (host, pid, command) while it runs; a second is refused with one line naming
the first, and a lock whose process is gone (same host) is taken over. An archive cut short
or corrupted is one line (how many runs can be read, how to restore it); --rerun-unreadable
resumes from the runs it can read and runs the others again, and no pack replaces an archive
with fewer runs than the resume read from it. --report-dir is recorded in sweep.json: a
resume writes the report there too. A full disk is one line naming the file and the space
left; the archive and the runs that finished stay as they were.

While it works the sweep prints one line per finished run: k of N, the run's cell, its test
error or why it has none (failed, diverged), its time and the sweep's estimated time left.
The jobs' own output (Hydra's launch lines, epoch lines) goes to <sweep dir>/sweep.log, and
each run's to its own train.log; --verbose prints the jobs' output on the terminal instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from syncbn_lab import archive
from syncbn_lab.cli import exit_on_user_error
from syncbn_lab.disk import write_atomic, writing
from syncbn_lab.errors import OneLineError, UserError, one_line, say
from syncbn_lab.logging.console import display_path
from syncbn_lab.multirun import SweepProgress, check_jobs, jobs, varied_keys
from syncbn_lab.provenance import cpu_isa, cpu_model
from syncbn_lab.sweep import (
    LOG,
    locked,
    log_report_to_wandb,
    multirun,
    multirun_overrides,
    pin_precision,
    plan,
)

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "train.py"
RECORD = "sweep.json"  # what --resume reads: the settings the sweep was started with


def settings(args: argparse.Namespace, locks: contextlib.ExitStack) -> tuple[Path, dict, int]:
    """The sweep dir, its settings (new ones, or those recorded for --resume) and how many
    finished runs the archive it resumes from holds (0: none); the sweep dir and the archive
    are locked for this process (``locks``) before anything is written into them."""
    if args.resume is not None:
        packed_into, at_least = None, 0
        if args.resume.is_file():  # an archive: lay it out as a sweep dir, then resume that
            locks.enter_context(locked(args.resume, "the archive"))
            contents = archive.read(args.resume)
            if contents.damage is not None:
                line, n = archive.damaged_line(args.resume, contents), len(contents.runs)
                if not args.rerun_unreadable:
                    raise UserError(
                        f"{line}; or pass --rerun-unreadable to resume from those {n} runs "
                        "(the others run again)"
                    )
                print(f"note: {line}; --rerun-unreadable: the others run again", flush=True)
            parent = args.sweep_dir or ROOT / "multirun" / contents.record["name"]
            locks.enter_context(locked(parent / contents.top, "the sweep dir"))
            packed_into = _from_root(args.resume)  # and pack into it again
            args.resume = archive.unpack(args.resume, parent, damaged_ok=True)
            args.sweep_dir, at_least = None, len(contents.runs)
        else:
            locks.enter_context(locked(args.resume, "the sweep dir"))
        record = args.resume / RECORD
        if not record.exists():
            sys.exit(
                f"error: {args.resume} holds no {RECORD}; pass a sweep dir scripts/sweep.py wrote"
            )
        given = (args.smoke, args.parallel, args.launcher, args.overrides, args.sweep_dir)
        if any(given) or args.experiment or args.archive:
            sys.exit(
                "error: --resume runs the sweep with the settings it was started with; pass "
                "no --experiment, --smoke, --parallel, --launcher, --sweep-dir, --archive or "
                "overrides with it"
            )
        resumed = json.loads(record.read_text())
        if packed_into is not None:
            resumed["archive"] = packed_into
        elif resumed.get("archive"):
            locks.enter_context(locked(ROOT / resumed["archive"], "the archive"))
        return args.resume, resumed, at_least
    experiment = args.experiment or "bn_vs_syncbn"
    launcher = args.launcher or "joblib"
    parallel = args.parallel or "emulated"
    try:
        parts = pin_precision(
            experiment, plan(experiment, args.smoke, parallel, launcher, args.overrides)
        )
    except UserError as e:
        sys.exit(f"error: {one_line(e)}")
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    name = f"{experiment}_smoke" if args.smoke else experiment
    sweep_dir = args.sweep_dir or ROOT / "multirun" / name / stamp
    locks.enter_context(locked(sweep_dir, "the sweep dir"))
    if args.archive is not None:
        locks.enter_context(locked(args.archive, "the archive"))
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        sys.exit(
            f"error: {sweep_dir} already holds a sweep; pass a new --sweep-dir, or "
            f"--resume {sweep_dir} to finish it"
        )
    if not args.smoke and not any(
        o.startswith(("logger=", "logger.group=")) for part in parts for o in part["overrides"]
    ):
        for part in parts:  # one W&B group per sweep
            part["overrides"].append(f"logger.group={name}-{stamp}")
    # where it started: the pinned precision was chosen for this machine
    record = {"name": name, "experiment": experiment, "parts": parts, "started_on": machine()}
    if args.smoke:
        record["smoke"] = True  # its report sets nothing beside it
    if args.archive is not None:
        record["archive"] = _from_root(args.archive)
    if args.report_dir is not None:  # a resume writes its report there too
        record["report_dir"] = _from_root(args.report_dir)
    return sweep_dir, record, 0


def report_dir_of(args: argparse.Namespace, record: dict) -> Path:
    """Where the report goes: --report-dir, else the one the sweep was started with, else
    reports/<study>."""
    recorded = record.get("report_dir")
    if args.report_dir is not None:
        return args.report_dir
    return ROOT / recorded if recorded else ROOT / "reports" / record["name"]


def _from_root(path: Path) -> str:
    """``path`` relative to the checkout where it lies inside (so a fresh clone finds it)."""
    path = path.resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def machine() -> dict:
    """The CPU this process runs on, as sweep.json records it."""
    return {"cpu": cpu_model(), **cpu_isa()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--experiment", default=None, help="a file of configs/experiment/ (bn_vs_syncbn)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny version for a quick check")
    parser.add_argument("--parallel", default=None, help="emulated (default) or ddp")
    parser.add_argument("--launcher", default=None, help="joblib (default, local) or slurm")
    parser.add_argument("--sweep-dir", type=Path, default=None)
    parser.add_argument(
        "--resume", type=Path, default=None, metavar="SWEEP_DIR|ARCHIVE",
        help="finish a sweep: its dir, or the runs.tar.gz --archive wrote",
    )  # fmt: skip
    parser.add_argument(
        "--archive", type=Path, default=None, metavar="RUNS_TAR_GZ",
        help="pack the finished runs into this file as they finish (to commit)",
    )  # fmt: skip
    parser.add_argument(
        "--rerun-unreadable", action="store_true",
        help="--resume from a damaged archive: its readable runs are kept, the rest run again",
    )  # fmt: skip
    parser.add_argument(
        "--report-dir", type=Path, default=None,
        help="default: the one the sweep was started with, else reports/<study>",
    )  # fmt: skip
    parser.add_argument(
        "--verbose", action="store_true", help="print the jobs' own output (epoch lines) too"
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    with exit_on_user_error(), contextlib.ExitStack() as locks:
        sweep(args, locks)


def sweep(args: argparse.Namespace, locks: contextlib.ExitStack) -> None:
    """The sweep ``args`` ask for, its sweep dir and archive locked in ``locks``."""
    sweep_dir, record, at_least = settings(args, locks)
    report_dir = report_dir_of(args, record)
    runs = [
        multirun_overrides(sweep_dir, record["experiment"], part["overrides"])
        for part in record["parts"]
    ]
    try:
        planned = [job for arguments in runs for job in jobs(arguments)]
    except Exception as e:  # a bad override: Hydra's message as one line, nothing written
        sys.exit(f"error: {' '.join(str(e).split())}")
    print(f"checking the configs of {len(planned)} runs", flush=True)  # 0.15 s a run
    check_jobs(planned)  # a bad value: one line, nothing written
    if args.resume is None:
        with writing(sweep_dir / RECORD):
            sweep_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(sweep_dir / RECORD, json.dumps(record, indent=1) + "\n")

    wall_file = sweep_dir / "wall_time_s"
    earlier = float(wall_file.read_text()) if wall_file.exists() else 0.0
    start = time.perf_counter()
    progress = SweepProgress(sweep_dir, len(planned), varied_keys(planned))
    attempt = archive.start_attempt(sweep_dir, machine())
    packed_into = ROOT / record["archive"] if record.get("archive") else None

    problems: dict[str, None] = {}  # what could not be written, each said once

    def landed() -> None:
        """After runs finish: the time so far, then the archive (the machine may go any time).
        What cannot be written (a full disk) is one line; the sweep goes on, and ends non-zero."""
        ran = time.perf_counter() - start
        try:
            write_atomic(wall_file, f"{earlier + ran:.1f}\n")
            archive.end_of_attempt(sweep_dir, attempt, ran, progress.done - progress.before)
            if packed_into is not None:
                archive.pack(sweep_dir, packed_into, at_least)
        except OneLineError as e:
            if one_line(e) not in problems:
                say(one_line(e))
                problems[one_line(e)] = None

    log = sweep_dir / LOG
    print(
        f"sweep of {progress.total} runs -> {display_path(sweep_dir)}; the jobs' output: "
        f"{display_path(log)}, each run's train.log",
        flush=True,
    )
    if progress.done:
        print(f"resumed: {progress.done} of {progress.total} runs finished before", flush=True)
    statuses = [
        multirun(TRAIN, arguments, progress, log, args.verbose, landed) for arguments in runs
    ]
    landed()
    if problems:
        sys.exit(
            f"error: {list(problems)[-1]}; the sweep's runs are kept in {sweep_dir} (the report "
            f"is not written): python scripts/sweep.py --resume {sweep_dir} continues it"
        )
    wall = float(wall_file.read_text())
    if packed_into is not None:
        print(f"{progress.done} finished runs packed into {display_path(packed_into)}", flush=True)
    print(f"sweep finished in {wall / 60:.1f} min -> {sweep_dir}", flush=True)
    report = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "report.py"),
            str(sweep_dir),
            "--out",
            str(report_dir),
            "--wall-time-s",
            f"{wall:.1f}",
        ],
    )
    if report.returncode == 0:
        log_report_to_wandb(runs[0], report_dir, sweep_dir, record["name"])
    if any(statuses):
        sys.exit(
            f"error: some runs failed (listed above; the report marks them missing); "
            f"python scripts/sweep.py --resume {sweep_dir} runs them again"
        )
    if report.returncode:  # the runs are kept: fix what the report's line names, then report
        sys.exit(
            f"error: every run finished but the report failed (its line above); fix that and "
            f"write it with python scripts/report.py {sweep_dir} --out {report_dir}"
        )


if __name__ == "__main__":
    main()
