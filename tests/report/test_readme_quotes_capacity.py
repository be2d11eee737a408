"""The README's answer to "when does per-device BN cost accuracy" quotes the committed
capacity report: each width's penalty, its p and the final training loss at 256 images."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_quotes_each_widths_penalty_from_the_committed_report():
    report = (ROOT / "reports" / "nbs_capacity" / "README.md").read_text()
    readme = (ROOT / "README.md").read_text().split("## The reproduction")[1].split("\n## ")[0]
    section = " ".join(readme.split())
    rows = [line for line in report.splitlines() if line.startswith("| model.width=")]
    assert len(rows) == 2  # widths 4 and 8
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        width = re.match(r"model.width=(\d+)", cells[0]).group(1)
        penalty, p = cells[2], cells[4]
        loss = f"{float(cells[6].split(' ± ')[0]):.3f}"
        quoted = (
            rf"{re.escape(penalty)} pp (of test error )?at width {width} "
            rf"\(p = {re.escape(p)}; (final training loss )?{re.escape(loss)}"
        )
        assert re.search(quoted, section), (width, penalty, p, loss)
