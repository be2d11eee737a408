"""The calibration of a study's length (report/calibration.py, experiment=calibration_epochs's
declaration): each doubling paired by seed, the plateau where every later doubling changes the
mean test error by at most the noise of a difference, and the most devices against the fewest
at each length, against error curves written out by hand."""

import math
import statistics
from pathlib import Path

import pytest
from planted import source
from scipy import stats

from syncbn_lab.report import calibration
from syncbn_lab.report.collect import Run

NOISE = 0.42  # pp: the noise of a difference of two runs
OFFSETS = (0.10, -0.15, 0.05)  # each seed's own shift, the same at every length


def runs(curve: dict[int, float], devices: int = 1) -> list[Run]:
    return [
        Run(Path(f"{devices}_{e}_{s}"), {
            "devices": devices, "per_device_batch_size": 64 // devices, "epochs": e, "seed": s,
            "steps": 781 * e, "test_acc": 100 - (error + OFFSETS[s] + 0.01 * e * (s - 1)),
            "test_acc_precise_bn": None, "train_loss": 0.5 / e, "train_time_s": 30.0 * e})
        for e, error in curve.items() for s in range(3)
    ]  # fmt: skip


def cells(found: list[Run]):
    return source("calibration_epochs", found).cells()


@pytest.mark.parametrize(
    "curve, expected",
    [
        ({1: 12.0, 2: 9.5, 4: 8.0, 8: 7.8, 16: 7.7}, 4),  # -2.5, -1.5, then -0.2, -0.1
        ({1: 12.0, 2: 9.5, 4: 8.0, 8: 7.3}, None),  # the last doubling still -0.7
        ({1: 8.0, 2: 7.9, 4: 8.5, 8: 8.4}, 4),  # within, beyond (+0.6), within: from 4
        ({1: 8.0, 2: 8.1, 4: 7.9}, 1),
    ],
)
def test_the_plateau_starts_where_every_later_doubling_is_within_the_noise(curve, expected):
    assert calibration.plateau(calibration.doublings(cells(runs(curve)))[1], NOISE) == expected


def test_doublings_pair_each_length_with_the_next_shorter_one_by_seed():
    steps = calibration.doublings(cells(runs({1: 12.0, 2: 9.5, 8: 7.0})))[1]
    assert [(short, long) for short, long, _ in steps] == [(1, 2), (2, 8)]
    (_, _, delta), *_ = steps
    assert delta.n == 3 and math.isclose(delta.mean, -2.5, abs_tol=1e-9)
    assert math.isclose(delta.std, 0.01, abs_tol=1e-9)  # the seeds' own shifts cancel


def test_the_report_states_each_doubling_the_small_batch_and_the_plateau():
    """2 images per device against 64, paired by seed: worse by 2.0 at 1 epoch (every seed),
    0.27 at 8 with seed-dependent noise (not significant), better at 16."""
    large = runs({1: 12.0, 8: 7.8, 16: 7.6})
    small = runs({1: 14.0, 8: 8.0, 16: 7.1}, 32)
    for run, jitter in zip([r for r in small if r["epochs"] == 8], (0.4, -0.5, 0.3), strict=True):
        run.summary["test_acc"] -= jitter
    study = source("calibration_epochs", large + small)
    text = calibration.markdown(study, study.cells())
    # 64 at 8 -> 16: -0.2 + 0.08 (s - 1) by seed; 2 at 1 -> 8: -6.0 + 0.07 (s - 1) + jitter
    p = stats.ttest_1samp([-0.28, -0.2, -0.12], 0).pvalue  # under 0.05, the mean under the noise
    row = f"| 64 | 8 → 16 | -0.20 ± 0.08 (n=3) | {p:.2g} | differs, by less than the noise |"
    assert row in text
    to_eight = [-6.0 + 0.07 * (s - 1) + j for s, j in enumerate((0.4, -0.5, 0.3))]
    p = stats.ttest_1samp(to_eight, 0).pvalue
    assert (f"| 2 | 1 → 8 | {statistics.fmean(to_eight):+.2f} ± {statistics.stdev(to_eight):.2f} "
            f"(n=3) | {p:.2g} | differs |") in text  # fmt: skip
    assert "| 1 | +2.00 ± 0.00 (n=3) | 0 | holds |" in text  # 2 images per device is worse
    at_eight = [0.6, -0.3, 0.5]  # 8.0 + jitter - 7.8 + the seeds' own shifts, which cancel
    p = stats.ttest_1samp(at_eight, 0).pvalue
    assert (f"| 8 | +0.27 ± {statistics.stdev(at_eight):.2f} (n=3) | {p:.2g} | "
            "not significant |") in text  # fmt: skip
    assert "| 16 | -0.50 ± 0.00 (n=3) | 0 | opposite |" in text
    assert "- 64 images per device: from 8 epochs on." in text
    assert "- 2 images per device: not yet at 16 epochs" in text
    assert "| 64 | 1 | 781 | 12.00 ± 0.13 | – | 0.5000 ± 0.0000 | 30 |" in text
    assert "bn (per-device BN) trained for 1, 8, 16 epochs with seeds 0, 1, 2" in text


def test_a_calibration_of_widths_names_them_and_reads_their_loss_ratio():
    """calibration_animal_mnist's declaration: widths beside the grid's 16, a SyncBN noise
    part and an extension of width 16 to 128 epochs; the table names each row's width and
    variant, the widths table divides each run's training loss by its test loss (mean ± std
    over seeds, computed here by hand)."""

    def run(bn, width, devices, epochs, seed, error, train, test):
        return Run(Path(f"{bn}{width}_{devices}_{epochs}_{seed}"), {
            "bn": bn, "parallel": "emulated", "model.width": width, "devices": devices,
            "epochs": epochs, "seed": seed,
            "per_device_batch_size": 256 // devices, "steps": 27 * epochs,
            "test_acc": 100 - error - 0.1 * seed, "test_acc_precise_bn": None,
            "train_loss": train * (1 + seed), "test_loss": test, "train_time_s": 1.0})  # fmt: skip

    found = [run("bn", 16, d, e, s, 3.0 - e / 64, 0.01, 0.1) for d in (1, 128) for e in (32, 64)
             for s in (0, 1)]  # fmt: skip
    found += [run("bn", 16, d, 128, s, 3.0, 0.01, 0.1) for d in (1, 128) for s in (0, 1)]
    found += [run("bn", 2, 1, 64, s, 7.0, 0.1, 0.25) for s in (0, 1)]
    found += [run("sync", 16, d, 64, s, 2.0 + 0.01 * d, 0.001, 0.1) for d in (2, 4) for s in (0, 1)]
    study = source("calibration_animal_mnist", found)
    text = calibration.markdown(study, study.cells())
    assert "| model.width | variant | images per device | epochs | steps |" in text
    assert "| 2 | bn | 256 | 64 | 1728 |" in text and "| 16 | sync | 64 | 64 | 1728 |" in text
    ratios = {2: [0.1 / 0.25, 0.2 / 0.25], 16: [0.01 / 0.1, 0.02 / 0.1]}
    for width, r in ratios.items():
        cell = f"{statistics.fmean(r):.3f} ± {statistics.stdev(r):.3f}"
        row = next(x for x in text.splitlines() if x.startswith(f"| {width} | 2 |"))
        assert row.endswith(f"| {cell} |"), (row, cell)
    # the length that trained both widths, not the longest (an extension of width 16 alone)
    assert "Each width over the whole batch (256 images per device) for 64 epochs" in text
    # 2.0 at 64 epochs, 3.0 at 128 (+1.00 every seed): longer training raises the error
    assert (
        "- 256 images per device: the error rises beyond the noise over the last doubling "
        "(64 → 128 epochs, +1.00 ± 0.00 pp): longer training raises it."
    ) in text
