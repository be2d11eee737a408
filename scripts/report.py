"""Write the report of a sweep: `python scripts/report.py SWEEP_DIR [SWEEP_DIR ...]`.

Reads every finished run (summary.json, metrics.jsonl) under the sweep dirs and writes
results.csv, README.md and PNG plots (test error against the per-device batch and against
the normalisation batch, training-loss and validation curves) into --out (default
reports/bn_vs_syncbn). --compare-with sets the claims beside those of an earlier study's
committed results.csv (the converged study against reports/bn_vs_syncbn_1epoch/).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from syncbn_lab.cli import exit_on_user_error
from syncbn_lab.report import write_sweep_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("reports/bn_vs_syncbn"))
    parser.add_argument("--title", default="BatchNorm vs SyncBatchNorm across device counts")
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
    with exit_on_user_error():
        runs, failures = write_sweep_report(
            args.sweep_dirs, args.out, args.title, args.wall_time_s, args.compare_with
        )
    missing = f" ({len(failures)} failed, marked missing)" if failures else ""
    print(f"{len(runs)} runs{missing} -> {args.out}/README.md, results.csv, *.png")


if __name__ == "__main__":
    main()
