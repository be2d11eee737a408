"""Write the report of a study: `python scripts/report.py SOURCE [SOURCE ...] --out DIR`.

SOURCE is a sweep dir that scripts/sweep.py wrote, the runs.tar.gz that ``scripts/sweep.py
--archive`` packs (read from a temporary copy: the report holds exactly its runs, nothing is
written under multirun/), or a committed results.csv (a study whose run dirs are gone: its
README.md is written again from it, the CSV kept as it is). The study's experiment
(configs/experiment/<name>.yaml, ``sweep.report``) decides the report: which writer of
syncbn_lab.report.writers renders it, its title, cells and comparisons, where its noise floor
comes from, and an earlier study to set beside it. The experiment is the one the sweep
recorded (sweep.json), the runs' study, or the results.csv's folder; --experiment names it
where none of these does. --out defaults to reports/<experiment>.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from syncbn_lab.cli import exit_on_user_error
from syncbn_lab.disk import writing
from syncbn_lab.report import load, render

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, metavar="SOURCE")
    parser.add_argument("--out", type=Path, default=None, help="default reports/<experiment>")
    parser.add_argument("--experiment", default=None, help="the study, where not recorded")
    parser.add_argument("--title", default=None, help="the README's heading (else declared)")
    parser.add_argument(
        "--wall-time-s",
        type=float,
        default=None,
        help="wall time of the sweep, to state in the report (else what the sweep recorded)",
    )
    parser.add_argument(
        "--compare-with",
        type=Path,
        default=None,
        metavar="RESULTS_CSV",
        help="an earlier study's results.csv to set beside this one (else declared)",
    )
    args = parser.parse_args()
    command = shlex.join(["python", "scripts/report.py", *sys.argv[1:]])
    with exit_on_user_error(), tempfile.TemporaryDirectory(prefix="report-") as scratch:
        source = load(args.sources, Path(scratch), command, args.experiment, args.wall_time_s)
        if args.title is not None:
            source.spec = replace(source.spec, title=args.title)
        if args.compare_with is not None:
            source.spec = replace(source.spec, compare_with=str(args.compare_with.resolve()))
        out = args.out or ROOT / "reports" / source.spec.experiment
        with writing(out, "free space there, or pass --out on another disk"):
            written = render(source, out)
    missing = f" ({len(source.failures)} failed, marked missing)" if source.failures else ""
    print(f"{len(source.runs)} runs{missing} -> {out}/{', '.join(written)}")


if __name__ == "__main__":
    main()
