"""The README's headline figure (reports/nbs_penalty/test_error_vs_normalization_batch.png), the
penalty figure and the predictor figure beside it are drawn again from the committed archives
by the command the report names: the points the headline draws are the committed results.csv's
cells (mean and 95 % interval over seeds), the redrawn PNGs have the committed ones' size, and
no two texts of any figure (labels, legend entries, ticks, titles) overlap."""

import csv
import shlex
import statistics
import struct
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import ROOT
from scipy import stats

from syncbn_lab.report import load
from syncbn_lab.report import penalty as penalty_report
from syncbn_lab.report.stats import difference_noise

REPORT = ROOT / "reports" / "nbs_penalty"


def command() -> list[str]:
    readme = (REPORT / "README.md").read_text()
    return shlex.split(readme.split("Produced by `")[1].split("`")[0])


@pytest.fixture(scope="module")
def study():
    """The combined study, loaded from the archives its README's command names."""
    args = command()
    sources = [ROOT / a for a in args[2:] if a.endswith(".tar.gz")]
    experiment = args[args.index("--experiment") + 1]
    with tempfile.TemporaryDirectory() as scratch:
        source = load(sources, Path(scratch), shlex.join(args), experiment, None)
        cells = source.cells()
        yield penalty_report.PenaltyStudy(cells, difference_noise(source.noise["test_error"].std))


def png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


def drawn_texts(fig) -> list:
    """The visible, non-empty texts of ``fig`` that are drawn: tick labels only of the ticks
    within their axis's view limits (matplotlib keeps labels of ticks beyond them)."""
    from matplotlib.text import Text

    ticks, shown = set(), set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks |= {id(tick.label1), id(tick.label2)}
                if low - 1e-9 <= tick.get_loc() <= high + 1e-9:
                    shown |= {id(tick.label1), id(tick.label2)}
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
            and (id(t) not in ticks or id(t) in shown)]  # fmt: skip


def overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of drawn texts of ``fig`` whose boxes overlap."""
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer).shrunk(0.98, 0.9))
             for t in drawn_texts(fig)]  # fmt: skip
    return [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1 :]
            if box.overlaps(other)]  # fmt: skip


def test_the_headline_draws_the_committed_cells(study):
    committed = defaultdict(list)
    with open(REPORT / "results.csv", newline="") as f:
        for r in csv.DictReader(f):
            heterogeneity = r["data.heterogeneity"] or "0.0"  # nbs_256 ran before the key
            key = (r["data.name"], r["model.name"], r["model.width"], heterogeneity, r["bn"],
                   int(r["devices"]), int(r["normalization_batch_size"]))  # fmt: skip
            committed[key].append(float(r["test_error"]))
    points = penalty_report.headline_points(study)
    assert [p.line for p in points if p.variant == "bn" and p.batch == 2] == [
        "width 16",
        "width 8",
        "width 4",
    ]  # the trend's order: the model that fits, then the ones that underfit
    assert sum(p.remedy for p in points) == 6  # bn on 8 devices and SyncBN groups, each width
    for p in points:
        key = ("fashion_mnist", "resnet8", p.line.split()[1], "0.0", p.variant, p.devices)
        errors = committed[(*key, p.batch)]
        assert len(errors) == p.error.n == 4
        assert p.error.mean == pytest.approx(statistics.fmean(errors), abs=1e-9)
        half = stats.t.ppf(0.975, 3) * statistics.stdev(errors) / 2
        assert p.error.half_interval == pytest.approx(half, abs=1e-9)
        assert p.remedy == (p.batch == 32)


@pytest.mark.parametrize(
    ("name", "write"),
    [
        (penalty_report.HEADLINE, penalty_report.write_headline),
        (penalty_report.PLOT, penalty_report.write_plot),
        (penalty_report.PREDICTOR_PLOT, penalty_report.write_predictor_plot),
    ],
)
def test_each_figure_redraws_at_its_committed_size_without_overlapping_texts(
    study, name, write, tmp_path, monkeypatch
):
    drawn = []
    save = penalty_report.save

    def keep(fig, path, rect=None):
        fig.tight_layout(rect=rect)
        fig.canvas.draw()
        drawn.append(overlapping_texts(fig))
        save(fig, path, rect)

    monkeypatch.setattr(penalty_report, "save", keep)
    write(study, tmp_path / name)
    assert drawn == [[]], drawn
    assert png_size(tmp_path / name) == png_size(REPORT / name)
