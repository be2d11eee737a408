"""The report's test-error plot against the normalisation batch (``--x``), from run dirs with
known numbers: bn's points move with the per-device batch, SyncBN's all sit at the global batch."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from syncbn_lab.errors import UserError
from syncbn_lab.report import collect_runs, write_report
from syncbn_lab.report import write as write_mod

ROOT = Path(__file__).resolve().parents[2]


def fake_run(root: Path, bn: str, devices: int, seed: int, acc: float, normalization=True):
    run_dir = root / f"{bn}_emulated{devices}_s{seed}"
    run_dir.mkdir(parents=True)
    per_device = 64 // devices
    summary = {
        "bn": bn, "parallel": "emulated", "devices": devices, "per_device_batch_size": per_device,
        "global_batch_size": 64, "seed": seed, "test_acc": acc, "test_loss": 0.1,
        "val_acc": acc, "best_val_acc": acc, "train_loss": 0.1, "epochs": 1, "steps": 10,
        "wall_time_s": 1.0, "dataset": "fashion_mnist", "model": "resnet8",
    }  # fmt: skip
    if normalization:
        summary["normalization_batch_size"] = {"bn": per_device, "sync": 64, "gn": 1}[bn]
    (run_dir / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def sweep(tmp_path):
    accs = {("bn", 1): 90.0, ("bn", 4): 89.0, ("bn", 32): 60.0, ("sync", 1): 90.0,
            ("sync", 4): 90.4, ("sync", 32): 90.2, ("gn", 1): 88.0}  # fmt: skip
    for (bn, devices), acc in accs.items():
        for seed in range(2):
            fake_run(tmp_path / "sweep", bn, devices, seed, acc + seed / 10)
    return tmp_path


def plotted(monkeypatch, runs, out, x_axis):
    """{label: (xs, ys)} of the error bars the test-error plot draws."""
    import matplotlib.axes

    seen = {}
    original = matplotlib.axes.Axes.errorbar

    def record(self, xs, ys, *args, label=None, **kwargs):
        seen[label] = (list(xs), [round(y, 6) for y in ys])
        return original(self, xs, ys, *args, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", record)
    write_report(runs, out, "t", x_axis=x_axis)
    return seen


def test_plot_against_the_normalisation_batch(sweep, monkeypatch):
    runs = collect_runs(sweep / "sweep")
    by_norm = plotted(monkeypatch, runs, sweep / "norm", "normalization_batch_size")
    assert by_norm["bn (EMA)"] == ([2, 16, 64], [39.95, 10.95, 9.95])
    assert by_norm["sync (EMA)"] == ([64], [round(100 - (90.0 + 90.4 + 90.2) / 3 - 0.05, 6)])
    assert (sweep / "norm" / "test_error_vs_normalization_batch.png").is_file()
    by_device = plotted(monkeypatch, runs, sweep / "dev", "per_device_batch_size")
    assert by_device["sync (EMA)"][0] == [2, 16, 64]  # the default: one point per device count
    assert (sweep / "dev" / "test_error_vs_per_device_batch.png").is_file()
    with open(sweep / "norm" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["bn"], r["devices"], r["normalization_batch_size"]) for r in rows} >= {
        ("bn", "4", "16"), ("sync", "4", "64"), ("gn", "1", "1")}  # fmt: skip


def test_runs_without_the_key_are_refused_before_anything_is_written(sweep):
    fake_run(sweep / "sweep", "bn", 2, 0, 90.0, normalization=False)
    runs = collect_runs(sweep / "sweep")
    with pytest.raises(UserError, match="1 run.* no normalization_batch_size.*--x per_device"):
        write_report(runs, sweep / "out", "t", x_axis="normalization_batch_size")
    assert not (sweep / "out").exists()
    with pytest.raises(UserError, match="unknown x axis 'steps'"):
        write_report(runs, sweep / "out", "t", x_axis="steps")
    assert set(write_mod.X_AXES) == {"per_device_batch_size", "normalization_batch_size"}


def test_command_line_option(sweep):
    out = sweep / "cli"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/report.py"), str(sweep / "sweep"), "--out", str(out),
         "--x", "normalization_batch_size"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (out / "test_error_vs_normalization_batch.png").is_file()
    assert "test_error_vs_normalization_batch.png" in (out / "README.md").read_text()
