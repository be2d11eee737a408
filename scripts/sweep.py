"""Run a study's sweep (or its smoke version) and write its report.

    python scripts/sweep.py                       # the Fashion-MNIST study (`make sweep`)
    python scripts/sweep.py --experiment bn_vs_syncbn_mnist   # the MNIST study
    python scripts/sweep.py --parallel ddp        # the grid with real DDP (GPUs or gloo)
    python scripts/sweep.py --smoke               # tiny: synthetic data, few steps
    python scripts/sweep.py --launcher slurm ...  # one SLURM job per run (submitit)
    python scripts/sweep.py --resume SWEEP_DIR    # finish an interrupted or failed sweep

A study is a few Hydra multiruns into one sweep dir (PARTS): the experiment's own grid
(bn, sync x devices x seeds), then the parts that need other grids: Batch Renormalization
at the small per-device batches, GroupNorm once per seed (it does not depend on the device
count), and real gloo DDP runs one at a time (the cost table and the spot check against
their emulated twins). A run that fails does not stop the others: it leaves
<run dir>/error.json with its one-line reason and the report shows its cell as missing with
that reason. --resume runs the same sweep again in its dir (the settings recorded in
<sweep dir>/sweep.json): runs whose summary.json is complete are skipped, the rest run
afresh. The wall time of all attempts is written to <sweep dir>/wall_time_s and stated in
the report.

While it works the sweep prints one line per finished run: k of N, the run's cell, its test
error or why it has none (failed, diverged), its time and the sweep's estimated time left.
The jobs' own output (Hydra's launch lines, epoch lines) goes to <sweep dir>/sweep.log, and
each run's to its own train.log; --verbose prints the jobs' output on the terminal instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from syncbn_lab.errors import one_line
from syncbn_lab.logging import log_report
from syncbn_lab.logging.console import display_path
from syncbn_lab.multirun import SweepProgress, job_count, multirun_config

ROOT = Path(__file__).resolve().parent.parent
SMOKE = [
    "data=synthetic",
    "data.num_train=512",
    "data.num_val=64",
    "data.num_test=64",
    "model.width=4",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.precise_bn_batches=2",
    "parallel.devices=1,4",
    "trainer.seed=0",
    "logger=none",
]
LAUNCHERS = {"joblib": "hydra/launcher=joblib", "slurm": "hydra/launcher=submitit_slurm"}
RECORD = "sweep.json"  # what --resume reads: the settings the sweep was started with

# Real DDP runs, one at a time (each rank takes a core), seed 0.
DDP = ["parallel=ddp", "trainer.seed=0"]
# experiment -> its multiruns in order, each a list of overrides on top of the experiment's
# grid ([] = the grid itself). Parts whose name starts with "ddp" are left out when the
# whole grid already runs under --parallel ddp.
PARTS = {
    "bn_vs_syncbn": {
        "grid": [],
        "brn": ["bn=brn", "parallel.devices=8,16,32,64"],  # 8 ... 1 images per device
        "gn": ["bn=gn", "parallel.devices=1"],
        "ddp": [*DDP, "bn=bn,sync", "parallel.devices=2,4"],  # the spot check, and cost
        "ddp_cost": [*DDP, "bn=brn,gn", "parallel.devices=2"],  # cost of the other variants
    },
    "bn_vs_syncbn_mnist": {"grid": [], "gn": ["bn=gn", "parallel.devices=1"]},
}
SMOKE_PARTS = {
    "grid": [],
    "brn": ["bn=brn", "parallel.devices=4"],
    "gn": ["bn=gn", "parallel.devices=1"],
    "ddp": [*DDP, "bn=sync", "parallel.devices=2"],
}


def merge(defaults: list[str], overrides: list[str]) -> list[str]:
    """``defaults`` with every key that ``overrides`` sets replaced by its value there."""
    given = {o.split("=", 1)[0] for o in overrides}
    return [d for d in defaults if d.split("=", 1)[0] not in given] + overrides


LOG = "sweep.log"  # the jobs' own output, all attempts appended
POLL_S = 1.0  # how often the sweep dir is read for finished runs


def multirun_overrides(sweep_dir: Path, experiment: str, overrides: list[str]) -> list[str]:
    """The arguments of one Hydra multirun of the sweep, after ``train.py -m``."""
    return [
        f"experiment={experiment}",
        f"hydra.sweep.dir={sweep_dir}",
        "skip_finished=true",  # a run already finished in this sweep dir is not run again
        *overrides,
    ]


def multirun(arguments: list[str], progress: SweepProgress, log: Path, verbose: bool) -> int:
    """One Hydra multirun; prints a line per run as it finishes. The jobs' output goes to
    ``log``, or to the terminal when ``verbose``. Returns its exit status (1: some jobs
    failed)."""
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "-m", *arguments]
    with open(log, "a") as out:
        out.write("+ " + " ".join(command[1:]) + "\n")
        out.flush()
        if verbose:
            print("+", " ".join(command[1:]), flush=True)
            job = subprocess.Popen(command, cwd=ROOT)
        else:
            job = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        while True:
            finished = job.poll() is not None  # read the runs once more after the end
            for line in progress.poll():
                print(line, flush=True)
            if finished:
                return job.returncode
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(POLL_S)


def log_report_to_wandb(arguments: list[str], report_dir: Path, sweep_dir: Path, name: str):
    """The report as one W&B run in the sweep's group, where the runs logged to W&B (the
    logger config of the sweep's runs: offline by default)."""
    logger = multirun_config(arguments).logger
    if logger.name != "wandb":
        return
    group = logger.group or name
    try:
        lines = log_report(report_dir, logger, group, sweep_dir)
    except Exception as e:  # the report is written; W&B is a copy of it
        print(f"warning: the report was not logged to W&B ({one_line(e)})", file=sys.stderr)
        return
    print(f"W&B: the report is run 'report' of group {group}, {lines[0]}", flush=True)
    if (os.environ.get("WANDB_MODE") or logger.mode) == "offline":
        runs = f"{display_path(sweep_dir)}/*/wandb/offline-run-*"
        report = f"{display_path(sweep_dir)}/wandb/offline-run-*"
        print(f"W&B: upload the runs and the report: wandb sync {runs} {report}", flush=True)


def settings(args: argparse.Namespace) -> tuple[Path, dict]:
    """The sweep dir and its settings: new ones, or those recorded for --resume."""
    if args.resume is not None:
        record = args.resume / RECORD
        if not record.exists():
            sys.exit(
                f"error: {args.resume} holds no {RECORD}; pass a sweep dir scripts/sweep.py wrote"
            )
        given = (args.smoke, args.parallel, args.launcher, args.overrides, args.sweep_dir)
        if any(given) or args.experiment:
            sys.exit(
                "error: --resume runs the sweep with the settings it was started with; pass "
                "no --experiment, --smoke, --parallel, --launcher, --sweep-dir or overrides "
                "with it"
            )
        return args.resume, json.loads(record.read_text())
    experiment = args.experiment or "bn_vs_syncbn"
    if experiment not in PARTS:
        sys.exit(f"error: --experiment {experiment} is unknown; choose one of {', '.join(PARTS)}")
    launcher = args.launcher or "joblib"
    if launcher not in LAUNCHERS:
        sys.exit(f"error: --launcher {launcher} is unknown; choose joblib or slurm")
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    name = f"{experiment}_smoke" if args.smoke else experiment
    sweep_dir = args.sweep_dir or ROOT / "multirun" / name / stamp
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        sys.exit(
            f"error: {sweep_dir} already holds a sweep; pass a new --sweep-dir, or "
            f"--resume {sweep_dir} to finish it"
        )
    parallel = args.parallel or "emulated"
    base = [f"parallel={parallel}", LAUNCHERS[launcher]]
    if launcher == "joblib":
        base.append("hydra.launcher.n_jobs=2")  # one job per core of a 2-core machine
    base = merge([*base, *(SMOKE if args.smoke else [])], args.overrides)
    if not args.smoke and not any(o.startswith(("logger=", "logger.group=")) for o in base):
        base.append(f"logger.group={name}-{stamp}")  # one W&B group per sweep
    parts = []
    for part, overrides in (SMOKE_PARTS if args.smoke else PARTS[experiment]).items():
        if part.startswith("ddp"):
            if parallel == "ddp":
                continue  # the grid is real DDP already
            if launcher == "joblib":
                overrides = [*overrides, "hydra.launcher.n_jobs=1"]  # the ranks take the cores
        parts.append({"part": part, "overrides": merge(base, overrides)})
    return sweep_dir, {"name": name, "experiment": experiment, "parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default=None, help=f"one of {', '.join(PARTS)}")
    parser.add_argument("--smoke", action="store_true", help="tiny version for a quick check")
    parser.add_argument("--parallel", default=None, help="emulated (default) or ddp")
    parser.add_argument("--launcher", default=None, help="joblib (default, local) or slurm")
    parser.add_argument("--sweep-dir", type=Path, default=None)
    parser.add_argument("--resume", type=Path, default=None, metavar="SWEEP_DIR")
    parser.add_argument("--report-dir", type=Path, default=None)
    parser.add_argument(
        "--verbose", action="store_true", help="print the jobs' own output (epoch lines) too"
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    sweep_dir, record = settings(args)
    report_dir = args.report_dir or ROOT / "reports" / record["name"]
    runs = [
        multirun_overrides(sweep_dir, record["experiment"], part["overrides"])
        for part in record["parts"]
    ]
    try:
        total = sum(job_count(arguments) for arguments in runs)
    except Exception as e:  # a bad override: Hydra's message as one line, nothing written
        sys.exit(f"error: {' '.join(str(e).split())}")
    if args.resume is None:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / RECORD).write_text(json.dumps(record, indent=1) + "\n")

    wall_file = sweep_dir / "wall_time_s"
    earlier = float(wall_file.read_text()) if wall_file.exists() else 0.0
    start = time.perf_counter()
    progress = SweepProgress(sweep_dir, total)
    log = sweep_dir / LOG
    print(
        f"sweep of {progress.total} runs -> {display_path(sweep_dir)}; the jobs' output: "
        f"{display_path(log)}, each run's train.log",
        flush=True,
    )
    if progress.done:
        print(f"resumed: {progress.done} of {progress.total} runs finished before", flush=True)
    statuses = [multirun(arguments, progress, log, args.verbose) for arguments in runs]
    wall = earlier + time.perf_counter() - start
    wall_file.write_text(f"{wall:.1f}\n")
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
    if any(statuses) or report.returncode:
        sys.exit(
            f"error: some runs failed (listed above; the report marks them missing); "
            f"python scripts/sweep.py --resume {sweep_dir} runs them again"
        )


if __name__ == "__main__":
    main()
