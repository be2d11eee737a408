"""Does the fast configuration run the same experiment? fp32 eager against it, paired by seed.

Each cell (norm variant x images per device) is trained once per seed in both arms: ``fp32``
(float32, NCHW, eager: the study as it ran before) and ``fast`` (the levers that
``experiment=bn_vs_syncbn`` sets). Runs of one seed share the initialisation and the data
order, so the arms are compared seed by seed with a paired t-test, and every difference is
set against the float32 noise floor: the spread of runs that are the same model in exact
arithmetic (SyncBN across device counts in the committed study, ``report.stats.noise_floor``).
A difference of two runs has sqrt(2) times the noise of one.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncbn_lab.parallel.modes import MODES
from syncbn_lab.report.collect import Run
from syncbn_lab.report.stats import ALPHA, Paired, mean_std, noise_floor, paired
from syncbn_lab.report.tables import table_row
from syncbn_lab.variants import GROUP, VARIANTS

ARMS = ("fp32", "fast")
FP32_OVERRIDES = ("trainer.precision=fp32", "trainer.channels_last=false", "trainer.compile=false")
"""What turns the study's fast configuration back into float32 eager NCHW."""

CELLS = (("bn", 1), ("bn", 8), ("bn", 32), ("sync", 8))
"""(bn, emulated devices) at global batch 64: bn at 64, 8 and 2 images per device, and sync at
8 devices (SyncBN is flat in device count, so one count stands for all)."""

METRICS = {  # summary key -> (label, unit)
    "test_error": ("test error", "pp"),
    "test_error_precise_bn": ("test error, PreciseBN", "pp"),
    "train_loss": ("final training loss", ""),
}


@dataclass(frozen=True)
class Comparison:
    """One metric of one cell: each arm's mean and std over seeds, and fast - fp32 paired."""

    cell: tuple[str, int]
    metric: str
    fp32: tuple[float, float]
    fast: tuple[float, float]
    delta: Paired


def value(summary: dict[str, Any], metric: str) -> float:
    """A metric of METRICS from a run's summary (test errors as collect.Run reads them)."""
    if metric.startswith("test_error"):
        return getattr(Run(Path(), summary), metric)
    return float(summary[metric])


def by_arm(runs: Iterable[dict[str, Any]], cell: tuple[str, int], arm: str, metric: str):
    """seed -> value for the runs of ``cell`` in ``arm`` (each summary carries its ``arm``)."""
    return {
        r["seed"]: value(r, metric)
        for r in runs
        if (r[GROUP], r["devices"]) == cell and r["arm"] == arm
    }


def compare(runs: list[dict[str, Any]], cells=CELLS, metrics=tuple(METRICS)) -> list[Comparison]:
    out = []
    for cell in cells:
        for metric in metrics:
            a, b = by_arm(runs, cell, "fast", metric), by_arm(runs, cell, "fp32", metric)
            out.append(
                Comparison(cell, metric, mean_std(b.values()), mean_std(a.values()), paired(a, b))
            )
    return out


def pooled(runs: list[dict[str, Any]], metric: str, cells=CELLS) -> Paired:
    """fast - fp32 over every (cell, seed) pair: one paired test for the whole subset."""
    a, b = {}, {}
    for i, cell in enumerate(cells):
        for seed, v in by_arm(runs, cell, "fast", metric).items():
            a[(i, seed)] = v
        for seed, v in by_arm(runs, cell, "fp32", metric).items():
            b[(i, seed)] = v
    return paired(a, b)


def study_noise_floor(results_csv: Path) -> dict[str, float]:
    """The float32 noise floor of one run (test error in pp, final training loss) from the
    SyncBN runs of a committed study's results.csv."""
    with results_csv.open() as f:
        rows = [
            row
            for row in csv.DictReader(f)
            if VARIANTS[row[GROUP]].role == "reference" and MODES[row["parallel"]].emulated
        ]
    runs = [
        Run(Path(row["run_dir"]), {
            "seed": int(row["seed"]), "devices": int(row["devices"]),
            "test_acc": float(row["test_acc"]), "train_loss": float(row["train_loss"]),
            "test_acc_precise_bn": float(row["test_acc_precise_bn"] or "nan"),
        })
        for row in rows
    ]  # fmt: skip
    return {
        "test_error": noise_floor(runs, lambda r: r.test_error).std,
        "test_error_precise_bn": noise_floor(runs, lambda r: r.test_error_precise_bn).std,
        "train_loss": noise_floor(runs, lambda r: r["train_loss"]).std,
    }


def speed(runs: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    """(fp32 mean, fast mean, median over pairs of fp32 / fast) of a time in the summaries."""
    import statistics

    pairs = {}
    for r in runs:
        pairs.setdefault((r[GROUP], r["devices"], r["seed"]), {})[r["arm"]] = r[key]
    ratios = [p["fp32"] / p["fast"] for p in pairs.values() if len(p) == 2]
    fp32 = statistics.fmean(p["fp32"] for p in pairs.values() if "fp32" in p)
    fast = statistics.fmean(p["fast"] for p in pairs.values() if "fast" in p)
    return fp32, fast, statistics.median(ratios) if ratios else math.nan


def describe_levers(trainer) -> str:
    """The levers a trainer config sets, in words (``trainer.precision``, ``channels_last``,
    ``compile``)."""
    levers = [
        f"{trainer.precision} autocast"
        if trainer.precision in ("bf16", "fp16")
        else trainer.precision
    ]
    if trainer.get("channels_last"):
        levers.append("channels_last")
    if trainer.get("compile"):
        levers.append("torch.compile")
    return ", ".join(levers)


def holm(ps: list[float]) -> list[float]:
    """Holm-adjusted p-values of a family of tests (nan stays nan): a table of many paired
    tests finds one p < 0.05 by chance; the adjusted p keeps the family's error at 5 %."""
    ranked = sorted((p, i) for i, p in enumerate(ps) if not math.isnan(p))
    adjusted, running = [math.nan] * len(ps), 0.0
    for rank, (p, i) in enumerate(ranked):
        running = max(running, min(1.0, (len(ranked) - rank) * p))
        adjusted[i] = running
    return adjusted


def verdict(delta: Paired, floor: float, p: float | None = None) -> str:
    """ "unchanged" when the paired test finds no difference (at ``p``, Holm-adjusted in a
    family; the test's own p by default) and the mean shift is within the noise of a
    difference of two runs; else what it is."""
    if delta.n == 0 or math.isnan(delta.mean):
        return "no pairs"
    within = abs(delta.mean) <= math.sqrt(2) * floor
    p = delta.p if p is None else p
    if not math.isnan(p) and p < ALPHA:
        return "changed (significant)" if not within else "shifted within the noise (significant)"
    return "unchanged" if within else "not significant, beyond the noise"


def _fmt(x: float, unit: str) -> str:
    return f"{x:+.2f}" if unit == "pp" else f"{x:+.4f}"


def render(
    runs: list[dict[str, Any]], floor: dict[str, float], levers: str, meta: dict[str, str]
) -> str:
    """The report's README.md."""
    pair_floor = math.sqrt(2) * floor["test_error"], math.sqrt(2) * floor["train_loss"]
    lines = [
        "# The fast configuration against float32 eager, paired by seed",
        "",
        f"`experiment=bn_vs_syncbn` trains with {levers}. This report checks that it runs the "
        "same experiment as float32 eager NCHW: every cell below is trained in both "
        "configurations with the same seeds (same initialisation, same data order) for the "
        "study's one epoch, and each difference fast - fp32 is set against the float32 noise "
        "floor of the committed study (SyncBN across device counts in "
        f"reports/bn_vs_syncbn_1epoch/results.csv: one run {floor['test_error']:.2f} pp test "
        f"error, {floor['train_loss']:.4f} final training loss; a difference of two runs has "
        f"sqrt(2) times that: {pair_floor[0]:.2f} pp, {pair_floor[1]:.4f}).",
        "",
        f"Produced by `{meta['command']}`, the runs at commit {meta['commit']}, on "
        f"{meta['machine']}; "
        f"{len(runs)} runs, {meta['wall']}.",
        "",
        "The verdicts test at 5 % for the whole table (Holm's adjustment of its p-values; a "
        "table of 12 tests finds one p < 0.05 by chance in about half of all cases), and call "
        "a shift within the noise when its mean is at most the noise of a difference of two "
        "runs.",
        "",
        table_row(GROUP, "images per device", "metric", "fp32 (mean ± std)", "fast (mean ± std)",
             "fast - fp32 (paired)", "p", "p (Holm)", "verdict"),
        table_row(*["---"] * 9),
    ]  # fmt: skip
    comparisons = compare(runs)
    adjusted = holm([c.delta.p for c in comparisons])
    for c, p_holm in zip(comparisons, adjusted, strict=True):
        label, unit = METRICS[c.metric]
        digits = 2 if unit == "pp" else 4
        lines.append(
            table_row(
                c.cell[0],
                64 // c.cell[1],
                label,
                f"{c.fp32[0]:.{digits}f} ± {c.fp32[1]:.{digits}f}",
                f"{c.fast[0]:.{digits}f} ± {c.fast[1]:.{digits}f}",
                f"{_fmt(c.delta.mean, unit)} ± {c.delta.std:.{digits}f} (n={c.delta.n})",
                f"{c.delta.p:.3f}",
                f"{p_holm:.3f}",
                verdict(c.delta, floor[c.metric], p_holm),
            )
        )
    lines += ["", "Over all cells (one paired test over every cell and seed per metric):", ""]
    deltas = {metric: pooled(runs, metric) for metric in METRICS}
    adjusted = dict(zip(deltas, holm([d.p for d in deltas.values()]), strict=True))
    for metric, (label, unit) in METRICS.items():
        d = deltas[metric]
        lines.append(
            f"- {label}: fast - fp32 = {_fmt(d.mean, unit)} ± {d.std:.{2 if unit == 'pp' else 4}f}"
            f" over {d.n} pairs, p = {d.p:.3f} (Holm {adjusted[metric]:.3f}): "
            f"{verdict(d, floor[metric], adjusted[metric])}."
        )
    train, wall = speed(runs, "train_time_s"), speed(runs, "wall_time_s")
    lines += [
        "",
        "Time of a whole one-epoch run (two runs at a time, the fp32 and fast twin of one cell "
        "and seed side by side, one thread each):",
        "",
        table_row("", "fp32 (mean)", "fast (mean)", "fp32 / fast (median over pairs)"),
        table_row(*["---"] * 4),
        table_row("training time (steps, data included)",
             f"{train[0]:.1f} s", f"{train[1]:.1f} s", f"{train[2]:.2f}x"),
        table_row("wall time (data, training, evaluation, PreciseBN)",
             f"{wall[0]:.1f} s", f"{wall[1]:.1f} s", f"{wall[2]:.2f}x"),
        "",
    ]  # fmt: skip
    return "\n".join(lines)
