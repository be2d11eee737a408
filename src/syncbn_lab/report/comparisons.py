"""The report of a study that is its declared cells and comparisons alone (``writer: cells``),
and the two tables every cell-based report shows: each cell's figures over seeds, and each
declared comparison paired by seed, read against the float32 noise.

A study whose questions are only "how does this cell compare with that one" declares its
cells and comparisons in its experiment and needs no module of its own; one with an analysis
of its own (a fit, a trend over cells) adds its sections to these in one small module.
"""

from __future__ import annotations

from collections.abc import Callable

from syncbn_lab.report import header
from syncbn_lab.report.cells import Cell, Cells
from syncbn_lab.report.collect import Run, train_loss
from syncbn_lab.report.source import Source
from syncbn_lab.report.stats import difference_noise
from syncbn_lab.report.text import fmt_interval, fmt_p, fmt_paired, over_seeds, table_head
from syncbn_lab.report.text import table_row as row
from syncbn_lab.report.verdicts import against_noise

FIGURES: tuple[tuple[str, Callable[[Run], float], int], ...] = (
    ("test error, EMA", lambda r: r.test_error, 2),
    ("PreciseBN", lambda r: r.test_error_precise_bn, 2),
    ("test-batch statistics", lambda r: r.test_error_batch_stats, 2),
    ("final training loss", lambda r: r["train_loss"], 4),
)
"""A cell's figures, mean ± std over seeds: test error (%) with the running statistics, with
PreciseBN statistics and with test batches' own statistics, and the last epoch's loss."""


def cell_table(
    cells: Cells, rows: list[Cell], naming: list[tuple[str, Callable[[Cell], object]]]
) -> list[str]:
    """What the table shows, then one row per cell of ``rows``: its ``naming`` columns, the
    seeds finished of those declared, and :data:`FIGURES`."""
    lines = [
        "Test error (%) with the running statistics (EMA), with PreciseBN statistics and with "
        "the statistics of test batches of the training normalisation batch; the last "
        "epoch's training loss; mean ± std over the seeds finished (n of those declared).",
        "",
        *table_head(*(name for name, _ in naming), "n", *(name for name, _, _ in FIGURES)),
    ]
    for cell in rows:
        runs = cells.by_cell.get(cell, [])
        lines.append(row(
            *(name(cell) for _, name in naming), f"{len(runs)}/{len(cells.declared[cell])}",
            *(over_seeds([value(r) for r in runs], digits) for _, value, digits in FIGURES),
        ))  # fmt: skip
    return lines


def comparison_table(cells: Cells, name: str, noise: float, label=str) -> list[str]:
    """Each pair of the declared comparison ``name``: Δ test error paired by seed with its
    95 % interval, p and reading against ``noise``; the final training loss of the cell it
    is measured against, and Δ of it."""
    lines = table_head("cell", "against", "Δ test error (pp)", "95 % interval", "p", "reading",
                       "final training loss of against", "Δ final training loss", "p")  # fmt: skip
    for cell, other in cells.pairs(name):
        d, loss = cells.against(cell, other), cells.against(cell, other, train_loss)
        lines.append(row(
            label(cell), label(other), fmt_paired(d), fmt_interval(d), fmt_p(d.p),
            against_noise(d, noise), over_seeds(cells.seeds(other, train_loss).values(), 4),
            fmt_paired(loss, 4), fmt_p(loss.p),
        ))  # fmt: skip
    return lines


def markdown(source: Source, cells: Cells) -> str:
    """The report: the header, every cell, every declared comparison."""
    noise = difference_noise(source.noise["test_error"].std)
    declared = sum(len(s) for s in cells.declared.values())
    lines = [
        f"# {source.spec.title}",
        "",
        f"{header.setting(source)} Each cell is one configuration over seeds; every comparison "
        f"is paired by seed, and {header.noise(source)}.",
        "",
        header.provenance(source, declared),
        "",
        "## The cells",
        "",
        *cell_table(cells, list(cells.declared), [(k, lambda c, k=k: c[k]) for k in cells.keys]),
    ]
    for name in source.spec.comparisons:
        lines += ["", f"## {name}", "", *comparison_table(cells, name, noise)]
    return "\n".join(lines) + "\n"
