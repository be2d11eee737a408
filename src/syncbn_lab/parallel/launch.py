"""Start the worker(s) of a run as its parallel mode says: one process, or N DDP ranks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from syncbn_lab.parallel.context import Runtime

if TYPE_CHECKING:
    from syncbn_lab.config import RunShape

Worker = Callable[[Runtime, DictConfig, "RunShape", Path], dict[str, Any]]


def launch(cfg: DictConfig, shape: RunShape, worker: Worker, run_dir: Path) -> dict[str, Any]:
    """Run ``worker`` in the processes the parallel mode needs; return rank 0's summary.

    ``shape`` is ``config.validate(cfg)``'s: impossible combinations have failed before
    anything starts.
    """
    return shape.parallel_mode.launch(cfg, shape, worker, run_dir)
