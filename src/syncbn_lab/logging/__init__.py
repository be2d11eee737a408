"""Run outputs: metrics.jsonl and summary.json locally, and W&B when logger=wandb.

Only rank 0 logs; the other ranks get a ``NullLogger`` so code never asks who it is.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from syncbn_lab.logging.console import wandb_lines


class NullLogger:
    wandb_lines: list[str] = []  # where the W&B run went (the end-of-run block)

    def log(self, record: dict[str, Any]) -> None:
        pass

    def summary(self, summary: dict[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


class RunLogger(NullLogger):
    """Appends one JSON object per record to metrics.jsonl; mirrors everything to W&B."""

    def __init__(self, run_dir: Path, cfg: DictConfig):
        self.run_dir = run_dir
        self.metrics = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self.wandb_run = _start_wandb(run_dir, cfg) if cfg.logger.name == "wandb" else None
        self.wandb_lines = wandb_lines(self.wandb_run)

    def log(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(_finite(record)) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=record["step"])

    def summary(self, summary: dict[str, Any]) -> None:
        write_json(self.run_dir / "summary.json", summary)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(_finite(summary))

    def finish(self, exit_code: int = 0) -> None:
        self.metrics.close()
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None
            # finish() can return before the service has flushed an offline run's log;
            # shutting the service down waits for it
            wandb.teardown()


def _start_wandb(run_dir: Path, cfg: DictConfig):
    import wandb

    lcfg = cfg.logger
    mode = os.environ.get("WANDB_MODE") or lcfg.mode
    tags = [
        f"bn={cfg.bn.name}",
        f"parallel={cfg.parallel.name}",
        f"devices={cfg.parallel.devices}",
        f"per_device_batch={cfg.derived.per_device_batch_size}",
        *lcfg.tags,
    ]
    name = lcfg.run_name or (
        f"{cfg.bn.name}-{cfg.parallel.name}{cfg.parallel.devices}-s{cfg.trainer.seed}"
    )
    return wandb.init(
        project=lcfg.project,
        entity=lcfg.entity,
        group=lcfg.group,
        name=name,
        tags=tags,
        mode=mode,
        dir=str(run_dir),
        config=OmegaConf.to_container(cfg, resolve=True),
        settings=wandb.Settings(silent=True, console="off"),
    )


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/Infinity: write them as null."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_finite(data), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
