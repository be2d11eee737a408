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
    assert len(table) == len(page) == 11
    for config, _, penalty, interval, p, _, loss, *_ in table:
        name = config.removesuffix(", heterogeneity 0.0")
        quoted = page[name]
        assert quoted[2:6] == [penalty, interval, p, loss.split(" ± ")[0]], name


def test_the_results_page_quotes_the_capacity_reports_own_penalty():
    page = results_rows("| configuration | study | penalty")
    for row in markdown_table(report("nbs_capacity"), "| cell | against | Δ test error"):
        width = re.match(r"model.width=(\d+)", row[0]).group(1)
        assert page[f"fashion_mnist, resnet8, width {width}"][2:5] == row[2:5], width


def test_the_results_page_quotes_each_remedy():
    table = markdown_table(RESULTS.read_text(), "| data set | width | remedy |")
    page = {(r[0], r[1], r[2]): r for r in table}
    names = {"bn, devices 8": "bn on 8 devices",
             "sync, devices 128": "SyncBN in groups of 16 on 128 devices"}  # fmt: skip
    found = 0
    for config, remedy, vs_small, _, vs_whole, _, share, _ in markdown_table(
        report("nbs_penalty"), "| configuration | remedy |"
    ):
        if share.endswith("%"):
            width = re.search(r"width (\d+)", config).group(1)
            dataset = config.split(",")[0]
            assert page[(dataset, width, names[remedy])][3:] == [vs_small, vs_whole, share]
            found += 1
    assert found == len(page) == 6


def test_the_results_page_quotes_the_penalty_along_training_length():
    """The stopping-early table: each length's penalty (2 against 64 images, paired by seed)
    and final training loss at 64, recomputed from calibration_epochs' results.csv."""
    import csv
    import statistics

    from syncbn_lab.report.stats import spearman

    with open(ROOT / "reports" / "calibration_epochs" / "results.csv", newline="") as f:
        runs = {(int(r["devices"]), int(r["epochs"]), int(r["seed"])): r for r in csv.DictReader(f)}
    page = results_rows("| epochs | seeds | penalty, 2 against 64 images")
    lengths = sorted({e for _, e, _ in runs})
    assert sorted(int(k) for k in page) == lengths
    penalties, losses = [], []
    for epochs in lengths:
        seeds = [s for d, e, s in runs if d == 1 and e == epochs and (32, e, s) in runs]
        accuracy = {d: [float(runs[d, epochs, s]["test_acc"]) for s in seeds] for d in (1, 32)}
        penalty = statistics.fmean(a - b for a, b in zip(accuracy[1], accuracy[32], strict=True))
        loss = statistics.fmean(float(runs[1, epochs, s]["train_loss"]) for s in seeds)
        assert page[str(epochs)][1:] == [str(len(seeds)), f"{penalty:+.2f}", f"{loss:.3f}"]
        penalties.append(penalty)
        losses.append(loss)
    rho, _ = spearman(losses, penalties)
    assert f"ρ = {rho:+.2f} over {len(lengths)}" in RESULTS.read_text()
