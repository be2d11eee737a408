"""Read the run dirs of one or more sweeps (or a committed results.csv) into ``Run`` records,
and write a study's results.csv: each column a summary.json key, a run's config key or one of
:data:`COMPUTED`."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncbn_lab.errors import UserError
from syncbn_lab.multirun import ERROR_FILE, finished_summary
from syncbn_lab.variants import GROUP


def series(cell: dict[str, Any]) -> Any:
    """The line of a report a run (or failed run) ``cell`` belongs to: its variant, or
    "<variant>, accumulated" when it accumulates gradients over several micro-batches (its
    normalisation batch shrinks as with more devices, but it is not the same experiment)."""
    if (cell.get("accumulate") or 1) > 1:
        return f"{cell.get(GROUP)}, accumulated"
    return cell.get(GROUP)


_LACKS = object()


@dataclass
class Run:
    """One finished run: its summary, its training-loss curve (step, loss) and its
    validation curve (step, accuracy %). ``run[GROUP]`` is its :func:`series`;
    ``run.summary[GROUP]`` its variant."""

    run_dir: Path
    summary: dict[str, Any]
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    config: Any = field(default=None, repr=False)
    """The run's config (its config.yaml, read when a config key is first asked for)."""

    def __getitem__(self, key: str) -> Any:
        return series(self.summary) if key == GROUP else self.summary.get(key)

    def value(self, key: str) -> Any:
        """``key`` of this run: one of :data:`COMPUTED`, ``steps_to_<accuracy>``, a
        summary.json key (or results.csv column) as recorded, or a config key
        (``model.width``) from the run's config.yaml; None where the run has none."""
        if key in COMPUTED:
            return COMPUTED[key](self)
        if key.startswith("steps_to_"):
            return steps_to(self, float(key.removeprefix("steps_to_")))
        if key in self.summary or "." not in key:
            return self.summary.get(key)
        if self._config() is None:
            return None
        from omegaconf import OmegaConf

        return OmegaConf.select(self.config, key)

    def lacks(self, key: str) -> bool:
        """``key`` (a dotted config key) is neither in the run's summary nor in its
        config.yaml: a key added since it trained."""
        from omegaconf import OmegaConf

        if key in self.summary:
            return False

        config = self._config()
        return config is not None and OmegaConf.select(config, key, default=_LACKS) is _LACKS

    def _config(self):
        if self.config is None:
            path = self.run_dir / "config.yaml"
            if not path.is_file():
                return None
            from omegaconf import OmegaConf

            self.config = OmegaConf.load(path)
        return self.config

    def row(self, columns: Iterable[str] | None = None) -> dict[str, Any]:
        """``columns`` (default: its summary's keys and :data:`COMPUTED`) by
        :meth:`value`: a row of results.csv."""
        columns = [*self.summary, *COMPUTED] if columns is None else columns
        return {key: self.value(key) for key in columns}

    @property
    def study(self) -> str | None:
        """The study it ran in: its config.yaml's ``study`` (a results.csv's column)."""
        if "study" in self.summary or self._config() is None:
            return self.summary.get("study")
        return self.config.get("study")

    @property
    def test_error(self) -> float:
        return 100.0 - self.summary["test_acc"]

    @property
    def test_error_precise_bn(self) -> float:
        return self._error("test_acc_precise_bn")

    @property
    def test_error_batch_stats(self) -> float:
        """Test error with each group of b test images normalised by its own statistics
        (trainer.eval_batch_stats); nan for a run without it."""
        return self._error("test_acc_batch_stats")

    def _error(self, acc_key: str) -> float:
        acc = self.summary.get(acc_key)
        return math.nan if acc is None else 100.0 - acc


def test_error(run: Run) -> float:
    return run.test_error


def test_error_precise_bn(run: Run) -> float:
    return run.test_error_precise_bn


def train_loss(run: Run) -> float:
    return run["train_loss"]


def loss_ratio(run: Run) -> float:
    """The last epoch's training loss over the test loss: near 0 where the model fits its
    training set, near 1 or above where it underfits (a run that records a test loss)."""
    return run["train_loss"] / run["test_loss"]


COMPUTED: dict[str, Callable[[Run], Any]] = {
    "test_error": lambda r: r.test_error,
    "test_error_precise_bn": lambda r: r.test_error_precise_bn,
    "test_error_batch_stats": lambda r: r.test_error_batch_stats,
    "run_dir": lambda r: r.run_dir.name,  # its folder inside the sweep dir: no machine paths
    "study": lambda r: r.study,  # the experiment it trained in (a report can combine several)
    "outside_training_s": lambda r: r["wall_time_s"] - r["train_time_s"],
}
"""The values a run's summary.json does not hold as they are reported."""


def steps_to(run: Run, accuracy: float) -> float:
    """The first optimizer step at which the run's validation accuracy is at least
    ``accuracy`` (evaluated steps only: ``trainer.eval_every`` sets their spacing); nan if
    it never gets there."""
    for step, acc in run.val_curve:
        if acc >= accuracy:
            return float(step)
    return math.nan


def write_csv(
    runs: Iterable[Run], columns: Iterable[str], path: Path, order: Callable, value=None
) -> None:
    """results.csv: one row per run in ``order``, its ``columns`` as ``value(run, key)``
    reads them (default :meth:`Run.value`)."""
    columns = list(columns)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for run in sorted(runs, key=order):
            writer.writerow(
                run.row(columns) if value is None else {k: value(run, k) for k in columns}
            )


@dataclass
class Failure:
    """A run of the sweep that failed: its cell (bn, devices, seed, ...) and one-line reason,
    from the ``error.json`` it left in its run dir (syncbn_lab.multirun)."""

    run_dir: Path
    cell: dict[str, Any]
    reason: str

    def __getitem__(self, key: str) -> Any:
        return series(self.cell) if key == GROUP else self.cell.get(key)

    @property
    def diverged(self) -> bool:
        """The run stopped because its training loss was no longer finite."""
        return self.cell.get("reason") == "diverged"


def collect_failures(*sweep_dirs: Path) -> list[Failure]:
    """Every run dir under ``sweep_dirs`` with an error.json and no finished run."""
    failures = []
    for sweep_dir in sweep_dirs:
        for error_path in sorted(Path(sweep_dir).rglob(ERROR_FILE)):
            run_dir = error_path.parent
            if finished_summary(run_dir) is not None:
                continue  # a later attempt finished it
            try:
                cell = json.loads(error_path.read_text())
            except ValueError:
                cell = {"error": f"unreadable {ERROR_FILE}"}
            failures.append(Failure(run_dir, cell, str(cell.get("error", ""))))
    return failures


def collect_runs(*sweep_dirs: Path) -> list[Run]:
    """Every run dir under ``sweep_dirs`` that holds a complete summary.json (unfinished and
    failed runs are skipped: see :func:`collect_failures`)."""
    runs = []
    for sweep_dir in sweep_dirs:
        if not Path(sweep_dir).is_dir():
            raise UserError(
                f"sweep dir {sweep_dir} does not exist; pass the folder `make sweep` "
                "wrote (multirun/<study>/...)"
            )
        for summary_path in sorted(Path(sweep_dir).rglob("summary.json")):
            run_dir = summary_path.parent
            summary = finished_summary(run_dir)
            if summary is None:
                continue  # cut short by an interruption
            summary.setdefault("precision", _precision(run_dir / "config.yaml"))
            runs.append(Run(run_dir, summary, *_curves(run_dir / "metrics.jsonl")))
    if not runs:
        raise UserError(f"no finished runs (summary.json) under {', '.join(map(str, sweep_dirs))}")
    return runs


def _precision(config: Path) -> str | None:
    """trainer.precision from a run's resolved config.yaml, for runs whose summary.json
    does not record it (written before it did)."""
    if not config.exists():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.load(config), "trainer.precision")


def _curves(metrics: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(training loss, validation accuracy) against the step, from metrics.jsonl: the loss
    of each logging window (not the epoch-end records, which average the epoch)."""
    loss: list[tuple[int, float]] = []
    val: list[tuple[int, float]] = []
    if not metrics.exists():
        return loss, val
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "val/acc" in record:
            val.append((record["step"], record["val/acc"]))
        elif record.get("train/loss") is not None:
            loss.append((record["step"], record["train/loss"]))
    return loss, val


INTEGER_COLUMNS = {"devices", "accumulate", "per_device_batch_size", "normalization_batch_size",
                   "global_batch_size", "seed", "steps", "epochs"}  # fmt: skip
TEXT_COLUMNS = {GROUP, "parallel", "git_commit", "run_dir", "study"}


def runs_from_csv(path: Path) -> list[Run]:
    """The runs of a committed results.csv (a report's, without their curves): a study whose
    run dirs are gone can still be compared with, and its report written again."""
    if not Path(path).is_file():
        raise UserError(f"{path} is not a file; pass a results.csv that make report wrote")

    def value(key: str, text: str) -> Any:
        if text == "" or key in TEXT_COLUMNS:
            return text or None
        if key in INTEGER_COLUMNS or text.lstrip("-").isdigit():  # a width, a count: 4, not 4.0
            return int(text)
        try:
            return float(text)
        except ValueError:
            return text

    def summary(row: dict[str, str]) -> dict[str, Any]:
        out = {k: value(k, v) for k, v in row.items()}
        for error, acc in ERROR_COLUMNS.items():  # a report that states errors, not accuracies
            if out.get(acc) is None and isinstance(out.get(error), int | float):
                out[acc] = 100.0 - out[error]
        return out

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [Run(Path(row.get("run_dir") or "?"), summary(row)) for row in rows]


ERROR_COLUMNS = {
    "test_error": "test_acc",
    "test_error_precise_bn": "test_acc_precise_bn",
    "test_error_batch_stats": "test_acc_batch_stats",
}
"""results.csv columns of :data:`COMPUTED` errors -> the summary.json accuracy each reads."""
