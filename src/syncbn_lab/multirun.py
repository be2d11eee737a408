"""One job of a Hydra multirun (a sweep): skip it when finished, record it when it fails.

A sweep must survive interruption and failure. Under ``-m`` every job goes through
:func:`run_job`:

- with ``skip_finished=true`` a job whose run dir holds a complete summary.json (of the same
  config) is not run again; an unfinished run dir (killed midway, failed) is cleared and the
  job runs afresh, so a resumed sweep ends with the runs an uninterrupted one writes;
- a job that fails (bad config, a rank that raises, any exception) writes its one-line
  reason to ``<run dir>/error.json`` with the cell it belongs to, prints it, and returns, so
  the launcher (joblib, SLURM) runs the other jobs; the report shows the cell as missing
  with that reason.

:class:`ReportFailures`, a Hydra callback, prints the failed jobs of the multirun after all
jobs are done, one line each, and makes the multirun exit with status 1.
"""

from __future__ import annotations

import json
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from syncbn_lab.errors import UserError

ERROR_FILE = "error.json"
SUMMARY_KEYS = ("test_acc", "steps")  # a summary.json without them was cut short
# What a failed job leaves besides Hydra's own .hydra/ and log file; cleared before a rerun.
RUN_OUTPUTS = (
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "summary.json.tmp",
    ERROR_FILE,
    "checkpoints",
    "wandb",
)
# Keys of a run that say which cell of the sweep it is (what error.json records).
CELL_KEYS = {
    "bn": "bn.name",
    "parallel": "parallel.name",
    "devices": "parallel.devices",
    "seed": "trainer.seed",
    "global_batch_size": "trainer.global_batch_size",
    "accumulate": "trainer.accumulate",
    "dataset": "data.name",
    "model": "model.name",
}


def finished_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary when summary.json is complete (parses, has the final metrics)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or any(summary.get(k) is None for k in SUMMARY_KEYS):
        return None
    return summary


def run_job(
    cfg: DictConfig, run_dir: Path, run: Callable[[DictConfig, Path], dict[str, Any]]
) -> dict[str, Any] | None:
    """``run(cfg, run_dir)`` as one job of a multirun: skipped when finished (with
    ``skip_finished``), recorded in error.json when it fails. Returns the summary, or None
    for a failed job."""
    try:
        if cfg.get("skip_finished"):
            summary = finished_summary(run_dir)
            if summary is not None:
                _check_same_config(cfg, run_dir)
                print(f"skipped: {run_dir} holds a finished run", file=sys.stderr, flush=True)
                return summary
            clear_unfinished(run_dir)
        return run(cfg, run_dir)
    except Exception as e:
        from syncbn_lab.cli import user_error_types
        from syncbn_lab.parallel.ddp import RankFailed

        if isinstance(e, RankFailed) and e.remote_traceback:
            print(e.remote_traceback.rstrip(), file=sys.stderr)
        elif not isinstance(e, user_error_types() + (RankFailed,)):
            traceback.print_exc()  # not a user error: the traceback helps, then one line
        line = one_line(e)
        record_failure(cfg, run_dir, line)
        print(f"error: {line}", file=sys.stderr, flush=True)
        return None


def one_line(e: BaseException) -> str:
    """The error's message as one line; the type is named unless it is a user error."""
    from syncbn_lab.cli import user_error_types
    from syncbn_lab.parallel.ddp import RankFailed

    text = " ".join(str(e).split())
    if isinstance(e, user_error_types() + (RankFailed,)):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def record_failure(cfg: DictConfig, run_dir: Path, line: str) -> None:
    """Write ``<run dir>/error.json``: the one-line reason and the job's cell of the sweep."""
    record: dict[str, Any] = {"error": line}
    for key, path in CELL_KEYS.items():
        try:
            record[key] = OmegaConf.select(cfg, path, throw_on_missing=True)
        except Exception:  # an interpolation that cannot resolve: leave the key out
            continue
    try:
        split, total = record["devices"] * record["accumulate"], record["global_batch_size"]
        record["per_device_batch_size"] = total // split if total % split == 0 else total / split
    except (KeyError, TypeError, ZeroDivisionError):
        pass
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ERROR_FILE).write_text(json.dumps(record) + "\n")


def clear_unfinished(run_dir: Path) -> None:
    """Remove what an unfinished or failed run left in its run dir (Hydra's files stay)."""
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _check_same_config(cfg: DictConfig, run_dir: Path) -> None:
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists():
        return
    saved = _flat(OmegaConf.to_container(OmegaConf.load(saved_path), resolve=False))
    current = _flat(OmegaConf.to_container(cfg, resolve=True))
    differing = sorted(
        key
        for key in set(saved) | set(current)
        if key.split(".")[0] not in ("skip_finished", "derived")
        and saved.get(key) != current.get(key)
    )
    if differing:
        raise UserError(
            f"{run_dir} holds a finished run of another config (differs in "
            f"{', '.join(differing)}); resume a sweep with the overrides it was started "
            "with, or start a new one in another hydra.sweep.dir"
        )


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {"a.b.c": leaf}."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


class ReportFailures(Callback):
    """Hydra callback: after a multirun, one line per failed job, and exit status 1.

    Failures are the error.json files under the sweep dir written during this multirun
    (a sweep dir can hold earlier multiruns)."""

    def __init__(self) -> None:
        self._before: dict[Path, float] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._before = _error_files(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        errors = _error_files(Path(config.hydra.sweep.dir))
        new = sorted(p for p, mtime in errors.items() if self._before.get(p) != mtime)
        for path in new:
            try:
                reason = json.loads(path.read_text())["error"]
            except (OSError, ValueError, KeyError, TypeError):
                reason = "(unreadable error.json)"
            print(f"error: job {path.parent.name} failed: {reason}", file=sys.stderr)
        if new:
            print(
                f"error: {len(new)} job(s) failed (the others finished); their run dirs hold "
                f"{ERROR_FILE}",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(1)


def _error_files(sweep_dir: Path) -> dict[Path, float]:
    if not sweep_dir.is_dir():
        return {}
    return {p: p.stat().st_mtime for p in sweep_dir.glob(f"*/{ERROR_FILE}")}
