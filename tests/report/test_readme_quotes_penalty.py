"""The README's answer to "when does per-device BN cost accuracy" quotes the committed combined
report (reports/nbs_penalty): every trend and every rank correlation it has measured, with the
figures and p its claims state."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = re.compile(
    r"(?:[+-]\d+\.\d+ ± \d+\.\d+ pp a step|ρ = [+-]\d+\.\d+ over \d+), p = \d(?:[\d.e-]*\d)?"
)  # a trend's slope or a rank correlation, and its p (the sentence's full stop left out)


def test_the_readme_quotes_each_measured_claim_of_the_combined_report():
    report = (ROOT / "reports" / "nbs_penalty" / "README.md").read_text()
    claims = report.split("## The claims")[1].split("\n## ")[0]
    readme = (ROOT / "README.md").read_text().split("## The reproduction")[1].split("\n## ")[0]
    section = " ".join(readme.split())
    quoted = [FIGURES.search(line) for line in claims.splitlines()]
    measured = [m.group(0) for m in quoted if m]
    assert len(measured) >= 3  # underfitting, heterogeneity, the training loss at least
    for figures in measured:
        assert figures in section, figures
