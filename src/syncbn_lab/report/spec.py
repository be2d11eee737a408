"""A study's report as its experiment declares it: ``sweep.report`` of
configs/experiment/<name>.yaml (the keys and their meaning are in configs/config.yaml).

It names the writer that renders the report (:data:`~.writers.WRITERS`), its title, what
names a cell, the comparisons the report makes (each cell it measures paired by seed with
the cell it is measured against), where the float32 noise floor comes from, an earlier study
to set beside it, and the columns of its results.csv. Nothing in a writer names a dataset,
a model or a batch that this and the runs do not supply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from syncbn_lab.errors import UserError
from syncbn_lab.variants import GROUP

OWN = "own"
"""``noise_floor: own``: the study's own reference runs give its noise floor."""
PICKS = ("max", "min", "below")
"""Filter values that pick among cells: the largest or smallest value of that key, or (in
``against``) the largest value below the measured cell's."""
ROLE = "role"
"""A filter key: the role (syncbn_lab.variants) of the cell's variant (its ``bn``)."""


@dataclass(frozen=True)
class Comparison:
    """Each cell that ``cells`` selects, paired by seed with the cell that ``against``
    selects among those sharing its values of ``same``."""

    name: str
    cells: Mapping[str, Any]
    against: Mapping[str, Any]
    same: tuple[str, ...] = ()


@dataclass(frozen=True)
class Trend:
    """Configurations in the order an effect would grow: ``vary`` takes ``values`` in turn,
    the cell keys of ``fixed`` keep theirs."""

    name: str
    vary: str
    values: tuple[Any, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportSpec:
    """``sweep.report`` of one experiment, checked; ``config`` is the composed experiment."""

    experiment: str
    writer: str
    title: str
    cells: tuple[str, ...]
    labels: Mapping[str, Mapping[Any, Mapping[str, Any]]] = field(default_factory=dict)
    comparisons: Mapping[str, Comparison] = field(default_factory=dict)
    noise_floor: str = OWN
    compare_with: str | None = None
    columns: tuple[str, ...] = ()
    trends: Mapping[str, Trend] = field(default_factory=dict)
    anchors: tuple[str, ...] = ()
    combines: tuple[str, ...] = ()
    config: Any = field(default=None, repr=False, compare=False)

    def comparison(self, name: str) -> Comparison:
        """The comparison ``name``; a one-line error when the experiment does not declare it."""
        try:
            return self.comparisons[name]
        except KeyError:
            raise UserError(
                f"experiment={self.experiment} declares no sweep.report.comparisons.{name}, "
                f"which its writer ({self.writer}) reports; add it to "
                f"configs/experiment/{self.experiment}.yaml"
            ) from None


def repository() -> Path:
    """The checkout's root: committed paths in a declaration (reports/...) are relative to it."""
    from syncbn_lab.config import CONFIG_DIR

    return CONFIG_DIR.parent


def experiments() -> list[str]:
    """Every experiment of configs/experiment/, sorted."""
    from syncbn_lab.config import CONFIG_DIR

    return sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


@cache
def spec_of(experiment: str) -> ReportSpec:
    """The report that ``experiment`` declares (composed once a process); a one-line error for
    an unknown experiment or a declaration that names a key its cells do not have."""
    from omegaconf import OmegaConf

    from syncbn_lab.config import compose

    if experiment not in experiments():
        raise UserError(
            f"experiment {experiment} is unknown; choose one of {', '.join(experiments())}"
        )
    cfg = compose([f"experiment={experiment}"])
    report = OmegaConf.to_container(cfg.sweep.report)
    return declared(experiment, {**report, "combines": list(cfg.sweep.combines)}, cfg)


DEFAULT_STUDY = "default"  # configs/config.yaml's study: runs of no experiment


@cache
def default_spec() -> ReportSpec:
    """The report configs/config.yaml declares, for runs of no experiment (a plain
    ``train.py -m`` multirun)."""
    from omegaconf import OmegaConf

    from syncbn_lab.config import compose

    cfg = compose([])
    return declared(DEFAULT_STUDY, OmegaConf.to_container(cfg.sweep.report), cfg)


def declared(experiment: str, report: dict, config=None) -> ReportSpec:
    """``report`` (an experiment's ``sweep.report``, every key of configs/config.yaml's given)
    checked; ``config``: the composed experiment."""
    cells = tuple(report["cells"])
    comparisons = {
        name: _comparison(experiment, name, value, cells)
        for name, value in (report.get("comparisons") or {}).items()
        if value is not None  # null drops a comparison the experiment inherits
    }
    return ReportSpec(
        experiment=experiment,
        writer=report["writer"],
        title=report["title"],
        cells=cells,
        labels=report.get("labels") or {},
        comparisons=comparisons,
        noise_floor=report.get("noise_floor") or OWN,
        compare_with=report.get("compare_with"),
        columns=tuple(report["columns"]),
        trends={
            name: _trend(experiment, name, value, cells)
            for name, value in (report.get("trends") or {}).items()
        },
        anchors=tuple(_anchor(experiment, key) for key in report.get("anchors") or ()),
        combines=tuple(report.get("combines") or ()),
        config=config,
    )


def _trend(experiment: str, name: str, value: dict, cells: tuple[str, ...]) -> Trend:
    where = f"experiment={experiment}'s sweep.report.trends.{name}"
    if set(value) - {"vary", "values", "fixed"} or not {"vary", "values"} <= set(value):
        raise UserError(f"{where} takes vary, values and fixed; it has {', '.join(value)}")
    trend = Trend(name, value["vary"], tuple(value["values"]), value.get("fixed") or {})
    for key in (trend.vary, *trend.fixed):
        if key not in cells:
            raise UserError(f"{where} names {key}, which is no cell key ({', '.join(cells)})")
    if len(trend.values) < 2:
        raise UserError(f"{where} needs two values of {trend.vary} or more to trend over")
    return trend


def _anchor(experiment: str, key: str) -> str:
    from syncbn_lab.report.papers import papers

    if key not in papers():
        raise UserError(
            f"experiment={experiment}'s sweep.report.anchors names {key}, which "
            f"syncbn_lab/report/papers.yaml does not hold ({', '.join(papers())})"
        )
    return key


def _comparison(experiment: str, name: str, value: dict, cells: tuple[str, ...]) -> Comparison:
    where = f"experiment={experiment}'s sweep.report.comparisons.{name}"
    if set(value) - {"cells", "against", "same"} or "against" not in value:
        raise UserError(f"{where} takes cells, against and same; it has {', '.join(value)}")
    comparison = Comparison(
        name, value.get("cells") or {}, value["against"], tuple(value.get("same") or ())
    )
    keys = (*cells, ROLE) if GROUP in cells else cells
    for key in (*comparison.cells, *comparison.against, *comparison.same):
        if key not in keys:
            raise UserError(f"{where} names {key}, which is no cell key ({', '.join(keys)})")
    if "below" in comparison.cells.values():
        raise UserError(f"{where}: below picks in against only")
    return comparison
