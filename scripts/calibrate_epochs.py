"""Calibrate a study's length: bn's test error after 1, 2, 4, ... epochs, at two device counts,
by seed; writes reports/calibration_epochs/ (README.md, results.csv) for the 64-image study
(64 and 2 images per device), reports/calibration_<experiment>/ for another --experiment.

Runs one Hydra multirun of ``experiment=<--experiment>`` (the study's model, data and
configuration, two jobs at a time) over the lengths, device counts and seeds, into --sweep-dir;
runs that finished there before are kept (``skip_finished``), so the same command finishes
an interrupted calibration. --report-only writes the report from the sweep dirs as they are
(several: lengths added later in a sweep dir of their own); --with-csv adds the runs of an
earlier calibration's results.csv (whose run dirs are gone).

    python scripts/calibrate_epochs.py [--epochs 1 2 4 8] [--seeds 0 1] [--devices 1 32]
    python scripts/calibrate_epochs.py --epochs 16 --sweep-dir multirun/calibration_epochs/16ep \
        --with-csv reports/calibration_epochs/results.csv
    python scripts/calibrate_epochs.py --experiment nbs_256 --devices 1 128 --epochs 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import csv
import shlex
import subprocess
import sys
import time
from pathlib import Path

from syncbn_lab.cli import exit_on_user_error
from syncbn_lab.errors import UserError
from syncbn_lab.provenance import provenance
from syncbn_lab.report.calibration import COLUMNS, render
from syncbn_lab.report.collect import collect_runs, runs_from_csv
from syncbn_lab.report.fast import study_noise_floor

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="bn_vs_syncbn", help="the study to calibrate")
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--sweep-dir",
        type=Path,
        nargs="+",
        default=None,
        help="where the runs go (the first) and are read from (all); default "
        "multirun/<the report's name>/latest",
    )
    parser.add_argument("--report", type=Path, default=None, help="default: see above")
    parser.add_argument("--report-only", action="store_true", help="do not train; report")
    parser.add_argument(
        "--with-csv", type=Path, nargs="*", default=[], help="earlier results.csv to include"
    )
    parser.add_argument("--note", default=None, help="a sentence the report adds on the runs")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="Hydra overrides for every run (e.g. trainer.precision=bf16 to pin what an "
        "earlier calibration's runs resolved)",
    )
    args = parser.parse_args()
    name = (
        "calibration_epochs"
        if args.experiment == "bn_vs_syncbn"
        else f"calibration_{args.experiment}"
    )
    args.report = args.report or ROOT / "reports" / name
    args.sweep_dir = args.sweep_dir or [ROOT / "multirun" / name / "latest"]
    started = time.monotonic()
    if not args.report_only:
        join = lambda values: ",".join(map(str, values))  # noqa: E731
        subprocess.run(
            [sys.executable, str(ROOT / "scripts/train.py"), "-m", f"experiment={args.experiment}",
             "bn=bn", f"parallel.devices={join(args.devices)}", f"trainer.seed={join(args.seeds)}",
             f"trainer.epochs={join(sorted(args.epochs, reverse=True))}", "logger=none",
             "skip_finished=true", f"hydra.sweep.dir={args.sweep_dir[0]}", *args.set],
            check=True,
        )  # fmt: skip
    try:
        runs = [run.summary for run in collect_runs(*args.sweep_dir)]
    except UserError:
        if not args.with_csv:  # else a report from earlier calibrations' CSVs alone
            raise
        runs = []
    swept = {(r["devices"], r["epochs"], r["seed"]) for r in runs}  # a swept run wins
    runs += [run.summary for csv_file in args.with_csv for run in runs_from_csv(csv_file)
             if (run["devices"], run["epochs"], run["seed"]) not in swept]  # fmt: skip
    args.report.mkdir(parents=True, exist_ok=True)
    with open(args.report / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for run in sorted(runs, key=lambda r: (r["devices"], r["epochs"], r["seed"])):
            writer.writerow(run)
    machine = provenance()["machine"]
    commits = sorted({r.get("git_commit") or "?" for r in runs})
    floor = study_noise_floor(ROOT / "reports/bn_vs_syncbn_1epoch/results.csv")["test_error"]
    training = sum(r["train_time_s"] for r in runs)
    text = render(
        runs,
        floor,
        {
            "command": shlex.join(["python", "scripts/calibrate_epochs.py", *sys.argv[1:]]),
            "commit": ", ".join(commits),
            "machine": f"{machine['cpu']} ({machine['cores']} cores)",
            "wall": f"{training / 60:.0f} min of training time in all, two runs at a time",
        },
        experiment=args.experiment,
        global_batch=runs[0]["per_device_batch_size"] * runs[0]["devices"],
    )
    if args.note:
        text += f"\n{args.note}\n"
    (args.report / "README.md").write_text(text)
    print(text)
    print(f"-> {args.report}/README.md, results.csv ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    with exit_on_user_error():
        main()
