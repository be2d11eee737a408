"""A sweep's report logged to W&B: one offline run named ``report`` in the sweep's group,
with the report's tables and plots."""

import csv
import os

from PIL import Image

from syncbn_lab.logging import report_tables

README = """# A study

## Test error (%), mean ± std over seeds

| bn | 64 | 32 |
|---|---|---|
| bn | 12.1 ± 0.2 | 12.5 ± 0.3 |
| sync | 12.0 ± 0.1 | 12.1 ± 0.2 |

Some text.

| cell | runs |
|---|---|
| a | 3 |

## Cost

| bn | bytes |
|---|---|
| sync | 6152 |
"""


def write_report(report_dir):
    report_dir.mkdir()
    (report_dir / "README.md").write_text(README)
    with open(report_dir / "results.csv", "w", newline="") as f:
        csv.writer(f).writerows([["bn", "devices", "test_acc"], ["bn", "1", "88.1"]])
    Image.new("RGB", (8, 8), "white").save(report_dir / "test_error_plot.png")


def test_report_tables_are_the_csv_and_each_markdown_table_by_section(tmp_path):
    write_report(tmp_path / "report")
    assert report_tables(tmp_path / "report") == {
        "results": (["bn", "devices", "test_acc"], [["bn", "1", "88.1"]]),
        "test_error_mean_std_over_seeds": (
            ["bn", "64", "32"],
            [["bn", "12.1 ± 0.2", "12.5 ± 0.3"], ["sync", "12.0 ± 0.1", "12.1 ± 0.2"]],
        ),
        "test_error_mean_std_over_seeds_2": (["cell", "runs"], [["a", "3"]]),
        "cost": (["bn", "bytes"], [["sync", "6152"]]),
    }


def test_the_sweep_logs_its_report_as_one_offline_run_in_its_group(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the logger config's mode: offline
    monkeypatch.chdir(tmp_path)
    write_report(tmp_path / "report")
    from syncbn_lab.sweep import log_report_to_wandb

    sweep = ["experiment=bn_vs_syncbn", "logger.group=study-2026", "hydra/launcher=joblib"]
    log_report_to_wandb(sweep, tmp_path / "report", tmp_path / "sweep", "study")

    (run,) = (tmp_path / "sweep" / "wandb").glob("offline-run-*")
    data = next(run.glob("run-*.wandb")).read_bytes()
    for token in (b"study-2026", b"report", b"tables/cost", b"tables/results", b"plots/"):
        assert token in data, token
    out = capsys.readouterr().out.splitlines()
    folder = os.path.relpath(run, tmp_path)
    assert out == [
        f"W&B: the report is run 'report' of group study-2026, offline run in {folder}",
        "W&B: upload the runs and the report: wandb sync sweep/*/wandb/offline-run-* "
        "sweep/wandb/offline-run-*",
    ]
