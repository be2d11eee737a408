"""The calibration of the study's length (report/calibration.py): the plateau is where every
later doubling changes the mean test error by less than the noise of a difference, against
error curves written out by hand; and the committed report is what the module computes from
its own results.csv."""

import csv
import math

import pytest
from conftest import ROOT

from syncbn_lab.report import calibration

FLOOR = 0.30  # pp per run: the noise of a difference is 0.42 pp
OFFSETS = (0.10, -0.15, 0.05)  # each seed's own shift, the same at every length


def runs(curve: dict[int, float], devices: int = 1) -> list[dict]:
    return [
        {"devices": devices, "epochs": e, "seed": s, "steps": 781 * e,
         "test_acc": 100 - (error + OFFSETS[s] + 0.01 * e * (s - 1)),
         "test_acc_precise_bn": None, "train_loss": 0.5 / e, "train_time_s": 30.0 * e}
        for e, error in curve.items() for s in range(3)
    ]  # fmt: skip


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
    assert calibration.plateau(runs(curve), 1, FLOOR) == expected


def test_doublings_are_paired_by_seed():
    (_, _, delta), *_ = calibration.doublings(runs({1: 12.0, 2: 9.5}), 1)
    assert delta.n == 3 and math.isclose(delta.mean, -2.5, abs_tol=1e-9)
    assert math.isclose(delta.std, 0.01, abs_tol=1e-9)  # the seeds' own shifts cancel


def test_render_states_each_doubling_and_the_plateau():
    text = calibration.render(
        runs({1: 12.0, 2: 9.5, 4: 8.0, 8: 7.8}) + runs({1: 14.0, 2: 11.0, 4: 9.0, 8: 8.0}, 32),
        FLOOR, dict.fromkeys(("command", "commit", "machine", "wall"), "x"),
    )  # fmt: skip
    assert "| 64 | 4 → 8 | -0.20 ± 0.04 (n=3) |" in text and "within the noise" in text
    assert "| 2 | 4 → 8 | -1.00 ± 0.04 (n=3) |" in text and "beyond the noise" in text
    assert "- 64 images per device: from 4 epochs on." in text
    assert "- 2 images per device: not yet at 8 epochs" in text


def test_the_small_batch_is_set_against_the_large_one_at_each_length():
    """2 images per device against 64, paired by seed: worse by 2.0 at 1 epoch (every seed),
    0.2 at 8 with seed-dependent noise (not detected), better at 16."""
    large = runs({1: 12.0, 8: 7.8, 16: 7.6})
    small = runs({1: 14.0, 8: 8.0, 16: 7.1}, 32)
    for run, jitter in zip([r for r in small if r["epochs"] == 8], (0.4, -0.5, 0.3), strict=True):
        run["test_acc"] -= jitter
    deltas = dict(calibration.smallest_against_largest(large + small))
    assert sorted(deltas) == [1, 8, 16]
    assert math.isclose(deltas[1].mean, 2.0, abs_tol=1e-9) and deltas[1].n == 3
    assert [calibration.reading(deltas[e]) for e in (1, 8, 16)] == [
        "worse",
        "no difference detected",
        "better",
    ]
    text = calibration.render(
        large + small, FLOOR, dict.fromkeys(("command", "commit", "machine", "wall"), "x")
    )
    assert "| 1 | +2.00 ± 0.00 (n=3) | 0.000 | worse |" in text
    assert "| 16 | -0.50 ± 0.00 (n=3) | 0.000 | better |" in text


def test_render_names_the_experiment_and_its_global_batch():
    text = calibration.render(
        runs({1: 12.0, 2: 11.0}) + runs({1: 14.0, 2: 13.0}, 128), FLOOR,
        dict.fromkeys(("command", "commit", "machine", "wall"), "x"), "nbs_256", 256,
    )  # fmt: skip
    assert "`experiment=nbs_256` (resnet8, global batch 256," in text
    assert "| 256 | 1 → 2 |" in text and "| 2 | 1 → 2 |" in text


@pytest.mark.parametrize(
    "name, experiment, global_batch",
    [("calibration_epochs", "bn_vs_syncbn", 64), ("calibration_nbs_256", "nbs_256", 256)],
)
def test_the_committed_readme_is_computed_from_its_csv(name, experiment, global_batch):
    report = ROOT / "reports" / name
    from syncbn_lab.report.fast import study_noise_floor

    numeric = {"devices": int, "epochs": int, "seed": int, "steps": int}
    with open(report / "results.csv") as f:
        rows = [
            {k: numeric[k](v) if k in numeric else (float(v) if v else None) if k != "git_commit"
             else v for k, v in row.items() if k != "per_device_batch_size"}
            for row in csv.DictReader(f)
        ]  # fmt: skip
    floor = study_noise_floor(ROOT / "reports" / "bn_vs_syncbn_1epoch" / "results.csv")[
        "test_error"
    ]
    meta = dict.fromkeys(("command", "commit", "machine", "wall"), "x")
    rendered = calibration.render(rows, floor, meta, experiment, global_batch)
    text = (report / "README.md").read_text()
    table_lines = [line for line in rendered.splitlines() if line.startswith(("| ", "- "))]
    assert len(table_lines) > 10
    for line in table_lines:
        assert line in text, line
