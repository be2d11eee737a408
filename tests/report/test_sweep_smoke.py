"""`make sweep-smoke`: the whole sweep pipeline at tiny scale, then its report."""

import csv
import json
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_sweep_smoke_writes_report(tmp_path):
    sweep_dir, report_dir = tmp_path / "sweep", tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "sweep.py"),
            "--smoke",
            "--sweep-dir",
            str(sweep_dir),
            "--report-dir",
            str(report_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sweep_dir.rglob("summary.json")]
    # bn and sync at 1 and 4 devices, plus GroupNorm once
    assert sorted((s["bn"], s["devices"]) for s in summaries) == [
        ("bn", 1),
        ("bn", 4),
        ("gn", 1),
        ("sync", 1),
        ("sync", 4),
    ]
    assert all(s["parallel"] == "emulated" and s["steps"] == 6 for s in summaries)
    assert all(s["per_device_batch_size"] * s["devices"] == 64 for s in summaries)
    assert all(s.get("test_acc_precise_bn") is not None for s in summaries if s["bn"] != "gn")
    rows = list(csv.DictReader(open(report_dir / "results.csv")))
    assert len(rows) == 5
    text = (report_dir / "README.md").read_text()
    assert "| images per device |" in text and "| 16 |" in text and "| 64 |" in text
    assert float((sweep_dir / "wall_time_s").read_text()) > 0
    for png in ("test_error_vs_per_device_batch.png", "train_loss_curves.png"):
        assert (report_dir / png).stat().st_size > 1000
