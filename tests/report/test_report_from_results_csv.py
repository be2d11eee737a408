"""A committed results.csv that states test errors (not accuracies) reports again as its
archive did: the cells and the penalty rows of reports/nbs_capacity/README.md come back."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_results_csv_of_errors_reports_the_same_cells(tmp_path):
    committed = ROOT / "reports" / "nbs_capacity"
    header = (committed / "results.csv").read_text().splitlines()[0].split(",")
    assert "test_error" in header and "test_acc" not in header  # what the fix is about
    proc = subprocess.run(
        [sys.executable, "scripts/report.py", str(committed / "results.csv"), "--out",
         str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = (tmp_path / "README.md").read_text().splitlines()
    rows = [line for line in (committed / "README.md").read_text().splitlines()
            if line.startswith("| 4 |") or line.startswith("| 8 |")
            or line.startswith("| model.width=")]  # fmt: skip
    assert len(rows) == 6
    for line in rows:
        assert line in again, line
