"""The arms report (report/fast.py, experiment=fast_vs_fp32's declaration): the same cells in
two configurations told apart by a label of the runs' config, paired by seed, against planted
effects; Holm's adjustment against its definition; the committed check has every cell and
seed in both arms."""

import csv
import math
import statistics
from pathlib import Path

import pytest
from conftest import ROOT
from omegaconf import OmegaConf
from planted import source
from scipy import stats

from syncbn_lab.report import fast
from syncbn_lab.report.collect import Run
from syncbn_lab.report.verdicts import against_noise

CELLS = (("bn", 1), ("bn", 8), ("bn", 32), ("sync", 8))


def runs_with(shift_pp: float, noise: list[float]) -> list[Run]:
    """Every cell and seed in both arms, each run's arm in its config (trainer.precision):
    fast = fp32 + shift + noise[seed] in test error."""
    runs = []
    for bn, devices in CELLS:
        for seed, eps in enumerate(noise):
            base = 12.0 + devices / 10 + 0.1 * seed
            for precision, error in (("fp32", base), ("bf16", base + shift_pp + eps)):
                summary = {"bn": bn, "devices": devices, "per_device_batch_size": 64 // devices,
                           "seed": seed, "test_acc": 100 - error,
                           "test_acc_precise_bn": 100 - error, "train_loss": 0.5 + error / 100,
                           "train_time_s": 100.0 if precision == "fp32" else 40.0,
                           "wall_time_s": 150.0 if precision == "fp32" else 75.0}  # fmt: skip
                config = OmegaConf.create({"trainer": {"precision": precision}})
                runs.append(Run(Path(f"{bn}{devices}_{seed}_{precision}"), summary, config=config))
    return runs


def cells(runs):
    return source("fast_vs_fp32", runs).cells()


def test_the_arms_are_the_label_of_each_runs_config_and_pair_cell_by_cell():
    found = cells(runs_with(0.0, [0.0, 0.0]))
    pairs = found.pairs(fast.COMPARISON)
    assert [(a.values, b.values) for a, b in pairs] == [
        ((bn, d, "fast"), (bn, d, "fp32")) for bn, d in CELLS
    ]


def test_a_planted_shift_is_found_and_named_beyond_the_noise():
    delta = fast.pooled(cells(runs_with(1.0, [0.05, -0.05, 0.02])), "test_error")
    diffs = [1.05, 0.95, 1.02] * len(CELLS)
    assert delta.mean == pytest.approx(statistics.fmean(diffs))
    assert delta.p == pytest.approx(stats.ttest_1samp(diffs, 0).pvalue)
    assert against_noise(delta, math.sqrt(2) * 0.29) == "differs"
    small = fast.pooled(cells(runs_with(0.2, [0.01, -0.01, 0.0])), "test_error")
    assert against_noise(small, math.sqrt(2) * 0.29) == "differs, by less than the noise"


def test_no_shift_is_within_the_noise_and_the_times_are_paired():
    runs = runs_with(0.0, [0.1, -0.2, 0.1])
    found = cells(runs)
    assert fast.speed(found, "train_time_s") == (100.0, 40.0, 2.5)
    study = source("fast_vs_fp32", runs)
    text = fast.markdown(study, study.cells())
    assert "| bn | 8 | 8 | test error |" in text and "2.50x" in text
    bn_rows = ("| bn | 1 ", "| bn | 8 ", "| bn | 32 ")
    rows = [line for line in text.splitlines() if line.startswith(bn_rows)]
    assert len(rows) == 3 * 3 and all(row.endswith("| within the noise |") for row in rows)
    assert "The fast configuration (bf16 autocast, channels_last) against fp32" in text


def test_holm_against_its_definition():
    ps = [0.01, 0.04, 0.03, math.nan, 0.5]
    # sorted 0.01, 0.03, 0.04, 0.5 (4 tests): 0.04, 0.09, max(0.09, 0.08), 0.5
    expected = [0.04, 0.09, 0.09, math.nan, 0.5]
    for got, want in zip(fast.holm(ps), expected, strict=True):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want)


def test_the_committed_check_has_every_cell_and_seed_in_both_arms():
    with open(ROOT / "reports" / "fast_vs_fp32" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    arms = {arm: {(r["bn"], r["devices"], r["seed"]) for r in rows if r["arm"] == arm}
            for arm in ("fast", "fp32")}  # fmt: skip
    assert arms["fast"] == arms["fp32"] and len(rows) == 2 * len(arms["fast"])
    assert {(bn, int(d)) for bn, d, _ in arms["fast"]} == set(CELLS)
    assert len({s for _, _, s in arms["fast"]}) >= 3
