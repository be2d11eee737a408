"""Every committed study report re-renders from what it is written from: the runs.tar.gz its
sweep packed or the results.csv it keeps, by the command its README names, through the one
route (scripts/report.py, its experiment's declared writer). README.md and results.csv are
the committed bytes; the plots are not redrawn (the committed ones are kept beside it)."""

import importlib.util
import shlex
import shutil
import sys

import pytest
from conftest import ROOT

from syncbn_lab.report import nbs, penalty, write

REPORTS = ROOT / "reports"
STUDIES = sorted(  # a study's archive committed while it runs has no report yet
    d.name
    for d in REPORTS.iterdir()
    if (d / "README.md").is_file()
    and ((d / "runs.tar.gz").is_file() or (d / "results.csv").is_file())
)


def test_every_report_of_a_study_is_here():
    assert {"bn_vs_syncbn", "bn_vs_syncbn_1epoch", "bn_vs_syncbn_mnist", "calibration_epochs",
            "calibration_nbs_256", "fast_vs_fp32", "nbs_256"} <= set(STUDIES)  # fmt: skip


@pytest.mark.parametrize("name", STUDIES)
def test_the_committed_report_is_what_its_command_writes(name, tmp_path, monkeypatch):
    committed = REPORTS / name
    readme = (committed / "README.md").read_text()
    command = shlex.split(readme.split("Produced by `")[1].split("`")[0])
    assert command[:2] == ["python", "scripts/report.py"], command
    copy = tmp_path / "reports" / name  # the command's relative paths, in a scratch checkout
    copy.mkdir(parents=True)
    for path in committed.iterdir():
        if path.suffix in (".gz", ".csv", ".png") or path.name == "NOTES.md":
            shutil.copy(path, copy)
    for named in command[2:]:  # another study's archive the report combines with its own
        if named.startswith("reports/") and not (tmp_path / named).exists():
            (tmp_path / named).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / named, tmp_path / named)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", command[1:])
    monkeypatch.setattr(write, "write_plots", lambda *a: [])  # the PNGs beside it are linked
    monkeypatch.setattr(nbs, "write_plot", lambda *a: None)
    monkeypatch.setattr(penalty, "write_plot", lambda *a: None)
    monkeypatch.setattr(penalty, "write_headline", lambda *a: True)
    monkeypatch.setattr(penalty, "write_predictor_plot", lambda *a: True)
    spec = importlib.util.spec_from_file_location("report_script", ROOT / "scripts" / "report.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main()
    assert (copy / "README.md").read_text() == readme
    assert (copy / "results.csv").read_bytes() == (committed / "results.csv").read_bytes()
