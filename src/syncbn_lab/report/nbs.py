"""The normalisation-batch study's report (``sweep.report.writer: normalization_batch``,
e.g. experiment=nbs_256): at a fixed global batch, test error against the number of images
one BatchNorm layer normalises over, and whether the reference variant over groups of devices
(SyncBN) gives what the baseline (per-device BN) gives at the same normalisation batch.

The cells and the two questions' pairs are the experiment's declaration
(``comparisons.whole_batch``: each baseline cell against the whole batch;
``comparisons.same_batch`` and ``same_devices``: each group cell against the baseline at its
normalisation batch and at its device count). What is this study's own is here: the U fit in
the normalisation batch, the regulariser's signature, what more seeds would buy. A claim is
"holds", "does not hold", or "not yet" while the runs it needs are missing; the cells are
what the sweep declared, so a sweep still running renders with its unfinished cells marked.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from syncbn_lab.report import header
from syncbn_lab.report.cells import Cell, Cells
from syncbn_lab.report.collect import steps_to, train_loss
from syncbn_lab.report.comparisons import cell_table
from syncbn_lab.report.convergence import THRESHOLDS, steps_reached
from syncbn_lab.report.papers import mark, papers
from syncbn_lab.report.plots import log2_axis, save, subplots
from syncbn_lab.report.source import Source
from syncbn_lab.report.stats import ALPHA, difference_noise, mean_std
from syncbn_lab.report.text import fmt_p, fmt_paired, sentence, table_head, table_row
from syncbn_lab.report.verdicts import HOLDS, NOT_YET, against_noise, holds, reaches
from syncbn_lab.variants import GROUP, with_role

PHASES = ("validation", "test", "precise_bn", "test_batch_stats", "checkpoints", "logging")
"""summary.json's time_<phase>_s fields: the time a run spends outside its training steps."""
PLOT = "test_error_vs_normalization_batch.png"
BATCH = "normalization_batch_size"


class NormalizationBatchStudy:
    """The study's cells (:class:`~.cells.Cells`) with the float32 noise of a difference of
    two runs and the pairs of its two questions."""

    def __init__(self, cells: Cells, floor: float):
        self.cells, self.floor = cells, floor
        self.noise = difference_noise(floor)
        runs = cells.runs
        self.global_batch = runs[0]["global_batch_size"] if runs else 0
        whole = cells.spec.comparison("whole_batch")
        self.bn = cells.select(whole.cells)  # the baseline's cells, the whole batch among them
        self.whole = next(iter(cells.select(whole.against)), None)
        self.below_whole = cells.pairs("whole_batch")
        same_batch, same_devices = (
            dict(cells.pairs("same_batch")),
            dict(cells.pairs("same_devices")),
        )
        groups = cells.select(cells.spec.comparison("same_batch").cells)
        self.groups = [(c, same_batch.get(c), same_devices.get(c)) for c in groups]

    def label(self, cell: Cell) -> str:
        """A baseline cell by its device count; a group cell by its group and device count."""
        devices, variant = cell["devices"], cell[GROUP]
        baseline = variant in {v.name for v in with_role("baseline")}
        if baseline or cell[BATCH] == self.global_batch:
            return f"{variant}, {devices} device{'s' * (devices > 1)}"
        group = cell[BATCH] * devices // self.global_batch
        return f"{variant} in groups of {group}, {devices} devices"


@dataclass(frozen=True)
class Vertex:
    """The minimum of test error = a_seed + b x + c x^2 (x = log2 normalisation batch)."""

    b: float
    c: float
    c_p: float  # two-sided p of c = 0
    at: float  # the vertex, -b / 2c, in log2 images
    low: float  # its 95 % interval (delta method), in log2 images
    high: float
    df: int
    depth: float  # the fit at the vertex less the fit at the largest x (the whole batch), pp
    depth_half: float  # half the 95 % interval of depth (delta method)


def quadratic_vertex(points: list[tuple[int, float, float]]) -> Vertex | None:
    """Fit error = a_seed + b x + c x^2 to (seed, x, error) with seeds as blocks (one
    intercept each) by least squares; None where the fit has no residual degrees of freedom.
    The vertex's depth is set against the largest x, the whole batch."""
    import numpy as np
    from scipy import stats

    seeds = sorted({s for s, _, _ in points})
    rows = [[float(s == k) for k in seeds] + [x, x * x] for s, x, _ in points]
    design, y = np.array(rows), np.array([e for _, _, e in points])
    df = len(points) - design.shape[1]
    if df < 1 or np.linalg.matrix_rank(design) < design.shape[1]:
        return None
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ coef
    covariance = float(residual @ residual) / df * np.linalg.inv(design.T @ design)
    b, c = coef[-2], coef[-1]
    cov_bc = covariance[-2:, -2:]
    c_p = float(2 * stats.t.sf(abs(c) / math.sqrt(cov_bc[1, 1]), df)) if cov_bc[1, 1] else 0.0
    at = -b / (2 * c)
    gradient = np.array([-1 / (2 * c), b / (2 * c * c)])
    t = stats.t.ppf(0.975, df)
    half = float(t * math.sqrt(max(gradient @ cov_bc @ gradient, 0.0)))
    # depth = f(at) - f(end); the slope of f vanishes at the vertex, so d depth / d(b, c) is
    # (at - end, at^2 - end^2)
    end = max(x for _, x, _ in points)
    depth = b * (at - end) + c * (at * at - end * end)
    gradient = np.array([at - end, at * at - end * end])
    depth_half = float(t * math.sqrt(max(gradient @ cov_bc @ gradient, 0.0)))
    return Vertex(
        float(b), float(c), c_p, float(at), float(at - half), float(at + half), df,
        float(depth), depth_half,
    )  # fmt: skip


def u_shape(study: NormalizationBatchStudy) -> tuple[str, Vertex | None]:
    """Whether a normalisation batch below the global batch beats the whole batch: holds
    when test error is a U in log normalisation batch, i.e. the quadratic's curvature is
    positive (p < ALPHA) and its minimum's 95 % interval lies inside the swept range,
    excluding both ends."""
    cells = study.cells
    if len(study.bn) < 3 or not cells.complete(*study.bn):
        return NOT_YET, None
    points = [(s, math.log2(c[BATCH]), e)
              for c in study.bn for s, e in cells.seeds(c).items()]  # fmt: skip
    vertex = quadratic_vertex(points)
    if vertex is None:
        return NOT_YET, None
    ends = math.log2(study.bn[0][BATCH]), math.log2(
        study.bn[-1][BATCH])  # fmt: skip
    inside = ends[0] < vertex.low and vertex.high < ends[1]
    return holds(vertex.c > 0 and vertex.c_p < ALPHA and inside), vertex


def floor_below_whole(vertex: Vertex) -> str:
    """Whether the U's floor beats the whole batch: resolved when the 95 % interval of the
    fitted minimum less the fit at the whole batch lies below zero, not resolved otherwise
    (a U whose floor the seeds cannot tell from the whole batch's error)."""
    return "resolved" if vertex.depth + vertex.depth_half < 0 else "not resolved"


def mde(std_of_difference: float, n: int, power: float = 0.8) -> float:
    """The smallest mean paired difference a two-sided t-test at ALPHA finds with ``power``
    over ``n`` seeds, for differences of standard deviation ``std_of_difference``."""
    from scipy import stats

    t = stats.t.ppf(1 - ALPHA / 2, n - 1) + stats.t.ppf(power, n - 1)
    return float(t * std_of_difference / math.sqrt(n))


def markdown(source: Source, study: NormalizationBatchStudy) -> str:
    """The study's README.md."""
    s, cells = study, study.cells
    baseline, reference = with_role("baseline")[0].label, with_role("reference")[0].label
    declared = sum(len(v) for v in cells.declared.values())
    by_batch = sorted(cells.declared, key=lambda c: (-c[BATCH], c[GROUP]))
    lines = [
        f"# {source.spec.title}",
        "",
        f"{header.setting(source)} {sentence(baseline)} normalises over the "
        f"images of one device, {reference} in groups over the images of a group of devices. "
        "Each cell is one configuration over seeds; every comparison is paired by seed.",
        "",
        header.provenance(source, declared),
        "",
        "## Test error by normalisation batch",
        "",
        *cell_table(cells, by_batch, [("normalisation batch", lambda c: c[BATCH]),
                                      ("cell", s.label)]),
        "",
        f"![test error against the normalisation batch]({PLOT})",
    ]  # fmt: skip
    lines += _u_section(s, source) + _groups_section(s, reference) + _speed_section(s, by_batch)
    lines += _seeds_section(s) + _anchors_section() + _cost_section(cells.runs)
    return "\n".join(lines) + "\n"


def _u_section(s: NormalizationBatchStudy, source: Source) -> list[str]:
    verdict, vertex = u_shape(s)
    lines = [
        "",
        "## Does a normalisation batch below the global batch beat the whole batch?",
        "",
        f"{sentence(with_role('baseline')[0].label)} against BN over the whole batch of "
        f"{s.global_batch}, seed by seed: Δ test error in pp and the paired t-test; "
        f"{header.noise(source)}.",
        "",
        *table_head("normalisation batch", "Δ test error (pp)", "p", "reading",
                    "Δ final training loss", "p"),
    ]  # fmt: skip
    for cell, whole in s.below_whole:
        d, loss = s.cells.against(cell, whole), s.cells.against(cell, whole, train_loss)
        lines.append(table_row(cell[BATCH], fmt_paired(d), fmt_p(d.p), against_noise(d, s.noise),
                               fmt_paired(loss, 4), fmt_p(loss.p)))  # fmt: skip
    lines += ["", f"**A U in the normalisation batch: {verdict}.**"]
    if vertex is not None:
        lines[-1] += (
            f" Fit of test error = a_seed + b·x + c·x² with x = log2(normalisation batch), "
            f"seeds as blocks ({vertex.df} residual degrees of freedom): c = {vertex.c:+.3f} "
            f"(p = {fmt_p(vertex.c_p)}), minimum at {2**vertex.at:.1f} images, 95 % interval "
            f"{2**vertex.low:.1f} to {2**vertex.high:.1f} (the swept range is "
            f"{s.bn[0][BATCH]} to {s.bn[-1][BATCH]}). "
            "It holds only with positive curvature and an interval that excludes both ends."
        )
        if verdict == HOLDS:
            lines += [
                "",
                f"**The U's floor below the whole batch: {floor_below_whole(vertex)}.** The "
                f"fitted minimum lies {vertex.depth:+.2f} ± {vertex.depth_half:.2f} pp (95 % "
                f"interval) from the fit at the whole batch of "
                f"{s.whole[BATCH]}; it is resolved only when that interval "
                "lies below zero.",
            ]
    elif verdict == NOT_YET:
        lines[-1] += f" The {s.whole[GROUP] if s.whole else 'baseline'} cells are not all finished."
    return lines + _signature(s)


def _signature(s: NormalizationBatchStudy) -> list[str]:
    """The regulariser's signature per normalisation batch: a higher final training loss
    than the whole batch with a test error that is not higher."""
    found = []
    for cell, whole in s.below_whole:
        d = s.cells.against(cell, whole)
        loss = s.cells.against(cell, whole, train_loss)
        if d.n < 2:
            continue
        shows = loss.significant and loss.mean > 0 and not (d.significant and d.mean > 0)
        found.append(f"{cell[BATCH]}: {holds(shows)}")
    if not found:
        return []
    return [
        "",
        "The regulariser's signature (a significantly higher final training loss than the "
        "whole batch, with a test error that is not significantly higher), by normalisation "
        "batch: " + "; ".join(found) + ".",
    ]


def _groups_section(s: NormalizationBatchStudy, reference: str) -> list[str]:
    if not s.groups:
        return []
    lines = [
        "",
        f"## Do {reference} groups give what BN gives at the same normalisation batch?",
        "",
        f"Each {reference} cell against per-device BN at the same normalisation batch (fewer "
        "devices) and at the same device count (a smaller normalisation batch); Δ test error "
        "in pp, paired by seed. It holds when the first difference is within the noise of a "
        "difference of two float32 runs, and does not hold when it is significant and beyond "
        "it.",
        "",
        *table_head("cell", "against", "Δ test error (pp)", "p", "reading"),
    ]
    verdicts = []
    for cell, same_batch, same_devices in s.groups:
        for other in (same_batch, same_devices):
            if other is not None:
                d = s.cells.against(cell, other)
                lines.append(table_row(s.label(cell), s.label(other), fmt_paired(d),
                                       fmt_p(d.p), against_noise(d, s.noise)))  # fmt: skip
        if same_batch is not None:
            d = s.cells.against(cell, same_batch)
            verdict = reaches(d, s.noise) if s.cells.complete(cell, same_batch) else NOT_YET
            verdicts.append(f"{s.label(cell)}: **{verdict}**")
    return lines + ["", f"{reference} groups reach BN at the same normalisation batch: "
                    + "; ".join(verdicts) + "."]  # fmt: skip


def _speed_section(s: NormalizationBatchStudy, by_batch: list[Cell]) -> list[str]:
    gaps = [b - a for r in s.cells.runs
            for (a, _), (b, _) in zip(r.val_curve, r.val_curve[1:], strict=False)]  # fmt: skip
    every = ""
    if gaps:
        every = f" Validation comes every {min(gaps)} steps early on, so a count is good to that."
    lines = [
        "",
        "## How fast each cell converges",
        "",
        "Optimizer steps until the validation accuracy first reaches "
        + ", ".join(f"{t:g} %" for t in THRESHOLDS)
        + " (mean ± std over the seeds that reach it)."
        + every,
        "",
        *table_head("normalisation batch", "cell", *(f"steps to {t:g} %" for t in THRESHOLDS)),
    ]
    for cell in by_batch:
        runs = s.cells.by_cell.get(cell, [])
        steps = [steps_reached([steps_to(r, t) for r in runs], len(runs)) if runs else "–"
                 for t in THRESHOLDS]  # fmt: skip
        lines.append(table_row(cell[BATCH], s.label(cell), *steps))
    return lines


def _seeds_section(s: NormalizationBatchStudy) -> list[str]:
    differences = [d.std for cell, whole in s.below_whole
                   for d in [s.cells.against(cell, whole)] if d.n > 1]  # fmt: skip
    measured = statistics.fmean(differences) if differences else math.nan
    lines = [
        "",
        "## What more seeds would buy",
        "",
        "The smallest mean paired difference the t-test at 5 % finds with 80 % power, by "
        f"seeds: for two runs that differ by float32 noise alone ({s.noise:.2f} pp a "
        "difference) and for this study's measured spread of paired differences against the "
        "whole batch"
        + (
            f" ({measured:.2f} pp, mean over the {s.whole[GROUP]} cells)"
            if not math.isnan(measured)
            else ""
        )
        + ".",
        "",
        *table_head("seeds", "float32 noise alone (pp)", "measured spread (pp)"),
    ]
    for n in (4, 8, 16):
        spread = "–" if math.isnan(measured) else f"{mde(measured, n):.2f}"
        lines.append(table_row(n, f"{mde(s.noise, n):.2f}", spread))
    return lines


def _anchors_section() -> list[str]:
    keys = ("goyal_per_worker_bn", "rethinking_batch", "ghost_noise", "ghost_batch")
    known = papers()
    lines = ["", "## Anchors", "",
             "What the papers report, beside this study; marked where the figures were not "
             "checked against the paper's text here.", ""]  # fmt: skip
    for key in keys:
        paper = known.get(key)
        if paper is None:
            continue
        lines.append(f"- {paper['source']}, {paper['setting']}: {paper['finding']}{mark(paper)}.")
    return lines


def _cost_section(runs) -> list[str]:
    wall = sum(r["wall_time_s"] for r in runs)
    if not wall:
        return []
    training = sum(r["train_time_s"] for r in runs)
    shares = {p: sum(r[f"time_{p}_s"] or 0.0 for r in runs) / wall for p in PHASES}
    other = 1 - training / wall - sum(shares.values())
    parts = ", ".join(f"{p.replace('_', ' ')} {100 * v:.1f} %" for p, v in shares.items())
    return [
        "",
        "## Where the runs' time goes",
        "",
        f"Of {wall / 60:.0f} min of run wall time, {100 * (1 - training / wall):.1f} % is "
        f"outside the training steps: {parts}, start-up and the preflight check "
        f"{100 * other:.1f} % (summed over the finished runs' summary.json).",
    ]


def write_plot(study: NormalizationBatchStudy, path: Path) -> None:
    """Test error against the normalisation batch: each seed's run as a dot, the baseline's
    mean ± std as a line, each other cell as its own marker, and the fitted quadratic where
    it exists."""
    import numpy as np

    cells = study.cells
    baseline = {v.name for v in with_role("baseline")}
    fig, ax = subplots(figsize=(7, 4.4))
    variants = sorted({c[GROUP] for c in cells.declared}, key=lambda v: (v not in baseline, v))
    for variant in variants:
        found = [c for c in cells.select({GROUP: variant}) if cells.by_cell.get(c)]
        if not found:
            continue
        xs = [c[BATCH] for c in found]
        stats = [mean_std(r.test_error for r in cells.by_cell[c]) for c in found]
        label = variant if variant in baseline else study.label(found[0])
        line = ax.errorbar(xs, [m for m, _ in stats], yerr=[sd for _, sd in stats],
                           fmt="-o" if variant in baseline else "D", capsize=3,
                           label=f"{label} (mean ± std)")  # fmt: skip
        for c in found:
            errors = [r.test_error for r in cells.by_cell[c]]
            ax.plot([c[BATCH]] * len(errors), errors, ".", alpha=0.4,
                    color=line[0].get_color())  # fmt: skip
    verdict, vertex = u_shape(study)
    if vertex is not None:
        ends = [math.log2(c[BATCH]) for c in (study.bn[0], study.bn[-1])]
        x = np.linspace(*ends, 100)
        curve = lambda x: vertex.b * x + vertex.c * x**2  # noqa: E731
        offset = statistics.fmean(  # the seeds' mean intercept
            e - curve(math.log2(c[BATCH]))
            for c in study.bn for e in cells.seeds(c).values()
        )  # fmt: skip
        ax.plot(2**x, offset + curve(x), ":", color="grey",
                label=f"quadratic fit, seeds as blocks (U: {verdict})")  # fmt: skip
    log2_axis(ax, sorted({c[BATCH] for c in cells.declared}))
    ax.set_xlabel(f"images per normalisation batch (global batch {study.global_batch})")
    ax.set_ylabel("test error (%)")
    ax.legend(fontsize=8)
    save(fig, path)


def write(source: Source, out_dir: Path) -> list[str]:
    """README.md, results.csv and the plot of the normalisation-batch study."""
    cells = source.cells()
    study = NormalizationBatchStudy(cells, source.noise["test_error"].std)
    write_plot(study, out_dir / PLOT)
    (out_dir / "README.md").write_text(markdown(source, study))
    return ["README.md", PLOT, *source.write_results(out_dir, cells)]
