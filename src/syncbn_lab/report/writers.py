"""The one table of report writers: a study's experiment names its writer
(``sweep.report.writer``), and ``scripts/report.py`` renders every study through it.

Each writer takes the study's :class:`~.source.Source` (its runs, its declaration, how they
ran) and a folder, writes the report's files there and returns their names; a NOTES.md kept
in that folder is linked at the end of every README.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from syncbn_lab.disk import make_folder
from syncbn_lab.errors import UserError
from syncbn_lab.report import calibration, comparisons, fast, nbs, penalty, write
from syncbn_lab.report.cells import Cells
from syncbn_lab.report.source import Source

Writer = Callable[[Source, Path], list[str]]


def by_cells(markdown: Callable[[Source, Cells], str]) -> Writer:
    """A writer of README.md, ``markdown`` of the study's cells, and results.csv by cell."""

    def writer(source: Source, out_dir: Path) -> list[str]:
        cells = source.cells()
        (out_dir / "README.md").write_text(markdown(source, cells))
        return ["README.md", *source.write_results(out_dir, cells)]

    return writer


NOTES = "NOTES.md"
"""Hand-written observations kept next to a report (not regenerated); linked when present."""

WRITERS: dict[str, Writer] = {
    "variants": write.write,  # variants x per-device batch: bn_vs_syncbn and its kin
    "normalization_batch": nbs.write,  # the U in the normalisation batch, SyncBN groups
    "calibration": by_cells(calibration.markdown),  # test error against length: the plateau
    "arms": by_cells(fast.markdown),  # the same cells in two configurations, Holm over them
    "cells": by_cells(comparisons.markdown),  # the declared cells and comparisons alone
    "penalty": penalty.write,  # a penalty across the configurations of several studies
}


def render(source: Source, out_dir: Path) -> list[str]:
    """The report of ``source`` into ``out_dir`` by the writer its experiment names; the
    files written."""
    writer = WRITERS.get(source.spec.writer)
    if writer is None:
        raise UserError(
            f"experiment={source.spec.experiment} names sweep.report.writer="
            f"{source.spec.writer}; choose one of {', '.join(WRITERS)}"
        )
    created = not out_dir.exists()
    make_folder(out_dir, "pass --out a folder that can be written")
    try:
        written = writer(source, out_dir)
    except Exception:
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a report refused before anything is written leaves nothing
        raise
    if (out_dir / NOTES).exists():
        with open(out_dir / "README.md", "a") as readme:
            readme.write(
                f"\nHow the study was designed and more observations, by hand: "
                f"[{NOTES}]({NOTES}).\n"
            )
    return written
