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

:class:`SweepProgress` watches a sweep dir from outside (scripts/sweep.py) and says, one line
per run as it lands, which cell finished with what result and how long the sweep has left.
It reads only the files the jobs write, so it works for any launcher (joblib, SLURM).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from syncbn_lab.disk import DiskFull, write_atomic
from syncbn_lab.engine import preemption
from syncbn_lab.engine.checkpoint import AUTO
from syncbn_lab.errors import OneLineError, Preempted, UserError, one_line, say
from syncbn_lab.logging.console import duration
from syncbn_lab.variants import GROUP as VARIANT_GROUP

ERROR_FILE = "error.json"
CHECKPOINT = Path("checkpoints") / "last.pt"
SUMMARY_KEYS = ("test_acc", "steps")  # a summary.json without them was cut short
# What a failed job leaves besides Hydra's own .hydra/ and log file; cleared before a rerun.
RUN_OUTPUTS = (
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "summary.json.tmp",
    ERROR_FILE,
    ERROR_FILE + ".tmp",
    "checkpoints",
    "wandb",
)
# Keys of a run that say which cell of the sweep it is (what error.json records).
CELL_KEYS = {
    VARIANT_GROUP: f"{VARIANT_GROUP}.name",
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
    started = time.perf_counter()
    try:
        if cfg.get("skip_finished"):
            summary = finished_summary(run_dir)
            if summary is not None:
                _check_same_config(cfg, run_dir)
                print(f"skipped: {run_dir} holds a finished run", file=sys.stderr, flush=True)
                return summary
        if resumable(run_dir) and cfg.trainer.get("resume") in (None, "", AUTO):
            # a requeued job or a resumed sweep: continue from the run dir's newest checkpoint
            _check_same_config(cfg, run_dir)
            (run_dir / ERROR_FILE).unlink(missing_ok=True)
            with open_dict(cfg):
                cfg.trainer.resume = str(run_dir)
            print(f"resuming: {run_dir} from its last checkpoint", file=sys.stderr, flush=True)
        elif cfg.get("skip_finished"):
            clear_unfinished(run_dir)
        return run(cfg, run_dir)
    except Exception as e:
        from syncbn_lab.parallel.ddp import RankFailed

        if isinstance(e, RankFailed) and e.remote_traceback:
            print(e.remote_traceback.rstrip(), file=sys.stderr)
        elif not isinstance(e, OneLineError):
            traceback.print_exc()  # not a user error: the traceback helps, then one line
        line = one_line(e)
        reason = e.reason if isinstance(e, OneLineError) else "failed"
        record_failure(cfg, run_dir, line, time.perf_counter() - started, reason)
        say(line)
        if isinstance(e, Preempted):
            # The job stops here and leaves no result: submitit's handler (SIGUSR2) requeues
            # a SLURM job, SLURM requeues one it stopped itself (scontrol requeue,
            # preemption), and the job resumes from its checkpoint; a local sweep stops.
            preemption.chain(e.signal_number)
            raise SystemExit(e.exit_status) from None
        return None


def resumable(run_dir: Path) -> bool:
    """The run dir holds a run that stopped before the end and left a checkpoint."""
    return finished_summary(run_dir) is None and (run_dir / CHECKPOINT).is_file()


def record_failure(
    cfg: DictConfig,
    run_dir: Path,
    line: str,
    wall_time_s: float | None = None,
    reason: str = "failed",
) -> None:
    """Write ``<run dir>/error.json``: the one-line error, why the run has no result
    (``failed``, ``diverged``, ``preempted``), the job's cell of the sweep and, when known,
    how long the job ran."""
    record: dict[str, Any] = {"error": line, "reason": reason}
    if wall_time_s is not None:
        record["wall_time_s"] = wall_time_s
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
    try:  # renamed into place: a sweep's progress never reads half a file
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / ERROR_FILE, json.dumps(record) + "\n")
    except (OSError, DiskFull):  # a full disk: the job's line on the terminal says it
        pass


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
        if key.split(".")[0] not in ("skip_finished", "derived", "sweep")
        and key != "trainer.resume"
        and saved.get(key) != current.get(key)
    )
    if differing:
        raise UserError(
            f"{run_dir} holds a run of another config (differs in "
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


def multirun_config(overrides: list[str]) -> DictConfig:
    """The config, Hydra's part included, that ``scripts/train.py -m <overrides>`` composes
    before it sweeps (``overrides`` without their comma lists)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from syncbn_lab.config import CONFIG_DIR

    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        with (
            initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")  # the multirun itself warns, if it must
            return compose("config", overrides=fixed, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs ``scripts/train.py -m <overrides>`` launches, each as its overrides, in
    order: what Hydra's basic sweeper computes, the product of the comma lists of the
    sweeper's params (an experiment's ``hydra.sweeper.params``) and of the command line,
    which wins for a key both set."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = multirun_config(overrides).hydra.sweeper.get("params") or {}
    swept = [f"{key}={value}" for key, value in params.items()] + overrides
    (batch,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(swept), None)
    return batch


CELL_NAMES = (VARIANT_GROUP, "parallel", "devices", "seed")
"""The keys of :data:`CELL_KEYS` that :func:`cell` names for every run."""


def varied_keys(planned: list[list[str]]) -> list[str]:
    """The settings whose value differs between the ``planned`` jobs (each its overrides, as
    :func:`jobs` gives them), other than those :func:`cell` names and Hydra's own (how the
    jobs launch), in the order they first appear: what tells a sweep's runs apart beyond the
    cell."""
    named = {CELL_KEYS[name] for name in CELL_NAMES}  # bn.name, parallel.name, ...
    return [key for key in _differing(planned) if not {key, f"{key}.name"} & named]


def _differing(planned: list[list[str]]) -> list[str]:
    """The override keys whose value differs between the ``planned`` jobs, Hydra's own left
    out, in the order they first appear."""
    # key -> value of each job's overrides ("~key" deletes: value "")
    every = [dict(o.lstrip("+~").partition("=")[::2] for o in job) for job in planned]
    keys = dict.fromkeys(key for job in every for key in job if not key.startswith("hydra"))
    return [key for key in keys if len({job.get(key) for job in every}) > 1]


def check_jobs(planned: list[list[str]]) -> None:
    """Validate each of the ``planned`` jobs' config (as :func:`jobs` gives them) as its run
    will, before any starts: a bad value or combination is one :class:`UserError` line that
    names the job, not a failed run per job. Jobs a SLURM launcher sends elsewhere are left
    to their machines, whose devices this one may not have."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from syncbn_lab.config import CONFIG_DIR, validate

    differing = _differing(planned)
    try:
        with (
            initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")  # each run warns for itself
            for number, job in enumerate(planned, 1):
                cfg = compose("config", overrides=job, return_hydra_config=True)
                if cfg.hydra.runtime.choices.get("hydra/launcher") != "joblib":
                    return
                try:
                    validate(cfg)
                except UserError as e:
                    which = " ".join(o for o in job if o.lstrip("+~").split("=")[0] in differing)
                    raise UserError(
                        f"run {number} of {len(planned)} ({which or 'every run'}): "
                        f"{one_line(e)}; no run was started"
                    ) from None
    finally:
        GlobalHydra.instance().clear()


class SweepProgress:
    """One line per run of a sweep as it finishes: ``[k/N]``, its cell (variant, parallel
    mode x devices, images per device, the ``varied`` settings as the run's config.yaml has
    them, seed), its test error or why it has none (failed, diverged), its time, and the
    sweep's estimated time left.

    Reads the run dirs under ``sweep_dir``: a new complete summary.json is a finished run, a
    new error.json a failed one. Runs finished before this attempt (``--resume``) count as
    done and get no line; the estimate is this attempt's time per finished run times the
    runs left (it includes the launcher's parallelism)."""

    def __init__(
        self,
        sweep_dir: Path,
        total: int,
        varied: list[str] | tuple[str, ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.sweep_dir, self.total, self.varied, self.clock = sweep_dir, total, varied, clock
        self.started = clock()
        self.reported = {
            p.parent for p in sweep_dir.glob("*/summary.json") if finished_summary(p.parent)
        }
        self.before = len(self.reported)
        self.errors_before = _error_files(sweep_dir)
        self.stopped: dict[Path, Any] = {}  # preempted runs announced, by their error line

    @property
    def done(self) -> int:
        return len(self.reported)

    def poll(self) -> list[str]:
        """The lines of the runs that finished since the last call."""
        lines = []
        for run_dir, outcome in self._new_outcomes():
            if run_dir in self.reported:
                continue  # both files new: the first one counts
            if outcome.get("reason") == "preempted":  # not an outcome: the run continues
                if self.stopped.get(run_dir) != outcome.get("error"):
                    self.stopped[run_dir] = outcome.get("error")
                    lines.append(self._line(run_dir, outcome))
                continue
            self.reported.add(run_dir)
            lines.append(self._line(run_dir, outcome))
        return lines

    def _new_outcomes(self) -> list[tuple[Path, dict[str, Any]]]:
        found = []
        for summary_file in self.sweep_dir.glob("*/summary.json"):
            run_dir = summary_file.parent
            summary = None if run_dir in self.reported else finished_summary(run_dir)
            if summary is not None:
                found.append((summary_file.stat().st_mtime, run_dir, summary))
        for error_file, mtime in _error_files(self.sweep_dir).items():
            run_dir = error_file.parent
            if run_dir in self.reported or self.errors_before.get(error_file) == mtime:
                continue
            try:
                found.append((mtime, run_dir, json.loads(error_file.read_text())))
            except (OSError, ValueError):
                continue  # replaced while read: the next call sees it
        return [(run_dir, outcome) for _, run_dir, outcome in sorted(found, key=lambda f: f[0])]

    def _line(self, run_dir: Path, outcome: dict[str, Any]) -> str:
        k = len(self.reported)
        if outcome.get("reason") == "preempted":
            result = f"{outcome['error']} (it continues when requeued or resumed)"
        elif outcome.get("reason") == "diverged":
            result = outcome["error"]  # "diverged at step ...: the training loss is nan ..."
        elif "error" in outcome:
            result = f"failed: {outcome['error']}"
        elif not _finite(outcome.get("train_loss")):
            result = "diverged (the training loss is not finite)"
        else:
            result = f"test error {100 - outcome['test_acc']:.2f} %"
        took = outcome.get("wall_time_s")
        parts = [
            f"[{k}/{self.total}] {cell(outcome, _settings(run_dir, self.varied))}",
            result,
            "?" if took is None else duration(took),
        ]
        ran = k - self.before
        if k < self.total and ran > 0:
            per_run = (self.clock() - self.started) / ran
            parts.append(f"about {duration(per_run * (self.total - k))} left")
        elif k >= self.total:
            parts.append("all runs done")
        return " | ".join(parts)


def cell(record: dict[str, Any], settings: tuple[str, ...] = ()) -> str:
    """``sync, emulated x4 (16 images per device), seed 0`` from a summary or error record,
    with ``settings`` (``model.width=4``) before the seed."""
    per_device = record.get("per_device_batch_size", "?")
    if isinstance(per_device, float):
        per_device = f"{per_device:.3g}"
    return ", ".join(
        [
            f"{record.get(VARIANT_GROUP, '?')}",
            f"{record.get('parallel', '?')} x{record.get('devices', '?')} "
            f"({per_device} images per device)",
            *settings,
            f"seed {record.get('seed', '?')}",
        ]
    )


def _settings(run_dir: Path, keys: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``key=value`` for each of ``keys`` from the run's config.yaml (``?`` where the run
    failed before it wrote one); a config group gives its ``name``."""
    if not keys:
        return ()
    try:
        cfg = OmegaConf.load(run_dir / "config.yaml")
    except (OSError, ValueError):
        cfg = OmegaConf.create()
    values = []
    for key in keys:
        value = OmegaConf.select(cfg, key, default="?")
        if isinstance(value, DictConfig):
            value = value.get("name", "?")
        values.append(f"{key}={value}")
    return tuple(values)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
