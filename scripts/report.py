"""Write the report of a sweep: `python scripts/report.py SWEEP_DIR [SWEEP_DIR ...]`.

Reads every finished run (summary.json, metrics.jsonl) under the sweep dirs and writes
results.csv, README.md and PNG plots (test error against the per-device batch and against
the normalisation batch, training-loss and validation curves) into --out (default
reports/bn_vs_syncbn). --compare-with sets the claims beside those of an earlier study's
committed results.csv (the converged study against reports/bn_vs_syncbn_1epoch/).

A sweep whose experiment sets ``sweep.report: normalization_batch`` (nbs_256) gets that
study's report instead (syncbn_lab.report.nbs): test error against the normalisation batch,
SyncBN groups against BN at the same normalisation batch, with its unfinished cells marked.
SWEEP_DIR may also be a runs.tar.gz that ``scripts/sweep.py --archive`` wrote: the report
reads exactly its runs, from a temporary copy (nothing is written under multirun/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from syncbn_lab import archive
from syncbn_lab.cli import exit_on_user_error
from syncbn_lab.report import write_sweep_report
from syncbn_lab.report.fast import study_noise_floor
from syncbn_lab.report.nbs import write_nbs_report

ROOT = Path(__file__).resolve().parent.parent
TITLE = "BatchNorm vs SyncBatchNorm across device counts"
NBS_TITLE = "The normalisation batch: per-device BN and SyncBN groups at a fixed global batch"


def laid_out(path: Path, scratch: Path) -> Path:
    """A sweep dir: ``path`` itself, or the archive ``path`` unpacked into ``scratch`` (a
    fresh directory), so that its report holds the archive's runs and no others."""
    return archive.unpack(path, scratch) if path.is_file() else path


def report_kind(sweep_dir: Path) -> str:
    """``sweep.report`` of the experiment the sweep ran (sweep.json), else ``study``."""
    record = sweep_dir / "sweep.json"
    if not record.exists():
        return "study"
    from syncbn_lab.config import compose

    experiment = json.loads(record.read_text())["experiment"]
    return compose([f"experiment={experiment}"]).sweep.report


def study_floor() -> float:
    """The float32 noise of one run's test error, from the converged study's SyncBN runs
    (same model at different device counts): the study with its own noise floor."""
    return study_noise_floor(ROOT / "reports" / "bn_vs_syncbn" / "results.csv")["test_error"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("reports/bn_vs_syncbn"))
    parser.add_argument("--title", default=None, help="the README's heading")
    parser.add_argument(
        "--wall-time-s",
        type=float,
        default=None,
        help="wall time of the sweep, to state in the report",
    )
    parser.add_argument(
        "--compare-with",
        type=Path,
        default=None,
        metavar="RESULTS_CSV",
        help="an earlier study's results.csv whose claims the report sets beside these",
    )
    args = parser.parse_args()
    with exit_on_user_error(), tempfile.TemporaryDirectory(prefix="report-") as scratch:
        args.sweep_dirs = [
            laid_out(d, Path(scratch) / str(i)) for i, d in enumerate(args.sweep_dirs)
        ]
        recorded = args.sweep_dirs[0] / "wall_time_s"  # what the sweep wrote, all attempts
        if args.wall_time_s is None and len(args.sweep_dirs) == 1 and recorded.exists():
            args.wall_time_s = float(recorded.read_text())
        if report_kind(args.sweep_dirs[0]) == "normalization_batch":
            runs = write_nbs_report(
                args.sweep_dirs[0], args.out, args.title or NBS_TITLE, args.wall_time_s,
                study_floor(),
                shlex.join(["python", "scripts/report.py", *sys.argv[1:]]),
            )  # fmt: skip
            print(f"{len(runs)} runs -> {args.out}/README.md, results.csv")
            return
        runs, failures = write_sweep_report(
            args.sweep_dirs, args.out, args.title or TITLE, args.wall_time_s, args.compare_with
        )
    missing = f" ({len(failures)} failed, marked missing)" if failures else ""
    print(f"{len(runs)} runs{missing} -> {args.out}/README.md, results.csv, *.png")


if __name__ == "__main__":
    main()
