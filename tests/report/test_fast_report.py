"""report/fast.py: the fast configuration's paired comparison, against planted effects and
against a hand-computed noise floor."""

import csv
import math
import statistics

import pytest
from scipy import stats

from syncbn_lab.report import fast


def runs_with(shift_pp: float, noise: list[float]) -> list[dict]:
    """Every cell and seed in both arms; fast = fp32 + shift + noise[seed] in test error."""
    runs = []
    for bn, devices in fast.CELLS:
        for seed, eps in enumerate(noise):
            base = 12.0 + devices / 10 + 0.1 * seed
            for arm, error in (("fp32", base), ("fast", base + shift_pp + eps)):
                runs.append({"arm": arm, "bn": bn, "devices": devices, "seed": seed,
                             "test_acc": 100 - error, "test_acc_precise_bn": 100 - error,
                             "train_loss": 0.5 + error / 100,
                             "train_time_s": 100.0 if arm == "fp32" else 40.0,
                             "wall_time_s": 150.0 if arm == "fp32" else 75.0})  # fmt: skip
    return runs


def test_a_planted_shift_is_found_and_named_beyond_the_noise():
    runs = runs_with(1.0, [0.05, -0.05, 0.02])
    delta = fast.pooled(runs, "test_error")
    diffs = [1.05, 0.95, 1.02] * len(fast.CELLS)
    assert delta.mean == pytest.approx(statistics.fmean(diffs))
    assert delta.p == pytest.approx(stats.ttest_1samp(diffs, 0).pvalue)
    assert fast.verdict(delta, floor=0.29) == "changed (significant)"
    assert fast.verdict(fast.pooled(runs_with(0.2, [0.01, -0.01, 0.0]), "test_error"), 0.29) == (
        "shifted within the noise (significant)"
    )


def test_no_shift_is_unchanged_and_the_times_are_paired():
    runs = runs_with(0.0, [0.1, -0.2, 0.1])
    for c in fast.compare(runs):
        assert fast.verdict(c.delta, floor=0.29) == "unchanged", c
    assert fast.speed(runs, "train_time_s") == (100.0, 40.0, 2.5)
    text = fast.render(runs, {m: 0.29 for m in fast.METRICS}, "bf16 autocast", {
        "command": "x", "commit": "abc", "machine": "m", "wall": "1 min"})  # fmt: skip
    assert "| bn | 8 | test error |" in text and "2.50x" in text


def test_noise_floor_is_the_pooled_within_seed_spread_of_sync(tmp_path):
    rows = []
    values = {0: [12.0, 12.4, 11.9], 1: [12.2, 12.6]}  # seed -> test error over device counts
    for seed, errors in values.items():
        for devices, error in zip((1, 2, 4), errors, strict=False):
            rows.append({"bn": "sync", "parallel": "emulated", "devices": devices, "seed": seed,
                         "test_acc": 100 - error, "test_acc_precise_bn": "",
                         "train_loss": error / 20, "run_dir": "x"})  # fmt: skip
    rows.append({**rows[0], "bn": "bn", "test_acc": 50})  # other variants do not count
    with (tmp_path / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    squares = sum((e - statistics.fmean(v)) ** 2 for v in values.values() for e in v)
    expected = math.sqrt(squares / (2 + 1))
    floor = fast.study_noise_floor(tmp_path / "results.csv")
    assert floor["test_error"] == pytest.approx(expected)
    assert floor["train_loss"] == pytest.approx(expected / 20)


def test_holm_against_its_definition():
    ps = [0.01, 0.04, 0.03, math.nan, 0.5]
    # sorted 0.01, 0.03, 0.04, 0.5 (4 tests): 0.04, 0.09, max(0.09, 0.08), 0.5
    expected = [0.04, 0.09, 0.09, math.nan, 0.5]
    for got, want in zip(fast.holm(ps), expected, strict=True):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want)
