"""Read the run dirs of one or more sweeps into ``Run`` records."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncbn_lab.errors import UserError
from syncbn_lab.multirun import ERROR_FILE, finished_summary
from syncbn_lab.variants import GROUP

CSV_COLUMNS = (
    GROUP,
    "parallel",
    "devices",
    "per_device_batch_size",
    "normalization_batch_size",
    "global_batch_size",
    "seed",
    "test_acc",
    "test_acc_precise_bn",
    "test_acc_batch_stats",
    "test_error",
    "test_error_precise_bn",
    "test_error_batch_stats",
    "train_loss",
    "steps",
    "step_time_s",
    "comm_bytes_per_step",
    "comm_gradients_bytes_per_step",
    "comm_buffers_bytes_per_step",
    "comm_norm_statistics_bytes_per_step",
    "wall_time_s",
    "git_commit",
    "run_dir",
)
"""results.csv's columns; run_dir is the run's folder name inside its sweep dir (no machine
paths), the comm_* columns are filled for real DDP runs only."""


@dataclass
class Run:
    """One finished run: its summary and its training-loss curve (step, loss)."""

    run_dir: Path
    summary: dict[str, Any]
    loss_curve: list[tuple[int, float]] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return self.summary.get(key)

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

    def row(self) -> dict[str, Any]:
        values = {**self.summary, "run_dir": self.run_dir.name}
        values["test_error"] = self.test_error
        values["test_error_precise_bn"] = self.test_error_precise_bn
        values["test_error_batch_stats"] = self.test_error_batch_stats
        return {key: values.get(key) for key in CSV_COLUMNS}


@dataclass
class Failure:
    """A run of the sweep that failed: its cell (bn, devices, seed, ...) and one-line reason,
    from the ``error.json`` it left in its run dir (syncbn_lab.multirun)."""

    run_dir: Path
    cell: dict[str, Any]
    reason: str

    def __getitem__(self, key: str) -> Any:
        return self.cell.get(key)

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
            runs.append(Run(run_dir, summary, _loss_curve(run_dir / "metrics.jsonl")))
    if not runs:
        raise UserError(f"no finished runs (summary.json) under {', '.join(map(str, sweep_dirs))}")
    return runs


def _precision(config: Path) -> str | None:
    """trainer.precision from a run's resolved config.yaml (summary.json does not hold it)."""
    if not config.exists():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.load(config), "trainer.precision")


def _loss_curve(metrics: Path) -> list[tuple[int, float]]:
    if not metrics.exists():
        return []
    curve = []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "val/acc" not in record and record.get("train/loss") is not None:
            curve.append((record["step"], record["train/loss"]))
    return curve
