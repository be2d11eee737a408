"""The committed converged study (reports/bn_vs_syncbn/) is one full sweep of
experiment=bn_vs_syncbn on one commit, its README's tables agree with its results.csv, and
docs/results.md quotes its figures: all recomputed here from the CSV and the experiment's
YAML, not copied (test_committed_reports.py renders it from its runs)."""

import csv
import itertools
import statistics
from collections import defaultdict

import yaml
from conftest import ROOT

REPORT = ROOT / "reports" / "bn_vs_syncbn"
EXPERIMENT = ROOT / "configs" / "experiment" / "bn_vs_syncbn.yaml"
KEYS = ("bn", "parallel", "parallel.devices", "trainer.accumulate", "trainer.seed")


def rows():
    with open(REPORT / "results.csv") as f:
        return list(csv.DictReader(f))


def declared_runs() -> dict[tuple[str, ...], int | None]:
    """Every run the experiment's YAML declares, read without Hydra: the grid
    (hydra.sweeper.params), then each of sweep.parts overriding the grid's values; mapped to
    its trainer.max_steps (None: the whole run)."""
    experiment = yaml.safe_load(EXPERIMENT.read_text())
    grid = {k: str(v).split(",") for k, v in experiment["hydra"]["sweeper"]["params"].items()}
    grid |= {"parallel": ["emulated"], "trainer.accumulate": ["1"], "trainer.max_steps": [None]}
    runs = {}
    for part in [[], *experiment["sweep"]["parts"].values()]:
        values = dict(grid)
        for override in part:
            key, value = override.split("=", 1)
            values[key] = value.split(",")
        for combo in itertools.product(*(values[k] for k in (*KEYS, "trainer.max_steps"))):
            runs[combo[:-1]] = None if combo[-1] is None else int(combo[-1])
    return runs


def test_results_csv_is_the_whole_declared_sweep_on_one_commit():
    declared = declared_runs()
    found = {}
    for r in rows():
        key = (r["bn"], r["parallel"], r["devices"], r["accumulate"], r["seed"])
        assert key not in found, key
        found[key] = int(r["steps"])
        assert "/" not in r["run_dir"]
    assert set(found) == set(declared)
    epochs = yaml.safe_load(EXPERIMENT.read_text())["trainer"]["epochs"]
    for key, steps in found.items():
        max_steps = declared[key]
        # 50,000 images at a global batch of 64: 781 steps an epoch, 782 where the sampler
        # pads to a multiple of 64 devices
        assert steps == max_steps if max_steps else steps in (781 * epochs, 782 * epochs), key
    assert len({r["git_commit"] for r in rows()}) == 1  # the whole sweep on one commit


def test_the_error_table_is_the_csv_mean_and_std():
    cells = defaultdict(list)
    for r in rows():
        if r["parallel"] == "emulated" and r["bn"] != "gn":
            for stats, column in (("EMA", "test_error"), ("PreciseBN", "test_error_precise_bn")):
                cells[(f"{r['bn']} ({stats})", r["per_device_batch_size"])].append(float(r[column]))
    table = (REPORT / "README.md").read_text().split("## Test error")[1].split("\n## ")[0]
    lines = [line.strip("|").split(" | ") for line in table.splitlines() if line.startswith("|")]
    header, body = [c.strip() for c in lines[0]], {line[0].strip(): line for line in lines[2:]}
    assert len(cells) > 20
    for (column, batch), errors in cells.items():
        assert len(errors) == 3
        cell = f"{statistics.fmean(errors):.2f} ± {statistics.stdev(errors):.2f}"
        assert body[batch][header.index(column)].strip() == cell, (column, batch)


def test_bn_at_64_images_per_device_is_trained_and_the_results_page_quotes_the_study():
    bn = defaultdict(list)
    for r in rows():
        if r["parallel"] == "emulated" and r["bn"] == "bn":
            bn[int(r["per_device_batch_size"])].append(float(r["test_error"]))
    assert statistics.fmean(bn[64]) <= 8.5  # the study's bar for a converged model
    section = (ROOT / "docs" / "results.md").read_text()
    for batch in (64, 2, 1):
        assert f"{statistics.fmean(bn[batch]):.2f} %" in section, batch
    wall = (REPORT / "README.md").read_text().split("The sweep took ")[1].split(" min")[0]
    assert f"{wall} min" in section
    assert float(wall) <= 120  # the budget of the study
