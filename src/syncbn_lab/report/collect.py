"""Read the run dirs of one or more sweeps into ``Run`` records."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncbn_lab.errors import UserError

CSV_COLUMNS = (
    "bn",
    "parallel",
    "devices",
    "per_device_batch_size",
    "global_batch_size",
    "seed",
    "test_acc",
    "test_acc_precise_bn",
    "test_error",
    "test_error_precise_bn",
    "train_loss",
    "steps",
    "wall_time_s",
    "run_dir",
)


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
        acc = self.summary.get("test_acc_precise_bn")
        return math.nan if acc is None else 100.0 - acc

    def row(self) -> dict[str, Any]:
        values = {**self.summary, "run_dir": str(self.run_dir)}
        values["test_error"] = self.test_error
        values["test_error_precise_bn"] = self.test_error_precise_bn
        return {key: values.get(key) for key in CSV_COLUMNS}


def collect_runs(*sweep_dirs: Path) -> list[Run]:
    """Every run dir under ``sweep_dirs`` that holds a summary.json (unfinished runs are
    skipped; they have none)."""
    runs = []
    for sweep_dir in sweep_dirs:
        if not Path(sweep_dir).is_dir():
            raise UserError(
                f"sweep dir {sweep_dir} does not exist; pass the folder `make sweep` "
                "wrote (multirun/<study>/...)"
            )
        for summary_path in sorted(Path(sweep_dir).rglob("summary.json")):
            run_dir = summary_path.parent
            summary = json.loads(summary_path.read_text())
            runs.append(Run(run_dir, summary, _loss_curve(run_dir / "metrics.jsonl")))
    if not runs:
        raise UserError(f"no finished runs (summary.json) under {', '.join(map(str, sweep_dirs))}")
    return runs


def _loss_curve(metrics: Path) -> list[tuple[int, float]]:
    if not metrics.exists():
        return []
    curve = []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "val/acc" not in record and record.get("train/loss") is not None:
            curve.append((record["step"], record["train/loss"]))
    return curve
