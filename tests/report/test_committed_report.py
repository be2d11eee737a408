"""The committed Fashion-MNIST report agrees with its own results.csv, and docs/results.md quotes
its figures: recomputed here from the CSV, not copied."""

import csv
import statistics
from collections import defaultdict

from conftest import ROOT

REPORT = ROOT / "reports" / "bn_vs_syncbn_1epoch"


def rows():
    with open(REPORT / "results.csv") as f:
        return list(csv.DictReader(f))


def test_results_csv_is_the_whole_sweep_without_machine_paths():
    runs = rows()
    cells = defaultdict(int)
    for r in runs:
        cells[(r["bn"], r["parallel"])] += 1
        assert "/" not in r["run_dir"] and r["git_commit"]
    assert cells == {
        ("bn", "emulated"): 28, ("sync", "emulated"): 28, ("brn", "emulated"): 16,
        ("gn", "emulated"): 4, ("bn", "ddp"): 2, ("sync", "ddp"): 2, ("brn", "ddp"): 1,
        ("gn", "ddp"): 1,
    }  # fmt: skip
    ddp = [r for r in runs if r["parallel"] == "ddp"]
    assert all(float(r["comm_gradients_bytes_per_step"]) > 0 for r in ddp)


def test_the_error_table_is_the_csv_mean_and_std():
    cells = defaultdict(list)
    for r in rows():
        if r["parallel"] == "emulated" and r["bn"] != "gn":
            cells[(r["bn"], int(r["per_device_batch_size"]))].append(float(r["test_error"]))
    text = (REPORT / "README.md").read_text()
    table = text.split("## Test error")[1].split("\n## ")[0]
    lines = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if "|" in line}
    for (bn, batch), errors in cells.items():
        assert len(errors) == 4
        cell = f"{statistics.fmean(errors):.2f} ± {statistics.stdev(errors):.2f}"
        assert cell in lines[str(batch)], (bn, batch, cell)


def test_the_results_page_quotes_the_committed_figures():
    bn = defaultdict(list)
    for r in rows():
        if r["parallel"] == "emulated" and r["bn"] == "bn":
            bn[int(r["per_device_batch_size"])].append(float(r["test_error"]))
    section = (ROOT / "docs" / "results.md").read_text()
    for batch in (64, 4, 2):
        assert f"{statistics.fmean(bn[batch]):.2f} %" in section
    wall = (REPORT / "README.md").read_text().split("The sweep took ")[1].split(" min")[0]
    assert f"{wall} min" in section
