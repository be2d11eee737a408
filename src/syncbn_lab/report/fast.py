"""Does a faster configuration run the same experiment? (``sweep.report.writer: arms``:
experiment=fast_vs_fp32, the fast configuration against float32 eager NCHW.)

The experiment trains the same cells in two arms, told apart by a label
(``sweep.report.labels``), and declares one comparison: each cell of one arm against the
same cell of the other. Runs of one seed share the initialisation and the data order, so
the arms are compared seed by seed, and every difference is read against the float32 noise
of a difference of two runs. What is this report's own: a table of many paired tests finds
one p < 0.05 by chance, so its verdicts test at 5 % for the whole table (Holm's adjustment),
and one pooled test over every cell and seed per metric.
"""

from __future__ import annotations

import math
import statistics

from syncbn_lab.report import header
from syncbn_lab.report.cells import Cells
from syncbn_lab.report.source import Source
from syncbn_lab.report.stats import Paired, difference_noise, paired
from syncbn_lab.report.text import fmt_p, fmt_paired, over_seeds, table_head, table_row
from syncbn_lab.report.verdicts import against_noise

COMPARISON = "arms"
METRICS = {  # metric -> (label, digits)
    "test_error": ("test error", 2),
    "test_error_precise_bn": ("test error, PreciseBN", 2),
    "train_loss": ("final training loss", 4),
}


def holm(ps: list[float]) -> list[float]:
    """Holm-adjusted p-values of a family of tests (nan stays nan): a table of many paired
    tests finds one p < 0.05 by chance; the adjusted p keeps the family's error at 5 %."""
    ranked = sorted((p, i) for i, p in enumerate(ps) if not math.isnan(p))
    adjusted, running = [math.nan] * len(ps), 0.0
    for rank, (p, i) in enumerate(ranked):
        running = max(running, min(1.0, (len(ranked) - rank) * p))
        adjusted[i] = running
    return adjusted


def value(metric: str):
    return lambda run: run.value(metric)


def pooled(cells: Cells, metric: str) -> Paired:
    """One arm - the other over every (cell, seed) pair: one paired test for the whole
    subset."""
    a, b = {}, {}
    for i, (cell, other) in enumerate(cells.pairs(COMPARISON)):
        a |= {(i, s): v for s, v in cells.seeds(cell, value(metric)).items()}
        b |= {(i, s): v for s, v in cells.seeds(other, value(metric)).items()}
    return paired(a, b)


def speed(cells: Cells, key: str) -> tuple[float, float, float]:
    """(the other arm's mean, this arm's mean, median over pairs of other / this) of a time
    that the summaries record."""
    ratios, mine, theirs = [], [], []
    for cell, other in cells.pairs(COMPARISON):
        a, b = cells.seeds(cell, value(key)), cells.seeds(other, value(key))
        mine += a.values()
        theirs += b.values()
        ratios += [b[s] / a[s] for s in a.keys() & b.keys()]
    median = statistics.median(ratios) if ratios else math.nan
    return statistics.fmean(theirs), statistics.fmean(mine), median


def levers(trainer) -> str:
    """The levers a trainer config sets, in words (``trainer.precision``, ``channels_last``,
    ``compile``)."""
    found = [
        f"{trainer.precision} autocast"
        if trainer.precision in ("bf16", "fp16")
        else trainer.precision
    ]
    if trainer.get("channels_last"):
        found.append("channels_last")
    if trainer.get("compile"):
        found.append("torch.compile")
    return ", ".join(found)


def markdown(source: Source, cells: Cells) -> str:
    """The report's README.md."""
    comparison = source.spec.comparison(COMPARISON)
    (label,) = comparison.cells.values()
    (other,) = comparison.against.values()
    config = source.spec.config
    delta = f"{label} - {other}"
    pairs = cells.pairs(COMPARISON)
    lines = [
        f"# {source.spec.title}",
        "",
        f"{header.setting(source)} The {label} configuration ({levers(config.trainer)}) "
        f"against {other}: every cell below is trained in both with the same seeds (same "
        f"initialisation, same data order) for {config.trainer.epochs} epoch(s), and each "
        f"difference {delta} is read against the float32 noise: {header.noise(source)}; in "
        f"the final training loss it is {_noise(source, 'train_loss'):.4f}.",
        "",
        header.provenance(source),
        "",
        f"The verdicts test at 5 % for the whole table (Holm's adjustment of its p-values; a "
        f"table of {len(pairs) * len(METRICS)} tests finds one p < 0.05 by chance in about "
        "half of all cases), and call a shift within the noise when its mean is at most the "
        "noise of a difference of two runs.",
        "",
        *table_head(*(k for k in cells.keys if k not in comparison.cells), "images per device",
                    "metric", f"{other} (mean ± std)", f"{label} (mean ± std)",
                    f"{delta} (paired)", "p", "p (Holm)", "verdict"),
    ]  # fmt: skip
    rows = [(cell, against, metric) for cell, against in pairs for metric in METRICS]
    deltas = [cells.against(c, a, value(m)) for c, a, m in rows]
    for (cell, against, metric), d, p in zip(rows, deltas, holm([d.p for d in deltas]),
                                             strict=True):  # fmt: skip
        name, digits = METRICS[metric]
        lines.append(table_row(
            *(cell[k] for k in cells.keys if k not in comparison.cells),
            cells.recorded("per_device_batch_size", cell), name,
            over_seeds(cells.seeds(against, value(metric)).values(), digits),
            over_seeds(cells.seeds(cell, value(metric)).values(), digits),
            fmt_paired(d, digits, count=True), fmt_p(d.p), fmt_p(p),
            against_noise(d, _noise(source, metric), p),
        ))  # fmt: skip
    lines += ["", "Over all cells (one paired test over every cell and seed per metric):", ""]
    overall = {metric: pooled(cells, metric) for metric in METRICS}
    adjusted = dict(zip(overall, holm([d.p for d in overall.values()]), strict=True))
    for metric, (name, digits) in METRICS.items():
        d = overall[metric]
        lines.append(
            f"- {name}: {delta} = {fmt_paired(d, digits)} over {d.n} pairs, p = {fmt_p(d.p)} "
            f"(Holm {fmt_p(adjusted[metric])}): "
            f"{against_noise(d, _noise(source, metric), adjusted[metric])}."
        )
    train, wall = speed(cells, "train_time_s"), speed(cells, "wall_time_s")
    lines += [
        "",
        f"Time of a whole run (the {other} and {label} twins of one cell and seed side by "
        "side, one thread each):",
        "",
        *table_head("", f"{other} (mean)", f"{label} (mean)",
                    f"{other} / {label} (median over pairs)"),
        table_row("training time (steps, data included)",
                  f"{train[0]:.1f} s", f"{train[1]:.1f} s", f"{train[2]:.2f}x"),
        table_row("wall time (data, training, evaluation, PreciseBN)",
                  f"{wall[0]:.1f} s", f"{wall[1]:.1f} s", f"{wall[2]:.2f}x"),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _noise(source: Source, metric: str) -> float:
    return difference_noise(source.noise[metric].std)
