"""Start the worker(s) of a run: one process (single, emulated, dp) or N DDP ranks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from syncbn_lab.errors import ConfigError
from syncbn_lab.parallel.context import Runtime

Worker = Callable[[Runtime, DictConfig, Path], dict[str, Any]]


def launch(cfg: DictConfig, worker: Worker, run_dir: Path) -> dict[str, Any]:
    """Run ``worker`` in the processes the parallel mode needs; return rank 0's summary.

    ``cfg`` has been validated (``config.validate``): impossible combinations have failed
    before anything starts.
    """
    mode = cfg.parallel.name
    device = torch.device(cfg.derived.device)
    if mode == "single":
        return worker(Runtime(device=device), cfg, run_dir)
    if mode == "emulated":
        rt = Runtime(device=device, devices_per_process=cfg.parallel.devices)
        return worker(rt, cfg, run_dir)
    if mode == "dp":  # the process holds N devices; the loader yields their slices in order
        rt = Runtime(device=torch.device("cuda", 0), devices_per_process=cfg.parallel.devices)
        return worker(rt, cfg, run_dir)
    if mode == "ddp":
        from syncbn_lab.parallel.ddp import launch_ddp

        return launch_ddp(cfg, worker, run_dir)
    raise ConfigError(f"unknown parallel mode '{mode}'; choose single, emulated, ddp or dp")
