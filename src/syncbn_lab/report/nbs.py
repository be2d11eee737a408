"""The normalisation-batch study's report (``sweep.report: normalization_batch``, e.g.
experiment=nbs_256): at a fixed global batch, test error against the number of images one
BatchNorm layer normalises over, and whether SyncBN over groups of devices gives what
per-device BN gives at the same normalisation batch.

Every comparison is paired by seed (runs of one seed share the initialisation and the data
order) and stated with its p and its noise; a claim is "holds", "does not hold", or "not yet"
while the runs it needs are missing. The cells are what the sweep declared (its sweep.json),
so a sweep still running or resumed on another machine renders with its unfinished cells
marked.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from syncbn_lab.archive import read_attempts
from syncbn_lab.report.collect import Run, collect_failures, collect_runs
from syncbn_lab.report.convergence import THRESHOLDS, steps_reached, steps_to
from syncbn_lab.report.papers import papers
from syncbn_lab.report.stats import ALPHA, Paired, by_seed, mean_std, paired
from syncbn_lab.report.tables import fmt, fmt_p, fmt_paired, table_row
from syncbn_lab.variants import GROUP, VARIANTS

BASELINE = "baseline"
"""The role (syncbn_lab.variants) of the variant whose normalisation batch the device count
sets: per-device BN; the other variants' cells are set against its."""
PHASES = ("validation", "test", "precise_bn", "test_batch_stats", "checkpoints", "logging")
"""summary.json's time_<phase>_s fields: the time a run spends outside its training steps."""
CSV_COLUMNS = (GROUP, "devices", "normalization_batch_size", "per_device_batch_size", "seed",
               "test_error", "test_error_precise_bn", "test_error_batch_stats", "train_loss",
               *(f"steps_to_{t:g}" for t in THRESHOLDS), "steps", "wall_time_s",
               "train_time_s", "outside_training_s", "cpu_model", "cpu_isa", "precision",
               "training_code", "git_commit", "run_dir")  # fmt: skip


@dataclass(frozen=True, order=True)
class Cell:
    """One cell of the study: a variant on a number of devices, normalising over
    ``normalization_batch`` images."""

    normalization_batch: int
    variant: str
    devices: int

    @property
    def baseline(self) -> bool:
        spec = VARIANTS.get(self.variant)
        return spec is not None and spec.role == BASELINE

    def label(self, global_batch: int) -> str:
        if self.baseline or self.normalization_batch == global_batch:
            return f"{self.variant}, {self.devices} device{'s' * (self.devices > 1)}"
        group = self.normalization_batch * self.devices // global_batch
        return f"{self.variant} in groups of {group}, {self.devices} devices"


def cell_of(summary: dict[str, Any]) -> Cell:
    return Cell(summary["normalization_batch_size"], summary[GROUP], summary["devices"])


def declared(sweep_dir: Path) -> dict[Cell, list[int]]:
    """Every cell the sweep declared (its sweep.json: the grid and the parts) with its seeds,
    each job composed as its run composes it."""
    return _declared((sweep_dir / "sweep.json").read_text())


@cache
def _declared(record_text: str) -> dict[Cell, list[int]]:
    from syncbn_lab.config import compose, derive
    from syncbn_lab.multirun import jobs
    from syncbn_lab.sweep import multirun_overrides

    record = json.loads(record_text)
    cells: dict[Cell, list[int]] = defaultdict(list)
    for part in record["parts"]:
        for job in jobs(multirun_overrides(Path("."), record["experiment"], part["overrides"])):
            cfg = compose([o for o in job if not o.startswith(("hydra", "skip_finished"))])
            shape = derive(cfg)
            cell = Cell(shape.normalization_batch_size, cfg.bn.name, cfg.parallel.devices)
            cells[cell].append(cfg.trainer.seed)
    return dict(cells)


class NormalizationBatchStudy:
    """The runs of one sweep by cell, with the figures the report states."""

    def __init__(self, runs: list[Run], cells: dict[Cell, list[int]], floor: float):
        self.runs, self.declared, self.floor = runs, cells, floor
        self.global_batch = runs[0]["global_batch_size"] if runs else 0
        self.by_cell: dict[Cell, list[Run]] = defaultdict(list)
        for run in runs:
            self.by_cell[cell_of(run.summary)].append(run)
        self.bn = sorted(c for c in self.declared if c.baseline)
        self.whole = max(self.bn, key=lambda c: c.normalization_batch) if self.bn else None

    def seeds(self, cell: Cell, value=lambda r: r.test_error) -> dict[int, float]:
        return by_seed(self.by_cell.get(cell, []), value)

    def against(self, cell: Cell, other: Cell, value=lambda r: r.test_error) -> Paired:
        """``cell`` - ``other``, paired by seed."""
        return paired(self.seeds(cell, value), self.seeds(other, value))

    def complete(self, *cells: Cell) -> bool:
        """Every declared seed of ``cells`` has finished."""
        return all(len(self.by_cell.get(c, [])) >= len(self.declared[c]) for c in cells)


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
    if len(study.bn) < 3 or not study.complete(*study.bn):
        return "not yet", None
    points = [(s, math.log2(c.normalization_batch), e)
              for c in study.bn for s, e in study.seeds(c).items()]  # fmt: skip
    vertex = quadratic_vertex(points)
    if vertex is None:
        return "not yet", None
    ends = math.log2(study.bn[0].normalization_batch), math.log2(study.bn[-1].normalization_batch)
    inside = ends[0] < vertex.low and vertex.high < ends[1]
    holds = vertex.c > 0 and vertex.c_p < ALPHA and inside
    return ("holds" if holds else "does not hold"), vertex


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


def _steps(runs: list[Run], accuracy: float) -> str:
    """Steps to ``accuracy`` over a cell's runs (convergence.steps_reached); – for none."""
    return steps_reached([steps_to(r, accuracy) for r in runs], len(runs)) if runs else "–"


def _verdict(d: Paired, noise: float) -> str:
    """A paired difference read: its significance, and its size against the noise of a
    difference of two float32 runs (``noise``)."""
    if d.n < 2:
        return "not yet"
    beyond = abs(d.mean) > noise
    if d.significant:
        return "differs" if beyond else "differs, by less than the noise"
    return "not significant, beyond the noise" if beyond else "within the noise"


def reaches(d: Paired, noise: float) -> str:
    """Whether a cell reaches another's result: holds when the mean difference is within the
    noise of a difference, does not hold when it is significant and beyond it, and is
    undecided otherwise (a gap beyond the noise that the seeds cannot yet resolve)."""
    if d.n < 2:
        return "not yet"
    if abs(d.mean) <= noise:
        return "holds"
    return "does not hold" if d.significant else "undecided (more seeds)"


def render(
    study: NormalizationBatchStudy,
    title: str,
    meta: dict[str, Any],
) -> str:
    """The study's README.md."""
    s, g = study, study.global_batch
    noise = math.sqrt(2) * s.floor
    declared_runs = sum(len(v) for v in s.declared.values())
    lines = [
        f"# {title}",
        "",
        f"resnet8 on Fashion-MNIST at a global batch of {g}, float32, on emulated devices: "
        "per-device BatchNorm normalises over the images of one device, SyncBN in groups over "
        "the images of a group of devices. Each cell is one configuration over seeds; every "
        "comparison is paired by seed.",
        "",
        f"Produced by `{meta['command']}`. {len(s.runs)} of {declared_runs} declared runs "
        f"finished{meta['missing']}. {meta['code']} {meta['machines']} {meta['time']}",
        "",
        "## Test error by normalisation batch",
        "",
        "Test error (%) with the running statistics (EMA), with PreciseBN statistics and with "
        "the statistics of test batches of the training normalisation batch; the last "
        "epoch's training loss; mean ± std over the seeds finished (n of those declared).",
        "",
        table_row("normalisation batch", "cell", "n", "test error, EMA", "PreciseBN",
                  "test-batch statistics", "final training loss"),
        table_row(*["---"] * 7),
    ]  # fmt: skip
    for cell in sorted(s.declared, key=lambda c: (-c.normalization_batch, c.variant)):
        runs = s.by_cell.get(cell, [])
        n = f"{len(runs)}/{len(s.declared[cell])}"
        lines.append(table_row(
            cell.normalization_batch, cell.label(g), n,
            _over_seeds([r.test_error for r in runs]),
            _over_seeds([r.test_error_precise_bn for r in runs]),
            _over_seeds([r.test_error_batch_stats for r in runs]),
            _over_seeds([r["train_loss"] for r in runs], digits=4),
        ))  # fmt: skip
    lines += ["", f"![test error against the normalisation batch]({PLOT})"]
    lines += _u_section(s, noise) + _groups_section(s, noise) + _speed_section(s)
    lines += _seeds_section(s, noise) + _anchors_section(s) + _cost_section(s, meta)
    return "\n".join(lines) + "\n"


def _over_seeds(values: list[float], digits: int = 2) -> str:
    """mean ± std over seeds; one seed's value alone (it has no spread to state)."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (one seed)"
    return fmt(*mean_std(values), digits=digits)


def _u_section(s: NormalizationBatchStudy, noise: float) -> list[str]:
    verdict, vertex = u_shape(s)
    lines = [
        "",
        "## Does a normalisation batch below the global batch beat the whole batch?",
        "",
        f"Per-device BN against BN over the whole batch of {s.global_batch} (same seed; "
        f"Δ test error in pp, the paired t-test; the noise of a difference of two float32 "
        f"runs is {noise:.2f} pp):",
        "",
        table_row("normalisation batch", "Δ test error (pp)", "p", "reading",
                  "Δ final training loss", "p"),
        table_row(*["---"] * 6),
    ]  # fmt: skip
    for cell in s.bn:
        if cell == s.whole:
            continue
        d = s.against(cell, s.whole)
        loss = s.against(cell, s.whole, lambda r: r["train_loss"])
        lines.append(table_row(cell.normalization_batch, fmt_paired(d), fmt_p(d.p),
                               _verdict(d, noise), fmt_paired(loss, 4), fmt_p(loss.p)))  # fmt: skip
    lines += ["", f"**A U in the normalisation batch: {verdict}.**"]
    if vertex is not None:
        lines[-1] += (
            f" Fit of test error = a_seed + b·x + c·x² with x = log2(normalisation batch), "
            f"seeds as blocks ({vertex.df} residual degrees of freedom): c = {vertex.c:+.3f} "
            f"(p = {fmt_p(vertex.c_p)}), minimum at {2**vertex.at:.1f} images, 95 % interval "
            f"{2**vertex.low:.1f} to {2**vertex.high:.1f} (the swept range is "
            f"{s.bn[0].normalization_batch} to {s.bn[-1].normalization_batch}). It holds only "
            "with positive curvature and an interval that excludes both ends."
        )
        if verdict == "holds":
            floor = floor_below_whole(vertex)
            lines += [
                "",
                f"**The U's floor below the whole batch: {floor}.** The fitted minimum lies "
                f"{vertex.depth:+.2f} ± {vertex.depth_half:.2f} pp (95 % interval) from the "
                f"fit at the whole batch of {s.whole.normalization_batch}; it is resolved "
                "only when that interval lies below zero.",
            ]
    elif verdict == "not yet":
        lines[-1] += " The bn cells are not all finished."
    lines += _signature(s)
    return lines


def _signature(s: NormalizationBatchStudy) -> list[str]:
    """The regulariser's signature per normalisation batch: a higher final training loss
    than the whole batch with a test error that is not higher."""
    found = []
    for cell in s.bn:
        if cell == s.whole:
            continue
        d = s.against(cell, s.whole)
        loss = s.against(cell, s.whole, lambda r: r["train_loss"])
        if d.n < 2:
            continue
        shows = loss.significant and loss.mean > 0 and not (d.significant and d.mean > 0)
        found.append(f"{cell.normalization_batch}: {'holds' if shows else 'does not hold'}")
    if not found:
        return []
    return [
        "",
        "The regulariser's signature (a significantly higher final training loss than the "
        "whole batch, with a test error that is not significantly higher), by normalisation "
        "batch: " + "; ".join(found) + ".",
    ]


def _groups_section(s: NormalizationBatchStudy, noise: float) -> list[str]:
    groups = sorted(c for c in s.declared if not c.baseline)
    if not groups:
        return []
    lines = [
        "",
        "## Do SyncBN groups give what BN gives at the same normalisation batch?",
        "",
        "Each SyncBN cell against per-device BN at the same normalisation batch (fewer "
        "devices) and at the same device count (a smaller normalisation batch); Δ test error "
        "in pp, paired by seed. It holds when the first difference is within the noise of a "
        "difference of two float32 runs, and does not hold when it is significant and beyond "
        "it.",
        "",
        table_row("cell", "against", "Δ test error (pp)", "p", "reading"),
        table_row(*["---"] * 5),
    ]
    verdicts = []
    for cell in groups:
        same_batch = next((c for c in s.bn if c.normalization_batch == cell.normalization_batch),
                          None)  # fmt: skip
        same_devices = next((c for c in s.bn if c.devices == cell.devices), None)
        for other in (same_batch, same_devices):
            if other is None:
                continue
            d = s.against(cell, other)
            lines.append(table_row(cell.label(s.global_batch), other.label(s.global_batch),
                                   fmt_paired(d), fmt_p(d.p), _verdict(d, noise)))  # fmt: skip
        if same_batch is not None:
            d = s.against(cell, same_batch)
            verdict = reaches(d, noise) if s.complete(cell, same_batch) else "not yet"
            verdicts.append(f"{cell.label(s.global_batch)}: **{verdict}**")
    return lines + ["", "SyncBN groups reach BN at the same normalisation batch: "
                    + "; ".join(verdicts) + "."]  # fmt: skip


def _speed_section(s: NormalizationBatchStudy) -> list[str]:
    gaps = [b - a for r in s.runs
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
        table_row("normalisation batch", "cell", *(f"steps to {t:g} %" for t in THRESHOLDS)),
        table_row(*["---"] * (2 + len(THRESHOLDS))),
    ]
    for cell in sorted(s.declared, key=lambda c: (-c.normalization_batch, c.variant)):
        runs = s.by_cell.get(cell, [])
        lines.append(table_row(cell.normalization_batch, cell.label(s.global_batch),
                               *(_steps(runs, t) for t in THRESHOLDS)))  # fmt: skip
    return lines


def _seeds_section(s: NormalizationBatchStudy, noise: float) -> list[str]:
    differences = [d.std for cell in s.bn if cell != s.whole
                   for d in [s.against(cell, s.whole)] if d.n > 1]  # fmt: skip
    measured = statistics.fmean(differences) if differences else math.nan
    lines = [
        "",
        "## What more seeds would buy",
        "",
        "The smallest mean paired difference the t-test at 5 % finds with 80 % power, by "
        f"seeds: for two runs that differ by float32 noise alone ({noise:.2f} pp a difference) "
        "and for this study's measured spread of paired differences against the whole batch"
        + (f" ({measured:.2f} pp, mean over the bn cells)" if not math.isnan(measured) else "")
        + ".",
        "",
        table_row("seeds", "float32 noise alone (pp)", "measured spread (pp)"),
        table_row(*["---"] * 3),
    ]
    for n in (4, 8, 16):
        spread = "–" if math.isnan(measured) else f"{mde(measured, n):.2f}"
        lines.append(table_row(n, f"{mde(noise, n):.2f}", spread))
    return lines


def _anchors_section(s: NormalizationBatchStudy) -> list[str]:
    keys = ("goyal_per_worker_bn", "rethinking_batch", "ghost_noise", "ghost_batch")
    known = papers()
    lines = ["", "## Anchors", "",
             "What the papers report, beside this study; marked where the figures were not "
             "checked against the paper's text here.", ""]  # fmt: skip
    for key in keys:
        paper = known.get(key)
        if paper is None:
            continue
        mark = "" if paper.get("confirmed", True) else " (not checked against the paper)"
        lines.append(f"- {paper['source']}, {paper['setting']}: {paper['finding']}{mark}.")
    return lines


def _cost_section(s: NormalizationBatchStudy, meta: dict[str, Any]) -> list[str]:
    wall = sum(r["wall_time_s"] for r in s.runs)
    if not wall:
        return []
    training = sum(r["train_time_s"] for r in s.runs)
    shares = {p: sum(r[f"time_{p}_s"] or 0.0 for r in s.runs) / wall for p in PHASES}
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


PLOT = "test_error_vs_normalization_batch.png"


def write_plot(study: NormalizationBatchStudy, path: Path) -> None:
    """Test error against the normalisation batch: each seed's run as a dot, bn's mean ± std
    as a line, each SyncBN cell as its own marker, and the fitted quadratic where it exists."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.4))
    cells_first = sorted(study.declared, key=lambda c: (not c.baseline, c.variant))
    variants = list(dict.fromkeys(c.variant for c in cells_first))  # the baseline first
    for variant in variants:
        cells = sorted(c for c in study.declared if c.variant == variant and study.by_cell.get(c))
        if not cells:
            continue
        xs = [c.normalization_batch for c in cells]
        stats = [mean_std(r.test_error for r in study.by_cell[c]) for c in cells]
        style = "-o" if cells[0].baseline else "D"
        label = variant if cells[0].baseline else cells[0].label(study.global_batch)
        line = ax.errorbar(xs, [m for m, _ in stats], yerr=[s for _, s in stats], fmt=style,
                           capsize=3, label=f"{label} (mean ± std)")  # fmt: skip
        for c in cells:
            errors = [r.test_error for r in study.by_cell[c]]
            ax.plot([c.normalization_batch] * len(errors), errors, ".", alpha=0.4,
                    color=line[0].get_color())  # fmt: skip
    verdict, vertex = u_shape(study)
    if vertex is not None:
        x = np.linspace(math.log2(study.bn[0].normalization_batch),
                        math.log2(study.bn[-1].normalization_batch), 100)  # fmt: skip
        curve = lambda x: vertex.b * x + vertex.c * x**2  # noqa: E731
        offset = statistics.fmean(  # the seeds' mean intercept
            e - curve(math.log2(c.normalization_batch))
            for c in study.bn for e in study.seeds(c).values()
        )  # fmt: skip
        ax.plot(2**x, offset + curve(x), ":", color="grey",
                label=f"quadratic fit, seeds as blocks (U: {verdict})")  # fmt: skip
    ax.set_xscale("log", base=2)
    ticks = sorted({c.normalization_batch for c in study.declared})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel(f"images per normalisation batch (global batch {study.global_batch})")
    ax.set_ylabel("test error (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def outside_training(run: Run) -> float:
    return run["wall_time_s"] - run["train_time_s"]


def write_csv(study: NormalizationBatchStudy, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS)
        writer.writeheader()
        for run in sorted(study.runs, key=lambda r: (cell_of(r.summary), r["seed"])):
            row = {k: run[k] for k in CSV_COLUMNS}
            row.update(
                test_error=run.test_error,
                test_error_precise_bn=run.test_error_precise_bn,
                test_error_batch_stats=run.test_error_batch_stats,
                outside_training_s=outside_training(run),
                run_dir=run.run_dir.name,
            )
            row.update({f"steps_to_{t:g}": steps_to(run, t) for t in THRESHOLDS})
            writer.writerow(row)


def describe(runs: list[Run], sweep_dir: Path, wall_time_s: float | None) -> dict[str, str]:
    """The report's sentences on code, machines and time."""
    codes = sorted({r["training_code"] or "?" for r in runs})
    commits = sorted({(r["git_commit"] or "?")[:7] for r in runs})
    code = (f"One training code (`training_code` {codes[0]}; commits {', '.join(commits)})."
            if len(codes) == 1 else
            f"**{len(codes)} training codes** ({', '.join(codes)}): the runs did not all "
            "train with the same code.")  # fmt: skip
    machines: dict[str, int] = defaultdict(int)
    for r in runs:
        machines[f"{r['cpu_model']} ({r['cpu_isa']}, {r['precision']})"] += 1
    attempts = read_attempts(sweep_dir)
    attempted = f" in {len(attempts)} attempt(s) of the sweep" if attempts else ""
    time = ""
    if wall_time_s:
        time = f"The sweep took {wall_time_s / 60:.0f} min of wall time{attempted}."
    return {
        "code": code,
        "machines": "Machines: " + "; ".join(f"{m}: {n} runs" for m, n in machines.items()) + ".",
        "time": time,
    }


def write_nbs_report(
    sweep_dir: Path, out_dir: Path, title: str, wall_time_s: float | None, floor: float,
    command: str,
) -> list[Run]:  # fmt: skip
    """README.md and results.csv of the normalisation-batch sweep in ``sweep_dir``."""
    runs = collect_runs(sweep_dir)
    # a run stopped by a signal (its machine going away) is no failure: it runs again on resume
    failures = [f for f in collect_failures(sweep_dir) if f["reason"] != "preempted"]
    study = NormalizationBatchStudy(runs, declared(sweep_dir), floor)
    missing = sum(len(v) for v in study.declared.values()) - len(runs)
    meta = {
        "command": command,
        "missing": (f"; {missing} not yet ({len(failures)} failed)" if missing else ""),
        **describe(runs, sweep_dir, wall_time_s),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_plot(study, out_dir / PLOT)
    (out_dir / "README.md").write_text(render(study, title, meta))
    write_csv(study, out_dir / "results.csv")
    return runs
