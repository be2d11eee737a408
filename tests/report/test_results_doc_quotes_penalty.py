"""docs/results.md answers "when does per-device BN cost accuracy" from the committed reports:
every trend and rank correlation the combined report (reports/nbs_penalty) has measured, with
the figures and p its claims state; each configuration's penalty, interval, p and final
training loss from its penalty table (widths 4 and 8 as nbs_capacity's own report has them);
and each remedy's differences and recovered share from its remedy table."""

import re
from pathlib import Path

from helpers import markdown_table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results.md"
FIGURES = re.compile(
    r"(?:[+-]\d+\.\d+ ± \d+\.\d+ pp a step|ρ = [+-]\d+\.\d+ over \d+), p = \d(?:[\d.e-]*\d)?"
)  # a trend's slope or a rank correlation, and its p (the sentence's full stop left out)


def report(study: str) -> str:
    return (ROOT / "reports" / study / "README.md").read_text()


def results_rows(head: str) -> dict[str, list[str]]:
    return {r[0]: r for r in markdown_table(RESULTS.read_text(), head)}


def test_the_results_page_quotes_each_measured_claim_of_the_combined_report():
    claims = report("nbs_penalty").split("## The claims")[1].split("\n## ")[0]
    page = " ".join(RESULTS.read_text().split())
    quoted = [FIGURES.search(line) for line in claims.splitlines()]
    measured = [m.group(0) for m in quoted if m]
    assert len(measured) >= 3  # underfitting, heterogeneity, the training loss at least
    for figures in measured:
        assert figures in page, figures


def test_the_results_page_quotes_each_configurations_penalty():
    page = results_rows("| configuration | study | penalty")
    table = markdown_table(report("nbs_penalty"), "| configuration | seeds | penalty")
    assert len(table) == len(page) == 7
    for config, _, penalty, interval, p, _, loss, *_ in table:
        name = config.removesuffix(", heterogeneity 0.0")
        quoted = page[name]
        assert quoted[2:6] == [penalty, interval, p, loss.split(" ± ")[0]], name


def test_the_results_page_quotes_the_capacity_reports_own_penalty():
    page = results_rows("| configuration | study | penalty")
    for row in markdown_table(report("nbs_capacity"), "| cell | against | Δ test error"):
        width = re.match(r"model.width=(\d+)", row[0]).group(1)
        assert page[f"resnet8, width {width}"][2:5] == row[2:5], width


def test_the_results_page_quotes_each_remedy():
    page = {(r[0], r[1]): r for r in markdown_table(RESULTS.read_text(), "| width | remedy |")}
    names = {"bn, devices 8": "bn on 8 devices",
             "sync, devices 128": "SyncBN in groups of 16 on 128 devices"}  # fmt: skip
    found = 0
    for config, remedy, vs_small, _, vs_whole, _, share, _ in markdown_table(
        report("nbs_penalty"), "| configuration | remedy |"
    ):
        if share.endswith("%"):
            width = re.search(r"width (\d+)", config).group(1)
            assert page[(width, names[remedy])][2:] == [vs_small, vs_whole, share]
            found += 1
    assert found == len(page) == 4
