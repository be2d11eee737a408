"""Run outputs: metrics.jsonl and summary.json locally, and W&B when logger=wandb.

Only rank 0 logs; the other ranks get a ``NullLogger`` so code never asks who it is.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from syncbn_lab.disk import DiskFull, write_atomic, writing
from syncbn_lab.errors import UserError, one_line
from syncbn_lab.logging.console import wandb_lines

if TYPE_CHECKING:
    from syncbn_lab.shape import RunShape


# what to do when metrics.jsonl or summary.json meets a full disk (a resume keeps the records up
# to the last checkpoint and writes the rest again)
RUN_FIX = "free space there, then continue the run from its last checkpoint (trainer.resume)"


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

    def __init__(self, run_dir: Path, cfg: DictConfig, shape: RunShape):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        # W&B first: a run it refuses leaves no metrics.jsonl behind
        self.wandb_run = _start_wandb(run_dir, cfg, shape) if cfg.logger.name == "wandb" else None
        with writing(self.metrics_path, RUN_FIX):
            self.metrics = open(self.metrics_path, "a", buffering=1)  # noqa: SIM115
        self.wandb_lines = wandb_lines(self.wandb_run)

    def log(self, record: dict[str, Any]) -> None:
        with writing(self.metrics_path, RUN_FIX):
            self.metrics.write(json.dumps(_finite(record)) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=record["step"])

    def summary(self, summary: dict[str, Any]) -> None:
        write_json(self.run_dir / "summary.json", summary)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(_finite(summary))

    def finish(self, exit_code: int = 0) -> None:
        try:
            with writing(self.metrics_path, RUN_FIX):
                self.metrics.close()
        except DiskFull:
            if exit_code == 0:  # after a failure, the failure is the run's line
                raise
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None
            # finish() can return before the service has flushed an offline run's log;
            # shutting the service down waits for it
            wandb.teardown()


def _start_wandb(run_dir: Path, cfg: DictConfig, shape: RunShape):
    tags = [
        f"bn={cfg.bn.name}",
        f"parallel={cfg.parallel.name}",
        f"devices={cfg.parallel.devices}",
        f"per_device_batch={shape.per_device_batch_size}",
    ]
    name = cfg.logger.run_name or (
        f"{cfg.bn.name}-{cfg.parallel.name}{cfg.parallel.devices}-s{cfg.trainer.seed}"
    )
    config = OmegaConf.to_container(cfg, resolve=True)
    return _init_wandb(cfg.logger, run_dir, name, cfg.logger.group, tags, config)


def _init_wandb(
    lcfg: DictConfig,
    folder: Path,
    name: str,
    group: str | None,
    tags: list[str],
    config: Any,
    job_type: str | None = None,
):
    """A W&B run in ``folder`` as ``lcfg`` (the logger config) says; the ``WANDB_MODE``
    environment variable overrides its mode. W&B's refusal (online without an API key, no
    connection) is one :class:`UserError` line."""
    import wandb

    mode = os.environ.get("WANDB_MODE") or lcfg.mode
    try:
        return wandb.init(
            project=lcfg.project,
            entity=lcfg.entity,
            group=group,
            name=name,
            tags=[*tags, *lcfg.tags],
            job_type=job_type,
            mode=mode,
            dir=str(folder),
            config=config,
            settings=wandb.Settings(silent=True, console="off"),
        )
    except wandb.errors.Error as e:
        raise UserError(
            f"W&B cannot start a run in mode {mode} ({one_line(e)}); log in with `wandb login` "
            "(or set WANDB_API_KEY), or log offline with logger.mode=offline and upload later "
            "with `wandb sync`"
        ) from None


REPORT_FILES = ("README.md", "results.csv", "*.png")  # what a report run carries


def log_report(report_dir: Path, lcfg: DictConfig, group: str | None, folder: Path) -> list[str]:
    """Log a sweep's report as one W&B run named ``report`` in the sweep's ``group``: every
    table of its README.md (one per section), results.csv, and its plots, as W&B tables and
    images, and the files themselves as a ``report`` artifact. The run goes to ``folder``;
    returns the lines that say where (offline: its folder and the ``wandb sync`` command)."""
    import wandb

    run = _init_wandb(
        lcfg, folder, "report", group, ["report"], {"report_dir": str(report_dir)}, "report"
    )
    try:
        record: dict[str, Any] = {}
        for key, (columns, rows) in report_tables(report_dir).items():
            record[f"tables/{key}"] = wandb.Table(columns=columns, data=rows)
        for plot in sorted(report_dir.glob("*.png")):
            record[f"plots/{plot.stem}"] = wandb.Image(str(plot))
        run.log(record)
        artifact = wandb.Artifact(re.sub(r"[^\w.-]", "_", f"report-{group or 'sweep'}"), "report")
        for pattern in REPORT_FILES:
            for path in sorted(report_dir.glob(pattern)):
                artifact.add_file(str(path))
        run.log_artifact(artifact)
        return wandb_lines(run)
    finally:
        run.finish()
        wandb.teardown()  # wait until the offline run is written


def report_tables(report_dir: Path) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The tables of a report: ``results`` (results.csv) and each Markdown table of
    README.md, keyed by its section heading (``_2``, ``_3`` ... for more in one section)."""
    tables: dict[str, tuple[list[str], list[list[str]]]] = {}
    csv_file = report_dir / "results.csv"
    if csv_file.exists():
        with csv_file.open(newline="") as f:
            header, *rows = list(csv.reader(f))
        tables["results"] = (header, rows)
    readme = report_dir / "README.md"
    section, block = "report", []
    for line in [*readme.read_text().splitlines(), ""] if readme.exists() else []:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if len(block) > 2:  # header, separator, rows
            key, n = section, 2
            while key in tables:
                key, n = f"{section}_{n}", n + 1
            tables[key] = (block[0], [row for row in block[2:] if len(row) == len(block[0])])
        block = []
        if line.startswith("#"):
            section = re.sub(r"\W+", "_", line.lstrip("#").strip().lower()).strip("_")
    return tables


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/Infinity: write them as null."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as ``path``, written beside it and renamed into place."""
    text = json.dumps(_finite(data), indent=2, sort_keys=True) + "\n"
    write_atomic(path, text, RUN_FIX)
