"""The statistics a report states: means over seeds, the float32 noise floor, paired tests.

Runs of the same seed share the model's initialisation and the data order, so two variants
are compared seed by seed (a paired test). SyncBN runs of one seed at different device
counts are the same model in exact arithmetic (tests/parallel prove it in float64), so
their spread is float32 rounding alone: the noise floor that every other difference is set
against.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from syncbn_lab.report.collect import Run

ALPHA = 0.05
"""Significance level of every test a reading turns into "holds" / "does not hold"."""

Value = Callable[[Run], float]


def finite(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and not math.isnan(v)]


def mean_std(values: Iterable[float | None]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value, nan for none)."""
    values = finite(values)
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def by_seed(runs: Iterable[Run], value: Value) -> dict[int, float]:
    """seed -> value of its run (the first run of a seed if there are several)."""
    out: dict[int, float] = {}
    for run in runs:
        v = value(run)
        if run["seed"] not in out and v is not None and not math.isnan(v):
            out[run["seed"]] = v
    return out


@dataclass(frozen=True)
class Paired:
    """Per-seed differences ``a - b``: their mean, standard deviation, count and the
    two-sided p of a paired t-test (nan with fewer than two pairs)."""

    mean: float
    std: float
    n: int
    p: float

    @property
    def significant(self) -> bool:
        return not math.isnan(self.p) and self.p < ALPHA

    @property
    def half_interval(self) -> float:
        """Half the 95 % interval of the mean difference (t with n - 1 degrees of freedom);
        nan below two pairs."""
        if self.n < 2:
            return math.nan
        from scipy import stats

        return float(stats.t.ppf(0.975, self.n - 1) * self.std / math.sqrt(self.n))


def paired(a: dict[int, float], b: dict[int, float]) -> Paired:
    """Compare ``a`` and ``b`` (seed -> value) over the seeds both have."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    if not diffs:
        return Paired(math.nan, math.nan, 0, math.nan)
    mean, std = mean_std(diffs)
    p = math.nan
    if len(diffs) > 1 and std > 1e-12 * max(1.0, abs(mean)):
        p = float(stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue)
    elif len(diffs) > 1:  # the same shift in every pair: t is infinite, or 0/0 for no shift
        p = 0.0 if abs(mean) > 1e-12 else 1.0
    return Paired(mean, std, len(diffs), p)


@dataclass(frozen=True)
class NoiseFloor:
    """The spread of runs that are the same model: ``std`` is the pooled within-seed standard
    deviation of one run's value across device counts (``df`` degrees of freedom); ``f`` and
    ``p`` test for a device-count effect (two-way ANOVA, seeds as blocks, on the seeds that
    have every device count), and ``spread`` is the range of the device-count means."""

    std: float
    df: int
    spread: float
    f: float
    p: float
    seeds: int
    device_counts: int

    @property
    def flat(self) -> bool:
        """No significant device-count effect (the test could be made and found none)."""
        return not math.isnan(self.p) and self.p >= ALPHA


def noise_floor(runs: list[Run], value: Value) -> NoiseFloor:
    """The noise floor of ``value`` from runs that differ only in their device count."""
    from scipy import stats

    cells: dict[tuple[int, int], float] = {}
    for run in runs:
        v = value(run)
        if v is not None and not math.isnan(v):
            cells.setdefault((run["seed"], run["devices"]), v)
    seeds = sorted({s for s, _ in cells})
    devices = sorted({d for _, d in cells})
    squares, df = 0.0, 0
    for s in seeds:
        values = [cells[(s, d)] for d in devices if (s, d) in cells]
        if len(values) > 1:
            m = statistics.fmean(values)
            squares += sum((v - m) ** 2 for v in values)
            df += len(values) - 1
    std = math.sqrt(squares / df) if df else math.nan
    device_means = [
        statistics.fmean(v for (_, d), v in cells.items() if d == dev) for dev in devices
    ]
    spread = max(device_means) - min(device_means) if device_means else math.nan

    complete = [s for s in seeds if all((s, d) in cells for d in devices)]
    f = p = math.nan
    if len(complete) > 1 and len(devices) > 1:
        grid = [[cells[(s, d)] for d in devices] for s in complete]
        grand = statistics.fmean(v for row in grid for v in row)
        col = [statistics.fmean(row[j] for row in grid) for j in range(len(devices))]
        row_means = [statistics.fmean(row) for row in grid]
        ss_dev = len(complete) * sum((c - grand) ** 2 for c in col)
        ss_res = sum(
            (grid[i][j] - row_means[i] - col[j] + grand) ** 2
            for i in range(len(complete))
            for j in range(len(devices))
        )
        df_dev, df_res = len(devices) - 1, (len(devices) - 1) * (len(complete) - 1)
        if ss_res > 0:
            f = (ss_dev / df_dev) / (ss_res / df_res)
            p = float(stats.f.sf(f, df_dev, df_res))
    return NoiseFloor(std, df, spread, f, p, len(seeds), len(devices))


def difference_noise(std: float) -> float:
    """The noise of a difference of two runs whose each has the noise ``std``: √2 × std."""
    return math.sqrt(2) * std


NOISE_METRICS = ("test_error", "test_error_precise_bn", "train_loss")


def reference_noise(runs: Iterable[Run]) -> dict[str, NoiseFloor] | None:
    """The float32 noise floor of one run, by metric (:data:`NOISE_METRICS`), from the
    one-process runs of the reference variant (SyncBN: one model at every device count);
    None without any."""
    from syncbn_lab.parallel.modes import mode
    from syncbn_lab.variants import GROUP, with_role

    reference = {v.name for v in with_role("reference")}
    runs = [r for r in runs if r[GROUP] in reference and not mode(r["parallel"]).distributed]
    if not runs:
        return None
    return {m: noise_floor(runs, lambda r, m=m: r.value(m)) for m in NOISE_METRICS}


def committed_noise(results_csv: Path) -> dict[str, NoiseFloor]:
    """:func:`reference_noise` of a committed study's results.csv."""
    from syncbn_lab.report.collect import runs_from_csv

    floors = reference_noise(runs_from_csv(results_csv))
    if floors is None:
        from syncbn_lab.errors import UserError

        raise UserError(
            f"{results_csv} holds no runs of the reference variant to give a noise floor"
        )
    return floors


def significant_from(deltas: dict[int, Paired]) -> int | None:
    """The largest per-device batch from which every smaller one is significantly worse
    (``deltas``: per-device batch -> paired difference against the reference, positive =
    worse); None if not even the smallest is."""
    threshold = None
    for batch in sorted(deltas):  # smallest first
        d = deltas[batch]
        if not (d.significant and d.mean > 0):
            break
        threshold = batch
    return threshold


def recovered(bn_loss: float, variant_loss: float) -> float:
    """The fraction of BN's loss (its error above SyncBN's) that a variant wins back."""
    if math.isnan(bn_loss) or math.isnan(variant_loss) or bn_loss <= 0:
        return math.nan
    return 1.0 - variant_loss / bn_loss


def trend(ordered: list[dict[int, float]]) -> Paired:
    """Whether a value grows along ``ordered`` cells (each seed -> value), seeds as blocks:
    each seed's least-squares slope of its values against the cells' ranks, and a one-sample
    t-test of those slopes against 0 (two cells: the paired test of their difference)."""
    seeds = sorted(set.intersection(*(set(c) for c in ordered))) if ordered else []
    ranks = range(len(ordered))
    centre = statistics.fmean(ranks)
    spread = sum((r - centre) ** 2 for r in ranks)
    slopes = {
        s: sum((r - centre) * cell[s] for r, cell in zip(ranks, ordered, strict=True)) / spread
        for s in seeds
    }
    return paired(slopes, dict.fromkeys(slopes, 0.0))


def spearman(x: list[float], y: list[float]) -> tuple[float, float]:
    """Spearman's rank correlation of ``x`` and ``y`` and its two-sided p, exact (every
    permutation of y's ranks) for up to 9 pairs, else the t approximation; nan below 3 pairs
    or for a constant side."""
    from itertools import permutations

    import numpy as np
    from scipy import stats

    n = len(x)
    cx, cy = (stats.rankdata(v) - (n + 1) / 2 for v in (x, y))
    scale = math.sqrt(float(cx @ cx) * float(cy @ cy))
    if n < 3 or scale == 0:
        return math.nan, math.nan
    rho = float(cx @ cy) / scale
    if n > 9:
        return rho, float(stats.spearmanr(x, y).pvalue)
    every = np.array(list(permutations(cy))) @ cx / scale
    return rho, float(np.mean(np.abs(every) >= abs(rho) - 1e-12))
