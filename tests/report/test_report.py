"""The report from run dirs written by the test (a fake sweep with known numbers)."""

import csv
import json
import statistics

import pytest

from syncbn_lab.errors import UserError
from syncbn_lab.report import collect_runs, write_report


def fake_run(root, bn, devices, seed, test_acc, precise=None, parallel="emulated", loss=0.1):
    run_dir = root / f"{bn}_{parallel}{devices}_s{seed}"
    run_dir.mkdir(parents=True)
    summary = dict(
        bn=bn,
        parallel=parallel,
        devices=devices,
        per_device_batch_size=64 // devices,
        global_batch_size=64,
        seed=seed,
        test_acc=test_acc,
        test_acc_precise_bn=precise,
        train_loss=loss,
        steps=10,
        wall_time_s=1.0,
        dataset="mnist",
        model="resnet8",
    )
    (run_dir / "summary.json").write_text(json.dumps(summary))
    steps = [{"step": s, "train/loss": loss * (11 - s)} for s in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, steps)) + "\n")


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    accs = {
        ("bn", 1): [99.0, 99.2, 99.1],
        ("bn", 64): [80.0, 75.0, 70.0],
        ("sync", 1): [99.0, 99.2, 99.1],
        ("sync", 64): [99.1, 99.0, 99.2],
    }
    for (bn, devices), values in accs.items():
        for seed, acc in enumerate(values):
            fake_run(root, bn, devices, seed, acc, precise=acc + 1 if bn == "bn" else acc)
    for seed in range(3):
        fake_run(root, "gn", 1, seed, 98.5)
    (root / "unfinished").mkdir()  # no summary.json: skipped
    fake_run(tmp_path / "ddp", "sync", 64, 0, 99.1, parallel="ddp", loss=0.1 + 1e-7)
    return tmp_path


def test_report_tables_csv_and_plots(sweep):
    runs = collect_runs(sweep / "sweep", sweep / "ddp")
    assert len(runs) == 16
    out = sweep / "report"
    write_report(runs, out, "Test report", sweep_wall_time_s=600)
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 16
    assert {
        "bn",
        "parallel",
        "devices",
        "per_device_batch_size",
        "global_batch_size",
        "seed",
        "test_acc",
        "test_acc_precise_bn",
        "train_loss",
        "wall_time_s",
    } <= rows[0].keys()
    text = (out / "README.md").read_text()
    # bn at 1 image per device: errors 20, 25, 30 -> 25.00 ± 5.00; PreciseBN 24.00 ± 5.00
    errors = [100 - a for a in (80.0, 75.0, 70.0)]
    assert f"{statistics.fmean(errors):.2f} ± {statistics.stdev(errors):.2f}" in text
    assert "24.00 ± 5.00" in text
    assert "10.0 minutes" in text
    assert "| bn | 64 | 1 | 3 | +24.10 |" in text  # paired against devices=1, same seeds
    # per-device BN, errors by images per device: 64 -> (1.0, 0.8, 0.9), 1 -> (20, 25, 30)
    assert "Per-device BN** test error by images per device: 0.90 % at 64, 25.00 % at 1." in text
    assert "Real DDP against the emulation" in text and "| sync | 64 | 0 | 99.10 | 99.10 |" in text
    assert "| 1.0e-06 | 1.0e-06 |" in text  # final and first-step relative loss gaps
    assert "SyncBN does not depend on the device count** — holds" in text
    for png in ("test_error_vs_per_device_batch.png", "train_loss_curves.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_runs_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no finished runs"):
        collect_runs(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        collect_runs(tmp_path / "missing")
