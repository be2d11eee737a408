"""A study's cells and comparisons as its experiment declares them (``sweep.report``).

A cell is one configuration of the study over seeds, named by the values of the keys of
``sweep.report.cells``: summary.json's names (``bn``: the run's series, see
:func:`~.collect.series`; ``devices``, ``normalization_batch_size``, ``epochs``), a run's
config keys (``model.width``), or a label of ``sweep.report.labels`` (a name for the runs
whose config has given values). A comparison pairs each cell it measures, seed by seed, with
the cell it is measured against (:class:`~.spec.Comparison`). The cells are those the sweep
declared (its sweep.json) where it is known, so cells still running are there, empty.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from syncbn_lab.errors import UserError
from syncbn_lab.report.collect import Run, test_error
from syncbn_lab.report.spec import ROLE, Comparison, ReportSpec
from syncbn_lab.report.stats import Paired, by_seed, paired
from syncbn_lab.variants import GROUP, with_role


@dataclass(frozen=True, order=True)
class Cell:
    """The values of a study's cell keys, in their declared order (cells sort by them)."""

    values: tuple[Any, ...]
    keys: tuple[str, ...] = field(compare=False)

    def __getitem__(self, key: str) -> Any:
        return self.values[self.keys.index(key)]

    def __str__(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in zip(self.keys, self.values, strict=True))


class Cells:
    """The runs of a study by cell, the cells declared with their seeds, and the pairs of
    its comparisons. ``declared``: every run the sweep declared (:func:`declared_runs`), or
    None where only the finished runs are known (a results.csv)."""

    def __init__(self, spec: ReportSpec, runs: list[Run], declared: list[Run] | None = None):
        self.spec, self.keys, self.runs = spec, spec.cells, runs
        self.by_cell: dict[Cell, list[Run]] = defaultdict(list)
        for run in runs:
            self.by_cell[self.cell_of(run)].append(run)
        seeds: dict[Cell, list[int]] = defaultdict(list)
        for run in runs if declared is None else declared:
            seeds[self.cell_of(run)].append(run["seed"])
        for cell, found in seeds.items():
            if len(set(found)) < len(found):
                raise UserError(
                    f"cell {cell} of experiment={spec.experiment} holds several runs of one "
                    f"seed; name what tells them apart in its sweep.report.cells (e.g. "
                    f"model.width)"
                )
        self.declared = {c: sorted(s) for c, s in sorted(seeds.items())}

    def value(self, run: Run, key: str) -> Any:
        """``key`` of ``run``: its label, its series for ``bn``, else :meth:`Run.value`."""
        if key in self.spec.labels:
            return self._label(run, key)
        if "." in key and self.spec.config is not None and run.lacks(key):
            from omegaconf import OmegaConf

            return OmegaConf.select(self.spec.config, key)  # its default, which kept the old way
        return run[GROUP] if key == GROUP else run.value(key)

    def column(self, run: Run, key: str) -> Any:
        """``key`` of ``run`` as results.csv records it: its label, else :meth:`Run.value`."""
        return self._label(run, key) if key in self.spec.labels else run.value(key)

    def _label(self, run: Run, key: str) -> Any:
        if run.value(key) is not None:  # a results.csv written with the label as a column
            return run.value(key)
        for name, where in self.spec.labels[key].items():
            if all(run.value(k) == v for k, v in where.items()):
                return name
        return None

    def cell_of(self, run: Run) -> Cell:
        return Cell(tuple(self.value(run, k) for k in self.keys), self.keys)

    def order(self, run: Run) -> tuple[Cell, int]:
        """Runs sort by their cell, then their seed (results.csv's rows)."""
        return self.cell_of(run), run["seed"]

    def recorded(self, key: str, *cells: Cell) -> Any:
        """The one value of ``key`` that the runs of ``cells`` record; – for none or several."""
        values = {r[key] for c in cells for r in self.by_cell.get(c, [])}
        return values.pop() if len(values) == 1 else "–"

    def seeds(self, cell: Cell, value: Callable[[Run], float] = test_error) -> dict[int, float]:
        """seed -> ``value`` of the cell's run of that seed."""
        return by_seed(self.by_cell.get(cell, []), value)

    def against(self, cell: Cell, other: Cell, value=test_error) -> Paired:
        """``cell`` - ``other``, paired by seed."""
        return paired(self.seeds(cell, value), self.seeds(other, value))

    def complete(self, *cells: Cell) -> bool:
        """Every declared seed of ``cells`` has finished."""
        return all(len(self.by_cell.get(c, [])) >= len(self.declared.get(c, [])) for c in cells)

    def matches(self, cell: Cell, where: dict[str, Any]) -> bool:
        """``cell`` has the values ``where`` names (a pick such as max aside)."""
        for key, want in where.items():
            if key == ROLE:
                if cell[GROUP] not in {v.name for v in with_role(want)}:
                    return False
            elif want not in ("max", "min", "below") and cell[key] != want:
                return False
        return True

    def select(self, where: dict[str, Any], among: Iterable[Cell] | None = None) -> list[Cell]:
        """The declared cells (or ``among``) that ``where`` selects, sorted."""
        chosen = [c for c in (self.declared if among is None else among) if self.matches(c, where)]
        for key, want in where.items():
            if want in ("max", "min") and chosen:
                extreme = (max if want == "max" else min)(c[key] for c in chosen)
                chosen = [c for c in chosen if c[key] == extreme]
        return sorted(chosen)

    def partner(self, cell: Cell, comparison: Comparison) -> Cell | None:
        """The cell that ``cell`` is measured against in ``comparison``; None where there is
        none, or it is the cell itself."""
        among = [c for c in self.declared if all(c[k] == cell[k] for k in comparison.same)]
        below = [k for k, v in comparison.against.items() if v == "below"]
        among = [c for c in among if all(c[k] < cell[k] for k in below)]
        where = {k: "max" if v == "below" else v for k, v in comparison.against.items()}
        found = [c for c in self.select(where, among) if c != cell]
        if len(found) > 1:
            raise UserError(
                f"sweep.report.comparisons.{comparison.name} of experiment="
                f"{self.spec.experiment} finds {len(found)} cells to measure {cell} against; "
                "add the key that tells them apart to its same"
            )
        return found[0] if found else None

    def pairs(self, name: str) -> list[tuple[Cell, Cell]]:
        """(cell, the cell it is measured against) for each cell of the comparison ``name``."""
        comparison = self.spec.comparison(name)
        found = [(c, self.partner(c, comparison)) for c in self.select(comparison.cells)]
        return [(c, other) for c, other in found if other is not None]


def declared_runs(sweep_dir: Path) -> list[Run] | None:
    """Every run the sweep in ``sweep_dir`` declared (its sweep.json: the grid and the parts),
    each as its run composes it, as a :class:`Run` without results; None without a
    sweep.json."""
    record = sweep_dir / "sweep.json"
    return list(_declared(record.read_text())) if record.is_file() else None


@cache
def _declared(record_text: str) -> tuple[Run, ...]:
    from syncbn_lab.config import compose, derive
    from syncbn_lab.multirun import jobs
    from syncbn_lab.sweep import multirun_overrides

    record = json.loads(record_text)
    out = []
    for part in record["parts"]:
        for job in jobs(multirun_overrides(Path("."), record["experiment"], part["overrides"])):
            cfg = compose([o for o in job if not o.startswith(("hydra", "skip_finished"))])
            out.append(Run(Path("."), _summary(cfg, derive(cfg)), config=cfg))
    return tuple(out)


def _summary(cfg, shape) -> dict[str, Any]:
    """The keys of the summary.json that the run of ``cfg`` writes (syncbn_lab.train) which
    its config and shape decide."""
    t = cfg.trainer
    return {
        GROUP: cfg.bn.name,
        "parallel": cfg.parallel.name,
        "devices": cfg.parallel.devices,
        "accumulate": t.accumulate,
        "per_device_batch_size": shape.per_device_batch_size,
        "normalization_batch_size": shape.normalization_batch_size,
        "global_batch_size": t.global_batch_size,
        "epochs": t.epochs,
        "seed": t.seed,
        "precision": t.precision,
        "model": cfg.model.name,
        "dataset": cfg.data.name,
    }
