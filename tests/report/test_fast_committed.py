"""The committed check of the fast configuration (reports/fast_vs_fp32/) agrees with its own
results.csv: every seed of every cell in both arms, and the README's tables are what
report/fast.py computes from that CSV (nothing copied by hand)."""

import csv
from collections import Counter

from conftest import ROOT

from syncbn_lab.report import fast

REPORT = ROOT / "reports" / "fast_vs_fp32"


def runs() -> list[dict]:
    numeric = {"devices": int, "seed": int, "test_acc": float, "test_acc_precise_bn": float,
               "train_loss": float, "train_time_s": float, "wall_time_s": float}  # fmt: skip
    with open(REPORT / "results.csv") as f:
        return [
            {k: numeric[k](v) if k in numeric else v for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def test_every_cell_and_seed_in_both_arms():
    counts = Counter((r["bn"], r["devices"], r["seed"], r["arm"]) for r in runs())
    seeds = {r["seed"] for r in runs()}
    assert len(seeds) >= 3
    expected = {(bn, d, s, arm) for bn, d in fast.CELLS for s in seeds for arm in fast.ARMS}
    assert set(counts) == expected and set(counts.values()) == {1}


def test_the_readme_tables_are_computed_from_the_csv():
    text = (REPORT / "README.md").read_text()
    floor = fast.study_noise_floor(ROOT / "reports" / "bn_vs_syncbn_1epoch" / "results.csv")
    rendered = fast.render(
        runs(), floor, "x", dict.fromkeys(("command", "commit", "machine", "wall"), "x")
    )
    table_lines = [line for line in rendered.splitlines() if line.startswith(("| ", "- "))]
    for line in table_lines:
        assert line in text, line
