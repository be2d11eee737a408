"""A study's runs as the report tests plant them, with the study's declaration as its
experiment has it: a :class:`~syncbn_lab.report.source.Source` to hand to a writer."""

from dataclasses import replace

from syncbn_lab.report import Source, render, spec_of


def source(experiment, runs, failures=(), wall_time_s=None, **declared) -> Source:
    """``runs`` as a study of ``experiment`` (``declared``: sweep.report keys replaced)."""
    spec = replace(spec_of(experiment), **declared)
    command = "python scripts/report.py test"
    return Source(spec, runs, command, list(failures), wall_time_s=wall_time_s)


def write_report(runs, out_dir, title="Test report", wall_time_s=None, failures=()):
    """The variants report of ``runs`` (experiment=bn_vs_syncbn's declaration, no earlier
    study beside it) into ``out_dir``."""
    study = source("bn_vs_syncbn", runs, failures, wall_time_s, title=title, compare_with=None)
    return render(study, out_dir)
