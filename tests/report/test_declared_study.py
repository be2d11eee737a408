"""A study declared in its experiment alone (``sweep.report``, writer cells): cells named by a
config key of the runs (model.width) as a capacity or depth study names them, a paired
comparison per configuration, against differences planted by hand; how a comparison picks the
cell it measures against (max, min, below, same, role), and the one-line errors of a
declaration that cannot name its cells."""

import json
import math
import statistics

import pytest
import yaml
from conftest import ROOT
from omegaconf import OmegaConf
from scipy import stats

from syncbn_lab.errors import UserError
from syncbn_lab.report import Source, collect_runs, render, spec_of
from syncbn_lab.report.cells import Cell, Cells
from syncbn_lab.report.collect import Run
from syncbn_lab.report.spec import declared

# As nbs_capacity.yaml would declare its report (the keys configs/config.yaml does not default)
CAPACITY = """
writer: cells
title: Capacity at a fixed global batch
cells: [model.width, normalization_batch_size]
comparisons:
  penalty:  # normalisation batch 2 against 256, at each width
    cells: {normalization_batch_size: 2}
    against: {normalization_batch_size: 256}
    same: [model.width]
noise_floor: reports/bn_vs_syncbn/results.csv
columns: [bn, model.width, devices, normalization_batch_size, seed, test_error, train_loss, run_dir]
"""
PENALTY = {4: (1.3, (0.1, -0.1, 0.05, -0.05)), 8: (0.5, (0.2, -0.2, 0.0, 0.0))}  # pp, by seed


def capacity(report=CAPACITY):
    """nbs_capacity's report as ``report`` declares it (nbs_256's other keys)."""
    inherited = OmegaConf.to_container(spec_of("nbs_capacity").config.sweep.report)
    return declared("nbs_capacity", {**inherited, "comparisons": {}, **yaml.safe_load(report)},
                    spec_of("nbs_capacity").config)  # fmt: skip


@pytest.fixture
def sweep(tmp_path):
    """resnet8 at widths 4 and 8, bn on 1 and 128 devices, 4 seeds: run dirs with the
    summary.json and config.yaml a run writes; at 2 images the planted penalty."""
    for width, (penalty, by_seed) in PENALTY.items():
        for devices, batch in ((1, 256), (128, 2)):
            for seed in range(4):
                error = 9.0 - width / 4 + 0.1 * seed + (penalty + by_seed[seed]) * (batch == 2)
                run_dir = tmp_path / f"w{width}_bn_emulated{devices}_s{seed}"
                run_dir.mkdir()
                summary = {"bn": "bn", "devices": devices, "normalization_batch_size": batch,
                           "seed": seed, "test_acc": 100 - error, "train_loss": 0.2 / width,
                           "steps": 9, "model": "resnet8", "dataset": "fashion_mnist",
                           "global_batch_size": 256, "parallel": "emulated"}  # fmt: skip
                (run_dir / "summary.json").write_text(json.dumps(summary))
                config = {"model": {"name": "resnet8", "width": width}}
                OmegaConf.save(config, run_dir / "config.yaml")
    return tmp_path


def test_a_penalty_per_width_as_declared(sweep, tmp_path):
    source = Source(capacity(), collect_runs(sweep), "python scripts/report.py x")
    out = tmp_path / "report"
    assert render(source, out) == ["README.md", "results.csv"]
    text = (out / "README.md").read_text()
    assert text.startswith("# Capacity at a fixed global batch\n")
    for width, (penalty, by_seed) in PENALTY.items():
        diffs = [penalty + e for e in by_seed]
        mean, std = statistics.fmean(diffs), statistics.stdev(diffs)
        half = stats.t.ppf(0.975, 3) * std / 2
        row = (f"| model.width={width}, normalization_batch_size=2 | "
               f"model.width={width}, normalization_batch_size=256 | {mean:+.2f} ± {std:.2f} | "
               f"{mean - half:+.2f} to {mean + half:+.2f} | "
               f"{stats.ttest_1samp(diffs, 0).pvalue:.2g} | ")  # fmt: skip
        assert row in text, row
    assert f"| {4} | 256 | 4/4 |" in text
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0].split(",") == yaml.safe_load(CAPACITY)["columns"]
    assert rows[1].startswith("bn,4,128,2,0,") and len(rows) == 17


def test_cells_that_do_not_tell_the_runs_apart_are_one_line(sweep):
    runs = collect_runs(sweep)
    report = CAPACITY.replace(
        "[model.width, normalization_batch_size]", "[normalization_batch_size]"
    )
    report = report.replace("same: [model.width]", "same: []")
    with pytest.raises(UserError, match="several runs of one seed; name what tells them apart"):
        Cells(capacity(report), runs)
    with pytest.raises(UserError, match="names model.depth, which is no cell key"):
        capacity(CAPACITY.replace("same: [model.width]", "same: [model.depth]"))


def cells_of(spec, points):
    runs = [Run(ROOT, {**dict(zip(spec.cells, values, strict=True)), "seed": 0, "test_acc": 90})
            for values in points]  # fmt: skip
    return Cells(spec, runs)


def test_a_comparison_picks_max_min_below_and_shares_its_same_keys():
    spec = spec_of("calibration_epochs")  # cells devices, epochs
    cells = cells_of(spec, [(d, e) for d in (1, 32) for e in (1, 2, 8)])
    at = lambda d, e: Cell((d, e), spec.cells)  # noqa: E731
    assert cells.pairs("doublings") == [(at(1, 2), at(1, 1)), (at(1, 8), at(1, 2)),
                                        (at(32, 2), at(32, 1)), (at(32, 8), at(32, 2))]  # fmt: skip
    assert cells.pairs("small_against_large") == [(at(32, e), at(1, e)) for e in (1, 2, 8)]


def test_role_asks_the_variant_spec_and_a_cell_is_not_measured_against_itself():
    spec = spec_of("nbs_256")  # cells normalization_batch_size, bn, devices
    cells = cells_of(spec, [(256, "bn", 1), (32, "bn", 8), (2, "bn", 128), (32, "sync", 128),
                            (32, "brn", 8)])  # fmt: skip
    at = lambda *v: Cell(v, spec.cells)  # noqa: E731
    assert cells.pairs("whole_batch") == [(at(2, "bn", 128), at(256, "bn", 1)),
                                          (at(32, "bn", 8), at(256, "bn", 1))]  # fmt: skip
    assert cells.pairs("same_devices") == [(at(32, "sync", 128), at(2, "bn", 128))]
    # brn is a remedy, not the baseline: it is not a cell sync is measured against
    assert cells.pairs("same_batch") == [(at(32, "sync", 128), at(32, "bn", 8))]
    ambiguous = cells_of(spec, [(32, "bn", 8), (32, "bn", 16), (32, "sync", 128)])
    with pytest.raises(UserError, match="finds 2 cells to measure"):
        ambiguous.pairs("same_batch")
    assert math.isnan(ambiguous.against(at(32, "bn", 8), at(32, "bn", 16)).p)  # one seed


def test_a_plain_multirun_of_no_experiment_gets_the_default_report(tmp_path):
    """Runs of `train.py -m` without an experiment (study: default) report through the
    declaration of configs/config.yaml, with no --experiment to pass."""
    import subprocess
    import sys

    from conftest import ROOT, TINY, compose_config

    from syncbn_lab.train import run

    sweep = tmp_path / "sweep"
    for i, bn in enumerate(("bn", "sync")):
        cfg = compose_config([*TINY, f"bn={bn}", "parallel=emulated", "parallel.devices=2",
                              "trainer.max_steps=2", "trainer.threads=1"])  # fmt: skip
        run(cfg, sweep / f"{i}_{bn}")
    report = [sys.executable, str(ROOT / "scripts" / "report.py"), str(sweep)]
    done = subprocess.run(
        [*report, "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    title = (tmp_path / "r" / "README.md").read_text().splitlines()[0]
    assert title == "# BatchNorm vs SyncBatchNorm across device counts"
