"""Reports of a study: results.csv, README.md with tables and a reading, and PNG plots,
through one table of writers (:mod:`~.writers`) from the runs of its sweep (:mod:`~.source`)
as its experiment declares the report (:mod:`~.spec`)."""

from syncbn_lab.report.collect import Failure, Run, collect_failures, collect_runs
from syncbn_lab.report.source import Source, load
from syncbn_lab.report.spec import spec_of
from syncbn_lab.report.writers import WRITERS, render

__all__ = [
    "WRITERS",
    "Failure",
    "Run",
    "Source",
    "collect_failures",
    "collect_runs",
    "load",
    "render",
    "spec_of",
]
