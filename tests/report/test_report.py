"""The report from run dirs written by the test (a fake sweep with known numbers)."""

import csv
import json
import statistics

import pytest

from syncbn_lab.errors import UserError
from syncbn_lab.report import collect_failures, collect_runs, write_report


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


def fake_failure(root, bn, devices, seed, reason, finished_later=False):
    """A run dir as syncbn_lab.multirun leaves a failed job (error.json with its cell)."""
    run_dir = root / f"{bn}_emulated{devices}_s{seed}_failed"
    run_dir.mkdir(parents=True)
    cell = dict(bn=bn, parallel="emulated", devices=devices, seed=seed)
    cell["per_device_batch_size"] = 64 // devices if 64 % devices == 0 else 64 / devices
    (run_dir / "error.json").write_text(json.dumps({"error": reason, **cell}))
    if finished_later:  # a resumed sweep finished it: not a failure any more
        (run_dir / "summary.json").write_text(json.dumps({**cell, "test_acc": 99.0, "steps": 9}))


def test_failed_runs_are_listed_and_their_cells_marked_missing(sweep):
    root = sweep / "sweep"
    fake_failure(root, "sync", 64, 3, "rank 1 failed: RuntimeError: boom")
    fake_failure(root, "bn", 2, 0, "rank 0 failed: RuntimeError: boom")
    fake_failure(root, "bn", 3, 0, "trainer.global_batch_size=64 is not divisible | by 3")
    fake_failure(root, "bn", 4, 0, "fixed by the resume", finished_later=True)
    (root / "cut_short").mkdir()
    (root / "cut_short" / "summary.json").write_text('{"bn": "bn", "devices": 1')  # killed
    failures = collect_failures(root)
    assert sorted(f.run_dir.name for f in failures) == [
        "bn_emulated2_s0_failed",
        "bn_emulated3_s0_failed",
        "sync_emulated64_s3_failed",
    ]
    runs = collect_runs(root)
    assert len(runs) == 16  # the resumed one counts, the cut-short one does not
    write_report(runs, sweep / "report", "Test report", failures=failures)
    text = (sweep / "report" / "README.md").read_text()
    assert "**3 run(s) failed**" in text
    assert (
        "| sync | emulated | 64 | 1 | 3 | rank 1 failed: RuntimeError: boom | "
        "sync_emulated64_s3_failed |" in text
    )
    assert "| bn | emulated | 3 | 21.3333 | 0 | trainer.global_batch_size=64 is not divisible " in (
        text
    )
    assert "\\| by 3 |" in text  # a | in the reason does not break the table
    # 3 of 4 seeds of sync at 1 image per device finished; no bn run at 32 images per device
    table = text.split("## Test error")[1].split("##")[0]
    rows = {line.split(" | ")[0]: line.split(" | ") for line in table.splitlines() if "|" in line}
    assert rows["| 1"][3] == "0.90 ± 0.10 (1 missing)"  # sync (EMA): seeds 0-2 of 0-3
    assert rows["| 32"][1:3] == ["– missing", "– missing"]  # bn (EMA, PreciseBN)
    assert rows["| 16"][1] == "1.00 ± 0.00"  # bn (EMA): the resumed run, not missing
