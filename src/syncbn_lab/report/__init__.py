"""Reports of a sweep: results.csv, README.md with tables and a reading, and PNG plots."""

from syncbn_lab.report.collect import Failure, Run, collect_failures, collect_runs
from syncbn_lab.report.write import write_report, write_sweep_report

__all__ = [
    "Failure",
    "Run",
    "collect_failures",
    "collect_runs",
    "write_report",
    "write_sweep_report",
]
