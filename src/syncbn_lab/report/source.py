"""Where a report's runs come from: sweep dirs, the runs.tar.gz that ``scripts/sweep.py
--archive`` wrote, or a committed results.csv (a study whose run dirs are gone), with the
experiment that declares the study and what the sweep recorded (its declared runs, its wall
time, its attempts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from syncbn_lab.archive import read_attempts, unpack
from syncbn_lab.errors import UserError
from syncbn_lab.report.cells import Cells, declared_runs
from syncbn_lab.report.collect import (
    Failure,
    Run,
    collect_failures,
    collect_runs,
    runs_from_csv,
    write_csv,
)
from syncbn_lab.report.spec import (
    DEFAULT_STUDY,
    OWN,
    ReportSpec,
    default_spec,
    experiments,
    repository,
    spec_of,
)
from syncbn_lab.report.stats import NoiseFloor, committed_noise, reference_noise


@dataclass
class Source:
    """The runs of one study and what is known of how they ran. ``csv``: the results.csv
    they were read from (the report does not write it again); ``sweep_dirs``: the sweep dirs
    whose sweep.json and attempts.json describe them (several where a report combines the
    sweeps of several studies)."""

    spec: ReportSpec
    runs: list[Run]
    command: str
    failures: list[Failure] = field(default_factory=list)
    sweep_dirs: tuple[Path, ...] = ()
    csv: Path | None = None
    wall_time_s: float | None = None

    @cached_property
    def declared(self) -> list[Run] | None:
        """Every run the sweeps declared, or None where only the finished runs are known."""
        if not self.sweep_dirs:
            return None
        return [run for d in self.sweep_dirs for run in declared_runs(d) or []]

    @cached_property
    def attempts(self) -> list[dict]:
        return [a for d in self.sweep_dirs for a in read_attempts(d)]

    def cells(self, runs: list[Run] | None = None) -> Cells:
        """``runs`` (default: all) by the study's declared cells."""
        return Cells(self.spec, self.runs if runs is None else runs, self.declared)

    def write_results(self, out_dir: Path, cells: Cells | None = None, order=None) -> list[str]:
        """results.csv of the runs by ``cells`` (their cell, then seed) or in ``order``, its
        columns those the experiment declares; nothing where the runs come from a
        results.csv (it is the record). The files written."""
        if self.csv is not None:
            return []
        value = None if cells is None else cells.column
        order = order or cells.order
        write_csv(self.runs, self.spec.columns, out_dir / "results.csv", order, value)
        return ["results.csv"]

    @cached_property
    def noise(self) -> dict[str, NoiseFloor]:
        """The float32 noise floor of one run by metric (``sweep.report.noise_floor``): from
        this study's reference runs, or from a committed study's results.csv."""
        if self.spec.noise_floor != OWN:
            return committed_noise(repository() / self.spec.noise_floor)
        floors = reference_noise(self.runs)
        if floors is None:
            raise UserError(
                f"experiment={self.spec.experiment} takes its noise floor from its own SyncBN "
                "runs and has none; name a committed results.csv in sweep.report.noise_floor"
            )
        return floors


def load(
    paths: list[Path], scratch: Path, command: str, experiment: str | None = None,
    wall_time_s: float | None = None,
) -> Source:  # fmt: skip
    """The runs under ``paths``: sweep dirs, archives (unpacked into ``scratch``, so that the
    report holds the archive's runs and no others) or one results.csv. The study is
    ``experiment``, else the one the sweep recorded (sweep.json), the runs' ``study``, or the
    folder of the results.csv."""
    csvs = [p for p in paths if p.suffix == ".csv"]
    if csvs:
        if len(paths) > 1:
            raise UserError("pass one results.csv alone, or sweep dirs and archives")
        runs = runs_from_csv(csvs[0])
        name = experiment or _known(csvs[0].resolve().parent.name)
        return Source(_spec(name, csvs[0]), runs, command, csv=csvs[0], wall_time_s=wall_time_s)
    dirs = [unpack(p, scratch / str(i)) if p.is_file() else p for i, p in enumerate(paths)]
    runs = collect_runs(*dirs)
    # a run stopped by a signal (its machine going away) is no failure: it runs again on resume
    failures = [f for f in collect_failures(*dirs) if f["reason"] != "preempted"]
    plans: dict[str, tuple[Path, dict]] = {}  # one sweep's plan once, however many dirs hold it
    for d in dirs:
        if (d / "sweep.json").is_file():
            record = json.loads((d / "sweep.json").read_text())
            plans.setdefault(json.dumps([record["experiment"], record["parts"]]), (d, record))
    swept = tuple(d for d, _ in plans.values())
    records = [record for _, record in plans.values()]
    recorded = sorted({r["experiment"] for r in records})
    if experiment is None and len(recorded) > 1:
        raise UserError(
            f"the sources hold the sweeps of {', '.join(recorded)}; pass --experiment, the "
            "study whose report combines them"
        )
    study = runs[0].study if runs else None
    name = experiment or (recorded[0] if recorded else None) or _known(study)
    wall = dirs[0] / "wall_time_s"
    if wall_time_s is None and len(dirs) == 1 and wall.exists():
        wall_time_s = float(wall.read_text())  # what the sweep wrote, all its attempts
    spec = _spec(name, dirs[0], study)
    if any(r.get("smoke") for r in records):  # the pipeline at tiny scale: set beside nothing
        spec = replace(spec, compare_with=None)
    return Source(spec, runs, command, failures, swept, None, wall_time_s)


def _known(name: str | None) -> str | None:
    return name if name in experiments() else None


def _spec(experiment: str | None, where: Path, study: str | None = None) -> ReportSpec:
    if experiment is None and study == DEFAULT_STUDY:  # a plain multirun of no experiment
        return default_spec()
    if experiment is None:
        raise UserError(
            f"which study {where} holds is not recorded; pass --experiment (one of "
            f"{', '.join(experiments())})"
        )
    return spec_of(experiment)
