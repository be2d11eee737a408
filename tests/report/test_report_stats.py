"""The report's statistics against independent computations: scipy's tests, and the two-way
ANOVA as a comparison of two least-squares fits."""

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from syncbn_lab.report import stats
from syncbn_lab.report.collect import Run
from syncbn_lab.report.text import fmt_paired


def runs_of(table: dict[tuple[int, int], float]) -> list[Run]:
    """(seed, devices) -> test error as Run records of sync runs."""
    return [
        Run(Path(f"s{seed}_d{devices}"), {"bn": "sync", "seed": seed, "devices": devices,
                                          "test_acc": 100.0 - err})
        for (seed, devices), err in table.items()
    ]  # fmt: skip


def test_paired_is_scipys_paired_t_test():
    a = {0: 10.0, 1: 11.5, 2: 10.7, 3: 12.0, 9: 50.0}  # seed 9 has no partner
    b = {0: 9.0, 1: 10.9, 2: 10.1, 3: 10.2}
    d = stats.paired(a, b)
    diffs = [a[s] - b[s] for s in range(4)]
    assert d.n == 4
    assert d.mean == pytest.approx(np.mean(diffs))
    assert d.std == pytest.approx(np.std(diffs, ddof=1))
    assert d.p == pytest.approx(
        scipy_stats.ttest_rel([a[s] for s in range(4)], list(b.values())).pvalue
    )
    assert d.significant == (d.p < 0.05)
    assert math.isnan(stats.paired({0: 1.0}, {0: 2.0}).p)  # one pair: no test
    assert stats.paired({}, b).n == 0


def test_a_paired_difference_reads_with_its_spread_and_one_seed_without():
    assert fmt_paired(stats.paired({0: 2.0, 1: 3.0}, {0: 1.0, 1: 1.0})) == "+1.50 ± 0.71"
    assert fmt_paired(stats.paired({0: 1.0}, {0: 1.25})) == "-0.25 (one seed)"  # not ± 0
    assert fmt_paired(stats.paired({}, {0: 1.0})) == "–"


def test_noise_floor_and_the_device_count_anova():
    rng = np.random.default_rng(0)
    seeds, devices = range(4), (1, 2, 4, 8, 16)
    seed_effect = {s: rng.normal(0, 1.0) for s in seeds}
    device_effect = {1: 0.0, 2: 0.1, 4: 0.0, 8: 1.5, 16: 0.2}
    table = {
        (s, d): 10 + seed_effect[s] + device_effect[d] + rng.normal(0, 0.3)
        for s in seeds
        for d in devices
    }
    floor = stats.noise_floor(runs_of(table), lambda r: 100.0 - r["test_acc"])

    x = np.array([[table[(s, d)] for d in devices] for s in seeds])
    within = x - x.mean(axis=1, keepdims=True)
    assert floor.df == len(seeds) * (len(devices) - 1)
    assert floor.std == pytest.approx(math.sqrt((within**2).sum() / floor.df))
    assert floor.spread == pytest.approx(np.ptp(x.mean(axis=0)))

    # the same F as comparing the least-squares fits seed + device and seed alone
    def rss(columns):
        design = np.column_stack([np.ones(x.size), *columns])
        fit = np.linalg.lstsq(design, x.ravel(), rcond=None)
        return ((x.ravel() - design @ fit[0]) ** 2).sum()

    seed_cols = [np.repeat(np.arange(4) == s, len(devices)) for s in range(1, 4)]
    dev_cols = [np.tile(np.arange(len(devices)) == j, 4) for j in range(1, len(devices))]
    full, reduced = rss(seed_cols + dev_cols), rss(seed_cols)
    df_res = x.size - 1 - len(seed_cols) - len(dev_cols)
    f = ((reduced - full) / len(dev_cols)) / (full / df_res)
    assert floor.f == pytest.approx(f)
    assert floor.p == pytest.approx(scipy_stats.f.sf(f, len(dev_cols), df_res))
    assert floor.p < 0.05  # the planted 1.5 pp effect at 8 devices is found

    flat = {key: 10 + seed_effect[key[0]] + rng.normal(0, 0.3) for key in table}
    assert stats.noise_floor(runs_of(flat), lambda r: 100.0 - r["test_acc"]).p > 0.05


def test_noise_floor_leaves_incomplete_seeds_out_of_the_anova_only():
    table = {(0, 1): 10.0, (0, 2): 10.4, (1, 1): 11.0, (1, 2): 11.2, (2, 1): 12.0}
    floor = stats.noise_floor(runs_of(table), lambda r: 100.0 - r["test_acc"])
    assert floor.df == 2 and floor.seeds == 3
    assert floor.std == pytest.approx(math.sqrt((0.2**2 * 2 + 0.1**2 * 2) / 2))
    assert not math.isnan(floor.f)  # seeds 0 and 1 are complete


def test_significant_from_is_the_batch_below_which_every_one_is_worse():
    def d(mean, p):
        return stats.Paired(mean, 0.1, 4, p)

    deltas = {32: d(0.5, 0.01), 16: d(0.1, 0.4), 8: d(0.6, 0.02), 4: d(1.0, 0.01), 1: d(9, 0.001)}
    assert stats.significant_from(deltas) == 8  # 16 is not significant, so it stops at 8
    assert stats.significant_from({1: d(-2.0, 0.001)}) is None  # better is not worse
    assert stats.significant_from({}) is None


def test_recovered_fraction():
    assert stats.recovered(2.0, 0.5) == pytest.approx(0.75)
    assert stats.recovered(2.0, -0.5) == pytest.approx(1.25)  # better than SyncBN
    assert math.isnan(stats.recovered(0.0, 0.5)) and math.isnan(stats.recovered(-1.0, 0.5))
