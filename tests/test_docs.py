"""The landing page, the index of the studies and the documentation hold together: every
relative link of README.md, reports/README.md and docs/ resolves (a heading for an anchor);
README.md is at most 250 lines, shows the headline figure in its first 40 and the answer
right after it; every figure the README or the index states about a study is read from that
study's committed report; the index has every study, in the order of the argument, with the
runs and run time its results.csv holds; every page under docs/ is linked from the README."""

from __future__ import annotations

import csv
import re
import shlex
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import ROOT
from helpers import markdown_table
from omegaconf import OmegaConf

README = ROOT / "README.md"
INDEX = ROOT / "reports" / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, INDEX, *DOCS]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FIGURE = re.compile(r"(?<![\w.])[+-]?\d+\.\d+(?:e-?\d+)?|(?<![\w.])\d+ %")
"""A figure a sentence states: a decimal (signed, or with an exponent), or a whole percent."""
ORDER = ("exactness", "bn_vs_syncbn_1epoch", "bn_vs_syncbn_mnist", "bn_vs_syncbn", "nbs_256",
         "nbs_capacity", "nbs_depth", "nbs_heterogeneity", "nbs_remedy", "nbs_animal_mnist",
         "nbs_animal_mnist_remedy",
         "nbs_elpv", "nbs_penalty", "calibration_epochs", "calibration_nbs_256",
         "calibration_animal_mnist", "calibration_elpv", "fast_vs_fp32", "bench_cpu",
         "gpu_h200")  # fmt: skip
"""The argument's order: exactness; one epoch; convergence; the normalisation batch at 256;
capacity, depth, heterogeneity, remedy, the other data sets and the combined answer; the
calibrations and the fast configuration's check; benchmarks; the GPU figures."""


def prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return "".join(text.split("```")[::2])


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in prose(page.read_text()).splitlines()
            if line.startswith("#")}  # fmt: skip


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text()))
            if not t.startswith(("http://", "https://", "mailto:"))]  # fmt: skip


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(target)
    assert not broken, broken


def test_every_page_of_the_docs_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README)}
    assert not [p.name for p in DOCS if p.resolve() not in linked]


def report_texts(folder: Path) -> tuple[str, str]:
    """What a study's folder states: its markdown and logs, and its JSON (full-precision
    numbers, which a figure rounds)."""
    files = sorted(folder.iterdir())
    read = lambda *suffixes: "\n".join(p.read_text() for p in files if p.suffix in suffixes)  # noqa: E731
    return read(".md", ".log"), read(".json")


def stated(figure: str, text: str, json: str) -> bool:
    """``figure`` is in ``text`` as written, or is a number of ``json`` rounded as written."""
    if re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", text):
        return True
    if "%" in figure or "e" in figure:
        return False
    digits = len(figure.split(".")[1])
    return any(round(float(x), digits) == float(figure)
               for x in re.findall(rf"-?\d+\.\d{{{digits + 1},}}", json))  # fmt: skip


def unfound_figures(text: str, page: Path) -> list[str]:
    """The figures of ``text`` that none of the study folders it links states."""
    folders = {(page.parent / t).resolve().parent for t in LINK.findall(text)
               if "reports/" in str((page.parent / t).resolve())}  # fmt: skip
    assert folders, f"links no report: {text[:80]}"
    texts = [report_texts(f) for f in sorted(folders)]
    return [f for f in FIGURE.findall(text) if not any(stated(f, t, j) for t, j in texts)]


def answer() -> str:
    return README.read_text().split("<!-- answer:")[1].split("<!-- /answer -->")[0]


def bullets(text: str) -> list[str]:
    return [" ".join(b.split()) for b in re.split(r"\n- ", "\n" + text)[1:]]


def test_the_readme_is_a_landing_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    figure = next(i for i, line in enumerate(lines) if line.startswith("!["))
    assert (
        figure < 40
        and "reports/nbs_penalty/test_error_vs_normalization_batch.png" in (lines[figure])
    )
    headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert lines[min(h for h in headings if h > figure)] == "## The answer"
    order = [lines[h] for h in headings]
    assert order[1:3] == ["## Quickstart", "## SyncBatchNorm in your own training"]
    assert order[3:] == ["## The studies", "## Documentation"]
    assert 1 <= len(bullets(answer().split("-->", 1)[1])) <= 6


def test_the_readme_names_the_command_that_draws_its_figure():
    report = (ROOT / "reports" / "nbs_penalty" / "README.md").read_text()
    command = shlex.split(report.split("Produced by `")[1].split("`")[0])
    assert shlex.join(command) in README.read_text()


@pytest.mark.parametrize("bullet", bullets(answer().split("-->", 1)[1]), ids=lambda b: b[:40])
def test_every_figure_of_the_answer_is_in_the_report_it_links(bullet):
    bullet = bullet.split("<!--")[0]
    assert FIGURE.search(bullet), bullet
    assert not unfound_figures(bullet, README)


def test_the_recommendation_is_one_delimited_bullet_of_the_answer():
    inner = answer().split("<!-- recommendation:")[1].split("<!-- /recommendation -->")[0]
    (bullet,) = bullets(inner.split("-->", 1)[1])
    assert "8 GPUs at 4 images each" in bullet and "`bn=sync`" in bullet and "`bn=bn`" in bullet


def study_of(cell: str) -> str:
    return re.search(r"\]\((?:reports/)?([\w]+)/README\.md\)", cell).group(1)


@pytest.mark.parametrize(
    ("page", "head"), [(README, "| study | question |"), (INDEX, "| study | question |")]
)
def test_each_study_row_states_its_reports_figures_in_the_arguments_order(page, head):
    rows = markdown_table(page.read_text(), head)
    studies = [study_of(r[0]) for r in rows]
    committed = sorted(d.name for d in (ROOT / "reports").iterdir() if (d / "README.md").is_file())
    assert sorted(studies) == committed  # every study once
    known = [s for s in studies if s in ORDER]
    assert known == sorted(known, key=ORDER.index)
    for row in rows:
        assert not unfound_figures(" | ".join(row[:3]), page), row[0]


def own_runs() -> dict[str, list[dict]]:
    """Each study's own runs: nbs_remedy's results.csv also holds nbs_capacity's, so the
    combined report's study column tells them apart."""
    runs: dict[str, list[dict]] = defaultdict(list)
    for folder in sorted((ROOT / "reports").iterdir()):
        if (folder / "results.csv").is_file() and folder.name != "nbs_penalty":
            with open(folder / "results.csv", newline="") as f:
                runs[folder.name] = list(csv.DictReader(f))
    with open(ROOT / "reports" / "nbs_penalty" / "results.csv", newline="") as f:
        combined = list(csv.DictReader(f))
    for study in {r["study"] for r in combined}:
        runs[study] = [r for r in combined if r["study"] == study]
    return runs


def test_the_index_states_each_studys_runs_seeds_and_run_time_from_its_results_csv():
    runs = own_runs()
    rows = {study_of(r[0]): r for r in markdown_table(INDEX.read_text(), "| study | question |")}
    for study, found in runs.items():
        row = rows[study]
        count, seeds = re.match(r"(\d+) runs, ([\d-]+) seeds", row[3]).groups()
        assert int(count) == len(found), study
        keys = list(found[0])[: list(found[0]).index("seed")]  # a cell: the columns before
        per_cell = defaultdict(set)
        for r in found:
            per_cell[tuple(r[k] for k in keys)].add(r["seed"])
        sizes = sorted({len(s) for s in per_cell.values()})
        assert seeds == (f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"), study
        column = "wall_time_s" if "wall_time_s" in found[0] else "train_time_s"
        assert row[4] == f"{sum(float(r[column]) for r in found) / 60:.1f} min", study
    combined = OmegaConf.load(ROOT / "configs" / "experiment" / "nbs_penalty.yaml").sweep.combines
    read = sum(len(runs[s]) for s in combined)
    assert f"reads the {read} runs above" in rows["nbs_penalty"][3]


def test_the_running_page_names_every_option_of_each_hydra_group():
    rows = markdown_table((ROOT / "docs" / "running.md").read_text(), "| group | options")
    for group, options in rows:
        group = group.strip("`")
        if group == "trainer":
            continue
        named = set(re.findall(r"`(\w+)`", options))
        files = {p.stem for p in (ROOT / "configs" / group).glob("*.yaml")}
        assert files <= named, (group, files - named)
