"""When per-device BN costs accuracy (``writer: penalty``): the study's ``penalty`` comparison
(BN over a small normalisation batch against BN over the whole batch, paired by seed) read
across the configurations that several studies trained, from their archives.

A configuration is the values of the comparison's ``same`` keys (model, width, how much the
images differ). For each, the report sets the penalty beside what might explain it: the final
training loss at the whole batch (how far the model is from fitting its data), the noise of
the batch statistics at the small batch of the models trained at the whole batch
(``scripts/bn_noise.py``, collected by hand into reports/<study>/bn_noise.csv: one row per
run_dir, the column noise_b<b>), and the test-batch-statistics gap of the penalised runs (test
error with each group of b test images normalised by its own statistics, less the running
statistics'). Then whether the penalty grows along each declared trend (seeds as blocks),
whether it tracks the training loss or the noise across configurations (Spearman, exact),
what the ``remedy`` comparison's cells recover where a penalty appears, and the papers'
figures beside.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from syncbn_lab.report import header
from syncbn_lab.report.cells import Cell, Cells
from syncbn_lab.report.collect import loss_ratio, train_loss
from syncbn_lab.report.comparisons import cell_table
from syncbn_lab.report.papers import mark, papers
from syncbn_lab.report.plots import log2_axis, save, subplots
from syncbn_lab.report.predictors import Case, leave_one_out
from syncbn_lab.report.source import Source
from syncbn_lab.report.spec import Trend, repository
from syncbn_lab.report.stats import (
    ALPHA,
    Paired,
    difference_noise,
    mean_std,
    recovered,
    spearman,
    trend,
)
from syncbn_lab.report.text import fmt_interval, fmt_p, fmt_paired, over_seeds, table_head
from syncbn_lab.report.text import table_row as row
from syncbn_lab.report.verdicts import HOLDS, against_noise, outcome, reaches
from syncbn_lab.variants import GROUP, with_role

PENALTY, REMEDY = "penalty", "remedy"
"""The comparisons the report reads: the penalty, and the remedies against the penalised
cell."""
NOISE_CSV = "bn_noise.csv"
"""reports/<study>/bn_noise.csv: the measured noise of each trained run's batch statistics."""
BATCH = "normalization_batch_size"
DATASET = "data.name"


@dataclass(frozen=True)
class Configuration:
    """One configuration's penalty: the penalised cell, the cell it is measured against, and
    the paired difference in test error (pp, positive: the small batch is worse)."""

    config: Cell
    small: Cell
    whole: Cell
    penalty: Paired


class PenaltyStudy:
    """The penalty per configuration, the noise of the batch statistics and the figures the
    report reads from them."""

    def __init__(self, cells: Cells, noise: float):
        self.cells, self.noise = cells, noise
        self.same = cells.spec.comparison(PENALTY).same
        self.by_config: dict[Cell, Configuration] = {}
        for small, whole in cells.pairs(PENALTY):
            config = self.config_of(small)
            self.by_config[config] = Configuration(
                config, small, whole, cells.against(small, whole)
            )

    def label(self, config: Cell) -> str:
        """The configuration's name: its values, the data set's only where the report
        combines several."""
        one_dataset = len({c[DATASET] for c in self.by_config if DATASET in c.keys}) <= 1
        shown = [k for k in config.keys if not (k == DATASET and one_dataset)]
        return ", ".join(_value(k, config[k]) for k in shown)

    def config_of(self, cell: Cell) -> Cell:
        return Cell(tuple(cell[k] for k in self.same), self.same)

    def appears(self, c: Configuration) -> bool:
        """A penalty: worse at the small batch, significantly and beyond the float32 noise."""
        return c.penalty.significant and c.penalty.mean > self.noise

    def per_seed(self, c: Configuration) -> dict[int, float]:
        small, whole = self.cells.seeds(c.small), self.cells.seeds(c.whole)
        return {s: small[s] - whole[s] for s in sorted(set(small) & set(whole))}

    @cached_property
    def measured_noise(self) -> dict[tuple[str, str], dict[str, float]]:
        """(study, run_dir) -> that trained run's measured noise by column (noise_b<b>), from
        each study's reports/<study>/bn_noise.csv."""
        found: dict[tuple[str, str], dict[str, float]] = {}
        for study in sorted({r.study for r in self.cells.runs if r.study}):
            path = repository() / "reports" / study / NOISE_CSV
            if not path.is_file():
                continue
            with open(path, newline="") as f:
                for line in csv.DictReader(f):
                    found[(study, line["run_dir"])] = {
                        k: float(v) for k, v in line.items() if k.startswith("noise_b") and v
                    }
        return found

    def noise_of(self, c: Configuration) -> list[float]:
        """The noise at the penalised cell's batch of each run of the whole-batch cell."""
        column = f"noise_b{c.small[BATCH]}"
        measured = [self.measured_noise.get((r.study, r.run_dir.name), {})
                    for r in self.cells.by_cell.get(c.whole, [])]  # fmt: skip
        return [m[column] for m in measured if column in m]

    def gap(self, c: Configuration) -> list[float]:
        """The test-batch-statistics gap of each penalised run (pp)."""
        runs = self.cells.by_cell.get(c.small, [])
        return [r.test_error_batch_stats - r.test_error for r in runs]

    def loss(self, c: Configuration) -> list[float]:
        return [train_loss(r) for r in self.cells.by_cell.get(c.whole, [])]

    def small_loss(self, c: Configuration) -> list[float]:
        return [train_loss(r) for r in self.cells.by_cell.get(c.small, [])]

    def _ratios(self, cell: Cell) -> list[float]:
        """Each run's final training loss over its test loss (runs that record both)."""
        runs = self.cells.by_cell.get(cell, [])
        return [loss_ratio(r) for r in runs if r["test_loss"]]

    def small_ratio(self, c: Configuration) -> list[float]:
        return self._ratios(c.small)

    def whole_ratio(self, c: Configuration) -> list[float]:
        return self._ratios(c.whole)

    def dataset(self, c: Configuration) -> str:
        """The data set the configuration trained on (``data.name``, a cell key where the
        report combines several, else what its runs record)."""
        if DATASET in c.config.keys:
            return str(c.config[DATASET])
        runs = self.cells.by_cell.get(c.whole, []) + self.cells.by_cell.get(c.small, [])
        return str(runs[0]["dataset"]) if runs else "?"

    def cases(self, figure: Figure) -> list[Case]:
        """The measured configurations as a predictor sees them (those with the figure)."""
        return [Case(self.dataset(c), statistics.fmean(v), self.appears(c), c.penalty.mean)
                for c in self.measured() if (v := figure(self, c))]  # fmt: skip

    def along(self, t: Trend) -> list[Configuration | None]:
        """The configurations of trend ``t`` in its order (None where not declared)."""
        out = []
        for value in t.values:
            where = {**t.fixed, t.vary: value}
            out.append(next((c for config, c in self.by_config.items()
                             if all(config[k] == v for k, v in where.items())), None))  # fmt: skip
        return out

    def grows(self, t: Trend) -> Paired | None:
        """Each seed's slope of its penalty along trend ``t`` (:func:`~.stats.trend`); None
        until every configuration of it is declared."""
        along = self.along(t)
        if any(c is None for c in along):
            return None
        return trend([self.per_seed(c) for c in along])

    def tracks(self, figure: Figure) -> Paired:
        """Spearman's ρ of the configurations' mean penalty against their mean ``figure``,
        as a Paired (mean: ρ, n: configurations, p: exact) that the verdicts read."""
        pairs = [(c.penalty.mean, statistics.fmean(v)) for c in self.found_on()
                 if (v := figure(self, c))]  # fmt: skip
        rho, p = spearman([a for a, _ in pairs], [b for _, b in pairs])
        return Paired(rho, math.nan, len(pairs) if not math.isnan(rho) else 0, p)

    def measured(self) -> list[Configuration]:
        """The configurations whose penalty has two seeds or more: those the claims read."""
        return [c for c in self.by_config.values() if c.penalty.n > 1]

    def found_on(self) -> list[Configuration]:
        """The measured configurations of :data:`FOUND_ON`, where the tracked figures were
        found (all of them where the report holds no other data set): a training loss has
        its data set's units, so the other data sets test the candidates instead
        (:func:`predictors_table`)."""
        mine = [c for c in self.measured() if self.dataset(c) == FOUND_ON]
        return mine or self.measured()

    def several_datasets(self) -> bool:
        return len({self.dataset(c) for c in self.measured()}) > 1

    def remedies(self) -> list[Remedy]:
        """Each cell of the ``remedy`` comparison measured against a penalised cell."""
        if REMEDY not in self.cells.spec.comparisons:
            return []
        shared = (*self.same, *self.cells.spec.comparison(REMEDY).cells)  # said once
        out = []
        for cell, small in self.cells.pairs(REMEDY):
            c = self.by_config.get(self.config_of(cell))
            if c is None or small != c.small:
                continue
            vs_whole = self.cells.against(cell, c.whole)
            share = recovered(c.penalty.mean, vs_whole.mean) if self.appears(c) else math.nan
            name = ", ".join(_value(k, cell[k]) for k in cell.keys if k not in shared)
            out.append(Remedy(c, name, self.cells.against(cell, small), vs_whole, share))
        return out


Figure = Callable[[PenaltyStudy, Configuration], list[float]]


@dataclass(frozen=True)
class Remedy:
    """A remedy cell of a configuration: against its penalised cell and against the whole
    batch (paired, pp), and the share of the penalty it recovers (nan without a penalty)."""

    of: Configuration
    name: str
    vs_small: Paired
    vs_whole: Paired
    share: float


TRACKED: tuple[tuple[str, Figure], ...] = (
    ("the final training loss at the whole batch", PenaltyStudy.loss),
    ("the noise of the batch statistics at the small batch", PenaltyStudy.noise_of),
)
"""What the penalty might track across configurations: each configuration's mean of it."""

PREDICTORS: tuple[tuple[str, str, Figure], ...] = (
    ("train_loss_small", "the final training loss at the small batch", PenaltyStudy.small_loss),
    (
        "loss_ratio_small",
        "the final training loss over the test loss at the small batch",
        PenaltyStudy.small_ratio,
    ),
    ("train_loss_whole", "the final training loss at the whole batch", PenaltyStudy.loss),
    (
        "loss_ratio_whole",
        "the final training loss over the test loss at the whole batch",
        PenaltyStudy.whole_ratio,
    ),
    ("noise_small", "the noise of the batch statistics at the small batch", PenaltyStudy.noise_of),
)
"""The candidates reports/nbs_penalty/PREDICTORS.md names, each a figure a user reads off their
own run, in its order."""
FOUND_ON = "fashion_mnist"
"""The data set the candidates were found on; the others test them."""


def _value(key: str, value: object) -> str:
    """A cell key's value as a label reads it: a name alone (resnet8), else "width 4"."""
    short = key.split(".")[-1]
    return str(value) if short in ("name", GROUP) else f"{short.replace('_', ' ')} {value}"


def _claim(d: Paired | None) -> str:
    """A directed claim's reading: holds, does not hold (and why), or not yet measured."""
    if d is None or d.n < 2:
        return "not yet measured"
    verdict = outcome(d)
    return HOLDS if verdict == HOLDS else f"does not hold ({verdict})"


def _batches(s: PenaltyStudy) -> tuple[object, object]:
    """The small normalisation batch and the whole one, as the text names them: the whole
    batch by its size, or "the whole batch (64 or 256)" where the data sets' global batches
    differ."""
    configs = list(s.by_config.values())
    if not configs:
        return "b", "the whole batch"
    wholes = sorted({c.whole[BATCH] for c in configs})
    whole = wholes[0] if len(wholes) == 1 else f"the whole batch ({' or '.join(map(str, wholes))})"
    return configs[0].small[BATCH], whole


def penalty_table(s: PenaltyStudy) -> list[str]:
    small, whole = _batches(s)
    lines = [
        f"The penalty: test error at a normalisation batch of {small} less at {whole}, paired "
        f"by seed (pp; positive: the small batch is worse), with its 95 % interval, p and "
        f"reading against the noise; beside it the final training loss at {whole}, the noise "
        f"of the batch statistics at b = {small} of the models trained at {whole} "
        f"(scripts/bn_noise.py, reports/<study>/{NOISE_CSV}) and the test-batch-statistics "
        f"gap of the runs at {small} (test error with groups of {small} test images "
        "normalised by their own statistics, less with the running statistics). Mean ± std "
        "over seeds.",
        "",
        *table_head(
            "configuration",
            "seeds",
            f"penalty, {small} against {whole} (pp)",
            "95 % interval",
            "p",
            "reading",
            f"final training loss at {whole}",
            f"noise at b = {small}",
            "test-batch-statistics gap (pp)",
        ),  # fmt: skip
    ]
    for c in s.by_config.values():
        lines.append(row(
            s.label(c.config), c.penalty.n, fmt_paired(c.penalty), fmt_interval(c.penalty),
            fmt_p(c.penalty.p), against_noise(c.penalty, s.noise), over_seeds(s.loss(c), 4),
            over_seeds(s.noise_of(c), 3), over_seeds(s.gap(c), 2),
        ))  # fmt: skip
    return lines


def trend_table(s: PenaltyStudy) -> list[str]:
    lines = [
        "Whether the penalty grows along each trend: each seed's least-squares slope of its "
        "penalty against the configurations' order (seeds as blocks; two configurations: "
        "their paired difference), a t-test of the slopes against 0. Holds: it grows, "
        f"p < {ALPHA}.",
        "",
        *table_head(
            "trend",
            "configurations, in order",
            "penalty along it (pp)",
            "slope per step (pp)",
            "seeds",
            "p",
            "the penalty grows",
        ),  # fmt: skip
    ]
    for t in s.cells.spec.trends.values():
        order = " → ".join(_value(t.vary, v) for v in t.values)
        penalties = " → ".join(
            "–" if c is None or not c.penalty.n else f"{c.penalty.mean:+.2f}" for c in s.along(t)
        )
        d = s.grows(t)
        n = 0 if d is None else d.n
        slope, p = ("–", "–") if not n else (fmt_paired(d), fmt_p(d.p))
        lines.append(row(t.name, order, penalties, slope, n, p, _claim(d)))
    return lines


def tracks_table(s: PenaltyStudy) -> list[str]:
    where = (f" of {FOUND_ON}, where these figures were found (the other data sets test the "
             "figures a user reads off a run in the next section)"
             if s.several_datasets() else "")  # fmt: skip
    lines = [
        f"Whether the penalty tracks a figure across the configurations{where}: Spearman's rank "
        "correlation of the configurations' mean penalty with their mean of the figure, its "
        f"p exact over every permutation. Holds: a positive correlation, p < {ALPHA}.",
        "",
        *table_head(
            "the penalty against", "configurations", "Spearman's ρ", "p", "the penalty tracks it"
        ),  # fmt: skip
    ]
    for name, figure in TRACKED:
        d = s.tracks(figure)
        rho = "–" if not d.n else f"{d.mean:+.2f}"
        lines.append(row(name, d.n, rho, fmt_p(d.p), _claim(d)))
    return lines


def _rho(points: list[Case]) -> Paired:
    """Spearman's ρ of the points' values with their penalty, as the verdicts read it; of two
    points, +1 or -1 (whether they rank alike) with no p."""
    if len(points) == 2 and points[0].value != points[1].value:
        a, b = points
        same = (a.value - b.value) * (a.penalty - b.penalty) > 0
        return Paired(1.0 if same else -1.0, math.nan, 2, math.nan)
    rho, p = spearman([q.value for q in points], [q.penalty for q in points])
    return Paired(rho, math.nan, 0 if math.isnan(rho) else len(points), p)


def _fmt_rho(r: Paired) -> str:
    if not r.n:
        return "–"
    return f"{r.mean:+.2f} ({r.n}" + ("" if math.isnan(r.p) else f", p {fmt_p(r.p)}") + ")"


def predictor_verdict(s: PenaltyStudy, figure: Figure) -> str:
    """PREDICTORS.md's rule: the candidate holds beyond the data set it was found on when the
    threshold chosen on the other data sets predicts every configuration of each new data set
    (leave one data set out) and it ranks with the penalty over every configuration."""
    points = s.cases(figure)
    if not points:
        return "not yet measured"
    new = sorted({q.dataset for q in points} - {FOUND_ON})
    if not new:
        return "waits for runs on other data sets"
    held = [h for h in leave_one_out(points) if h.dataset in new]
    if len(held) < len(new):
        return "waits for runs on the data set it was found on"
    missed = sum(h.of - h.hits for h in held)
    verdict = _claim(_rho(points))
    if missed:
        return f"does not hold ({missed} of {sum(h.of for h in held)} new configurations missed)"
    return verdict if verdict != HOLDS else HOLDS


def new_hits(s: PenaltyStudy, figure: Figure) -> tuple[int, int]:
    """(hits, of): the configurations of the data sets other than :data:`FOUND_ON` that the
    leave-one-data-set-out cut predicts right."""
    held = [h for h in leave_one_out(s.cases(figure)) if h.dataset != FOUND_ON]
    return sum(h.hits for h in held), sum(h.of for h in held)


def _predictors_claim(s: PenaltyStudy) -> str:
    """The claim line of the candidates: which holds beyond :data:`FOUND_ON`, else the ones
    that predict the most new configurations, beside a rule that predicts the same for all."""
    holding = [name for name, _, figure in PREDICTORS if predictor_verdict(s, figure) == HOLDS]
    head = f"- A figure read off one's own run predicts the penalty beyond {FOUND_ON}: "
    if holding:
        return head + "holds for " + ", ".join(f"`{n}`" for n in holding) + "."
    best = best_predictors(s)
    hits, of = new_hits(s, best[0][2]) if best else (0, 0)
    if not of:
        return head + "not yet measured."
    new = [s.appears(c) for c in s.measured() if s.dataset(c) != FOUND_ON]
    alike = max(sum(new), len(new) - sum(new))
    names = " and ".join(f"`{name}`" for name, _, _ in best)
    verb, each = ("comes", "") if len(best) == 1 else ("come", " each")
    everywhere = f"predicting {'a' if 2 * sum(new) > len(new) else 'no'} penalty everywhere"
    baseline = (f", no more than {everywhere} does ({alike} of {len(new)})" if alike >= hits
                else f", against {alike} of {len(new)} for {everywhere}")  # fmt: skip
    return (
        f"{head}does not hold for any of the {len(PREDICTORS)} candidates; {names} {verb} "
        f"closest, {hits} of {of} new configurations predicted{each}{baseline}."
    )


def predictors_table(s: PenaltyStudy) -> list[str]:
    """PREDICTORS.md's tests (a) and (b) for each candidate."""
    datasets = sorted({s.dataset(c) for c in s.measured()})
    lines = [
        "Each candidate a user reads off their own run (reports/nbs_penalty/PREDICTORS.md "
        "fixes them and these tests): (a) Spearman's ρ of the configurations' penalty with "
        "their mean of it, over every configuration and within each data set; (b) leave one "
        "data set out: the cut chosen on the other data sets' configurations (at or above it "
        "predicts a penalty, significant and beyond the noise) and its hits on the one left "
        f"out. It holds beyond {FOUND_ON} when (b) predicts every configuration of every other "
        f"data set and (a) over all is positive with p < {ALPHA}.",
        "",
        *table_head(
            "candidate",
            "what",
            "ρ over all (configurations, p)",
            *(f"ρ within {d}" for d in datasets),
            "left out: cut, hits",
            "holds beyond it",
        ),  # fmt: skip
    ]
    for name, what, figure in PREDICTORS:
        points = s.cases(figure)
        overall = _rho(points)
        within = [_fmt_rho(_rho([q for q in points if q.dataset == d])) for d in datasets]
        held = "; ".join(f"{h.dataset}: {h.threshold.cut:.3g}, {h.hits} of {h.of}"
                         for h in leave_one_out(points))  # fmt: skip
        held = held or "one data set: nothing to leave out"
        lines.append(
            row(f"`{name}`", what, _fmt_rho(overall), *within, held, predictor_verdict(s, figure))
        )
    return lines


def remedy_table(s: PenaltyStudy) -> list[str]:
    lines = [
        "Each remedy cell against the penalised cell and against the whole batch, paired by "
        "seed (pp), and the share of the penalty it recovers (1 - its gap to the whole "
        "batch / the penalty; where a penalty appears). Reaches the whole batch: holds when "
        "within the noise of it.",
        "",
        *table_head(
            "configuration",
            "remedy",
            "against the penalised cell (pp)",
            "p",
            "against the whole batch (pp)",
            "p",
            "recovered",
            "reaches the whole batch",
        ),  # fmt: skip
    ]
    for r in s.remedies():
        share = "no penalty to recover" if math.isnan(r.share) else f"{100 * r.share:.0f} %"
        lines.append(row(
            s.label(r.of.config), r.name, fmt_paired(r.vs_small), fmt_p(r.vs_small.p),
            fmt_paired(r.vs_whole), fmt_p(r.vs_whole.p), share, reaches(r.vs_whole, s.noise),
        ))  # fmt: skip
    return lines


def anchors(s: PenaltyStudy) -> list[str]:
    """The papers' figures: for those with BN's error by normalisation batch, the penalty
    from their largest batch to their smallest; else their finding."""
    lines = ["What the papers report, beside; marked where the figures were not checked "
             "against the paper's text here.", ""]  # fmt: skip
    for key in s.cells.spec.anchors:
        paper = papers()[key]
        by_batch = next((v for k, v in paper.items() if k.startswith("bn_error_by_")), None)
        if by_batch:
            small, large = min(by_batch), max(by_batch)
            found = (f"BN's error {by_batch[large]} % at {large} images, {by_batch[small]} % "
                     f"at {small}: +{by_batch[small] - by_batch[large]:.1f} pp")  # fmt: skip
        else:
            found = paper["finding"]
        lines.append(f"- {paper['source']}, {paper['setting']}: {found}{mark(paper)}.")
    return lines


def claims(s: PenaltyStudy) -> list[str]:
    """One line per claim: where a penalty appears, each trend, what it tracks, the
    remedies."""
    penalised = [c for c in s.by_config.values() if s.appears(c)]
    listed = "; ".join(f"{s.label(c.config)} {fmt_paired(c.penalty)} pp" for c in penalised)
    measured = s.measured()
    waiting = len(s.by_config) - len(measured)
    lines = [
        f"- A penalty, significant and beyond the noise ({s.noise:.2f} pp), appears in "
        f"{len(penalised)} of the {len(measured)} configurations measured"
        + (f" ({waiting} not yet)" if waiting else "")
        + (f": {listed}." if listed else ".")
    ]
    for t in s.cells.spec.trends.values():
        d = s.grows(t)
        measured = d is not None and d.n > 1
        slope = f", {fmt_paired(d)} pp a step, p = {fmt_p(d.p)}" if measured else ""
        lines.append(f"- The penalty grows along {t.name}: {_claim(d)}{slope}.")
    on = f" on {FOUND_ON}" if s.several_datasets() else ""
    for name, figure in TRACKED:
        d = s.tracks(figure)
        rho = f", ρ = {d.mean:+.2f} over {d.n}, p = {fmt_p(d.p)}" if d.n > 1 else ""
        lines.append(f"- The penalty tracks {name}{on}: {_claim(d)}{rho}.")
    if s.several_datasets():
        lines.append(_predictors_claim(s))
    recovering = [r for r in s.remedies() if not math.isnan(r.share)]
    if recovering:
        over = ", ".join(_value(k, v) for k, v in s.cells.spec.comparison(REMEDY).cells.items())
        each = "; ".join(f"{s.label(r.of.config)}, {r.name}: {100 * r.share:.0f} % "
                         f"(reaches it: {reaches(r.vs_whole, s.noise)})"
                         for r in recovering)  # fmt: skip
        lines.append(
            f"- Where a penalty appears, the share of it each remedy ({over}) recovers, and "
            f"whether it reaches the whole batch: {each}."
        )
    return lines


PLOT = "penalty.png"
HEADLINE = "test_error_vs_normalization_batch.png"
"""The report's first figure, the README's headline: test error against the normalisation
batch along :data:`HEADLINE_TREND`, with the remedies marked."""
HEADLINE_TREND = "underfitting"
"""The declared trend whose configurations the headline figure draws, one line each."""
MARKERS = "osD^v<>ph*"


def write_plot(s: PenaltyStudy, path) -> None:
    """The penalty of each configuration (mean and 95 % interval over seeds) against each
    figure of :data:`TRACKED`, one panel each, the float32 noise of a difference shaded; one
    colour and marker a configuration, named in one legend below the panels."""
    fig, legend_rows = penalty_figure(s)
    save(fig, path, rect=(0, 0.055 * legend_rows, 1, 1))


def penalty_figure(s: PenaltyStudy):
    """The figure of :func:`write_plot` and the rows its legend takes below the panels."""
    fig, axes = subplots(1, len(TRACKED), figsize=(4.4 * len(TRACKED), 4.6), sharey=True)
    handles = {}
    shown = s.found_on()
    for ax, (name, figure) in zip(axes, TRACKED, strict=True):
        for i, c in enumerate(s.by_config.values()):  # one colour and marker a configuration
            values = figure(s, c) if c in shown else None
            if c.penalty.n < 2 or not values:
                continue
            handles[s.label(c.config)] = ax.errorbar(
                statistics.fmean(values), c.penalty.mean, yerr=c.penalty.half_interval,
                fmt=MARKERS[i % len(MARKERS)], capsize=3, color=f"C{i % 10}", markersize=6,
            )  # fmt: skip
        ax.axhspan(-s.noise, s.noise, color="grey", alpha=0.15, lw=0)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel(name, fontsize=9)
        ax.grid(True, alpha=0.3)
    small, whole = _batches(s)
    axes[0].set_ylabel(f"penalty (pp): error at {small} images − at {whole}\n"
                       "mean and 95 % interval")  # fmt: skip
    from matplotlib.patches import Patch

    handles[f"the float32 noise of a difference (± {s.noise:.2f} pp)"] = Patch(
        color="grey", alpha=0.15, lw=0
    )
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=2, fontsize=8.5,
               frameon=False)  # fmt: skip
    return fig, math.ceil(len(handles) / 2)


PREDICTOR_PLOT = "predictor.png"
"""The penalty against the best candidate of :data:`PREDICTORS`, the data sets marked."""


def _standing(s: PenaltyStudy, figure: Figure) -> tuple[bool, int, int, float]:
    """How a candidate ranks: it holds; fewest new configurations missed; most predicted;
    then its ρ over every configuration."""
    hits, of = new_hits(s, figure)
    return predictor_verdict(s, figure) == HOLDS, hits - of, hits, _rho(s.cases(figure)).mean


def best_predictors(s: PenaltyStudy) -> list[tuple[str, str, Figure]]:
    """The candidates that rank first by :func:`_standing` (ties by every figure but ρ
    listed together, the highest ρ first); empty before any is measured."""
    measured = [(_standing(s, f), (n, w, f)) for n, w, f in PREDICTORS if _rho(s.cases(f)).n]
    if not measured:
        return []
    top = max(key[:3] for key, _ in measured)
    tied = sorted((c for c in measured if c[0][:3] == top), key=lambda c: -c[0][3])
    return [candidate for _, candidate in tied]


def best_predictor(s: PenaltyStudy) -> tuple[str, str, Figure] | None:
    """The first of :func:`best_predictors`: the candidate the predictor figure draws."""
    best = best_predictors(s)
    return best[0] if best else None


def write_predictor_plot(s: PenaltyStudy, path) -> bool:
    """The penalty of each configuration (mean and 95 % interval) against its mean of the
    best candidate, one marker a data set, and each leave-one-data-set-out cut as a dashed
    line; False (nothing written) before any candidate is measured."""
    best = best_predictor(s)
    if best is None:
        return False
    name, what, figure = best
    fig, ax = subplots(figsize=(6.4, 4.4))
    datasets = sorted({s.dataset(c) for c in s.measured()})
    for i, dataset in enumerate(datasets):
        mine = [(statistics.fmean(v), c) for c in s.measured()
                if s.dataset(c) == dataset and (v := figure(s, c))]  # fmt: skip
        if not mine:
            continue
        ax.errorbar([x for x, _ in mine], [c.penalty.mean for _, c in mine],
                    yerr=[c.penalty.half_interval for _, c in mine],
                    fmt=MARKERS[i % len(MARKERS)], color=f"C{i % 10}", capsize=3,
                    markersize=6, ls="", label=dataset)  # fmt: skip
    for h in leave_one_out(s.cases(figure)):
        if math.isfinite(h.threshold.cut):  # inf, -inf: the same prediction everywhere
            ax.axvline(h.threshold.cut, color="grey", ls="--", lw=0.7)
    ax.axhspan(-s.noise, s.noise, color="grey", alpha=0.15, lw=0)
    ax.axhline(0, color="grey", lw=0.8)
    small, whole = _batches(s)
    ax.set_xlabel(f"{name}: {what}", fontsize=9)
    ax.set_ylabel(f"penalty (pp): error at {small} images − at {whole}\n"
                  "mean and 95 % interval", fontsize=9)  # fmt: skip
    ax.set_title("dashed: each leave-one-data-set-out cut; grey: the float32 noise of a "
                 "difference", fontsize=8.5)  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8.5, frameon=False)
    save(fig, path)
    return True


@dataclass(frozen=True)
class Point:
    """One cell of the headline figure: its configuration's label along the trend, the
    variant, its devices, the normalisation batch, whether it is a cell of the ``remedy``
    comparison, and its test error over seeds."""

    line: str
    loss: float  # the configuration's final training loss at the whole batch (mean)
    variant: str
    devices: int
    batch: int
    remedy: bool
    error: Paired  # mean and std over seeds (a cell's values, not a difference)


def headline_points(s: PenaltyStudy) -> list[Point]:
    """Every cell of each configuration along :data:`HEADLINE_TREND`, in the trend's order,
    with its test error (mean, std over seeds): what the headline figure draws."""
    t = s.cells.spec.trends.get(HEADLINE_TREND)
    remedy = s.cells.spec.comparison(REMEDY).cells if REMEDY in s.cells.spec.comparisons else {}
    out = []
    for c in s.along(t) if t else []:
        if c is None:
            continue
        line, loss = _value(t.vary, c.config[t.vary]), mean_std(s.loss(c))[0]
        for cell in s.cells.select(dict(zip(c.config.keys, c.config.values, strict=True))):
            errors = list(s.cells.seeds(cell).values())
            if errors:
                error = Paired(*mean_std(errors), len(errors), math.nan)
                is_remedy = bool(remedy) and s.cells.matches(cell, remedy)
                out.append(Point(line, loss, cell[GROUP], cell["devices"], cell[BATCH],
                                 is_remedy, error))  # fmt: skip
    return out


def _per_device(p: Point) -> bool:
    """The point is per-device BN's (the baseline variant), not SyncBN's."""
    return p.variant == with_role("baseline")[0].name


def _remedy_label(p: Point, whole: int) -> str:
    """A remedy cell as the legend names it: bn on 8 devices, or SyncBN in groups of 16."""
    if _per_device(p):
        return f"remedy: bn on {p.devices} devices ({p.batch} images)"
    group = p.batch * p.devices // whole
    return f"remedy: SyncBN in groups of {group} on {p.devices} devices ({p.batch} images)"


def headline_figure(s: PenaltyStudy, points: list[Point]):
    """Test error against the normalisation batch: per-device BN of each configuration as
    one line, labelled at its whole-batch end with its final training loss there; the remedy
    cells marked (bn's hollow square on its line, SyncBN's hollow diamond beside it); mean
    and 95 % interval over seeds."""
    from matplotlib.lines import Line2D

    fig, ax = subplots(figsize=(8.0, 4.6))
    whole = max((p.batch for p in points), default=2)
    legend = {"per-device BN (bn), 1 to 128 devices": Line2D([], [], color="black", marker="o",
                                                            markersize=5)}  # fmt: skip
    ends = []  # (y, label, colour) of each line's whole-batch end
    for i, name in enumerate(dict.fromkeys(p.line for p in points)):
        colour = f"C{i % 10}"
        mine = [p for p in points if p.line == name]
        bn = sorted((p for p in mine if _per_device(p)), key=lambda p: p.batch)
        ax.errorbar([p.batch for p in bn], [p.error.mean for p in bn],
                    yerr=[p.error.half_interval for p in bn], fmt="-o", color=colour,
                    capsize=3, markersize=5)  # fmt: skip
        for p in (p for p in mine if p.remedy):
            marker = "s" if _per_device(p) else "D"
            x = p.batch if _per_device(p) else p.batch * 1.18  # beside bn's, not on it
            ax.errorbar(x, p.error.mean, yerr=p.error.half_interval, fmt=marker, color=colour,
                        mfc="white", mew=1.5, capsize=3, markersize=8)  # fmt: skip
            legend.setdefault(_remedy_label(p, whole), Line2D([], [], ls="", marker=marker,
                              color="black", mfc="white", mew=1.5, markersize=8))  # fmt: skip
        loss = mine[0].loss
        label = name if math.isnan(loss) else f"{name}\nfinal training loss {loss:.3f}"
        ends.append((bn[-1].error.mean, label, colour))
    _label_ends(ax, ends, x=whole)
    log2_axis(ax, sorted({p.batch for p in points}))
    ax.set_xlim(1.6, whole * 12)
    ax.set_xlabel(f"images one BN layer normalises over (global batch {whole})")
    ax.set_ylabel("test error (%), mean and 95 % interval")
    ax.set_title(_headline_title(s, points), fontsize=10)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=1, fontsize=8.5,
               frameon=False)  # fmt: skip
    return fig, len(legend)


def _label_ends(ax, ends: list[tuple[float, str, str]], x: float, gap: float = 0.11) -> None:
    """Each line's label right of its end at ``x``, moved apart vertically to at least
    ``gap`` of the y axis's span (a thin line joins a moved label to its end)."""
    low, high = ax.get_ylim()
    step, placed = gap * (high - low), []
    for y, label, colour in sorted(ends):
        at = max(y, placed[-1] + step) if placed else y
        placed.append(at)
        ax.annotate(label, (x, y), xytext=(x * 1.25, at), textcoords="data", va="center",
                    fontsize=9, color=colour,
                    arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.6, "alpha": 0.6}
                    if abs(at - y) > 1e-9 else None)  # fmt: skip


def _headline_title(s: PenaltyStudy, points: list[Point]) -> str:
    """What the figure shows: the model, the data and the seeds of a cell."""
    along = [c for c in s.along(s.cells.spec.trends[HEADLINE_TREND]) if c is not None]
    runs = [r for c in along for r in s.cells.by_cell.get(c.whole, [])]
    model = " / ".join(sorted({str(r["model"]) for r in runs})) or "the model"
    data = " / ".join(sorted({str(r["dataset"]) for r in runs})) or "the data"
    seeds = sorted({p.error.n for p in points})
    each = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    return f"{model} on {data}: test error of {each} seeds a cell"


def write_headline(s: PenaltyStudy, path) -> bool:
    """The headline figure into ``path``; False (nothing written) without its trend."""
    points = headline_points(s)
    if not points:
        return False
    fig, legend_rows = headline_figure(s, points)
    save(fig, path, rect=(0, 0.05 * legend_rows, 1, 1))
    return True


def write(source: Source, out_dir) -> list[str]:
    """README.md, the plot and results.csv of the penalty report."""
    cells = source.cells()
    study = PenaltyStudy(cells, difference_noise(source.noise["test_error"].std))
    headline = [HEADLINE] if write_headline(study, out_dir / HEADLINE) else []
    write_plot(study, out_dir / PLOT)
    best = [PREDICTOR_PLOT] if write_predictor_plot(study, out_dir / PREDICTOR_PLOT) else []
    (out_dir / "README.md").write_text(markdown(source, cells, study))
    return ["README.md", *headline, PLOT, *best, *source.write_results(out_dir, cells)]


def _headline_section(s: PenaltyStudy) -> list[str]:
    """The headline figure under its own heading, where the report draws it."""
    if not headline_points(s):
        return []
    t = s.cells.spec.trends[HEADLINE_TREND]
    along = " → ".join(_value(t.vary, v) for v in t.values)
    return [
        "## Test error against the normalisation batch",
        "",
        f"Per-device BN of each configuration along {HEADLINE_TREND} ({along}), one line each "
        "and labelled with its final training loss at the whole batch, and the remedy cells "
        "marked; each point is a cell's mean test error and the 95 % interval of that mean "
        "(t over its seeds).",
        "",
        f"![Test error against the normalisation batch]({HEADLINE})",
        "",
    ]


def _predictor_figure(s: PenaltyStudy) -> list[str]:
    best = best_predictor(s)
    if best is None:
        return []
    return [
        "",
        f"The penalty against `{best[0]}`, the candidate that holds (else the one that predicts "
        "the most configurations of the other data sets), one marker a data set:",
        "",
        f"![The penalty against the best predictor]({PREDICTOR_PLOT})",
    ]


def markdown(source: Source, cells: Cells, s: PenaltyStudy) -> str:
    declared = sum(len(seeds) for seeds in cells.declared.values())
    found = sorted({r.study for r in cells.runs if r.study})
    missing = [name for name in source.spec.combines if name not in found]
    lines = [
        f"# {source.spec.title}",
        "",
        f"{header.setting(source)} Runs of {', '.join(found) or 'no study'}"
        + (f" (none yet of {', '.join(missing)})" if missing else "")
        + f"; every comparison is paired by seed, and {header.noise(source)}.",
        "",
        header.provenance(source, declared),
        "",
        "## The claims",
        "",
        *claims(s),
        "",
        *_headline_section(s),
        "## The penalty per configuration",
        "",
        *penalty_table(s),
        "",
        "## Does the penalty grow?",
        "",
        *trend_table(s),
        "",
        "## What the penalty tracks",
        "",
        *tracks_table(s),
        "",
        f"![The penalty against each figure]({PLOT})",
        "",
        "## Predictors across data sets",
        "",
        *predictors_table(s),
        *_predictor_figure(s),
    ]
    if REMEDY in cells.spec.comparisons:
        lines += ["", "## The remedies", "", *remedy_table(s)]
    if cells.spec.anchors:
        lines += ["", "## Anchors", "", *anchors(s)]
    lines += [
        "",
        "## The cells",
        "",
        *cell_table(cells, list(cells.declared), [(k, lambda c, k=k: c[k]) for k in cells.keys]),
    ]
    return "\n".join(lines) + "\n"
