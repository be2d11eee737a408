"""How a run starts in its run dir: afresh, continuing its own last checkpoint, or not at all.

A run dir holds one run. Three ways lead back into a run dir that already holds one, and each
continues from the run's newest checkpoint (``checkpoints/last.pt``) in place, its
metrics.jsonl cut back to that checkpoint's step, as a requeued SLURM job does:

- ``trainer.resume=<this run dir>`` (or one of its checkpoint files);
- ``trainer.resume=auto``: the run dir's own checkpoint when there is one, else a fresh start,
  so a supervisor that restarts a command (a shell loop, a SLURM requeue outside Hydra's
  multirun, Kubernetes) reruns the same command; a run dir that holds a finished run is left
  as it is and its summary returned;
- a worker that torchrun restarted (``--max-restarts``): TORCHELASTIC_RESTART_COUNT > 0 and
  the TORCHELASTIC_RUN_ID that the run dir recorded when the job started (``elastic.json``)
  tell a restart of this job from a new run. It behaves as ``auto``.

Where such a restart finds no checkpoint yet, it starts from step 0 and says so in one line.
Anything else that finds a run in its run dir is refused in one line, touching nothing.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from syncbn_lab.disk import write_atomic
from syncbn_lab.engine import checkpoint
from syncbn_lab.engine.checkpoint import AUTO
from syncbn_lab.errors import ConfigError

RUN_FILES = ("metrics.jsonl", "summary.json")  # a run dir with either holds a run
ELASTIC_FILE = "elastic.json"  # the torchrun job (run id) that writes this run dir


@dataclass(frozen=True)
class Start:
    """What a run does in its run dir: ``resume`` is the checkpoint it continues (None: from
    step 0), ``finished`` the summary of a run that is already complete (nothing to do),
    ``note`` one line to print, ``clear`` whether an unfinished run's files go first."""

    resume: str | None
    finished: dict[str, Any] | None = None
    note: str | None = None
    clear: bool = False


def torchrun_restart() -> tuple[str, int] | None:
    """(run id, restart count) when torchrun started this worker, else None."""
    run_id, count = (
        os.environ.get("TORCHELASTIC_RUN_ID"),
        os.environ.get("TORCHELASTIC_RESTART_COUNT"),
    )
    if run_id is None or count is None:
        return None
    return run_id, int(count)


def restarted() -> bool:
    """torchrun restarted this worker after a failure (its restart count is above 0)."""
    attempt = torchrun_restart()
    return attempt is not None and attempt[1] > 0


def follows_the_run_dir(cfg: DictConfig) -> bool:
    """Whether the run dir, not ``trainer.resume`` as given, decides where this run starts
    (``auto``, or a worker that torchrun restarted): torchrun's ranks > 0 learn it from rank 0."""
    return cfg.trainer.get("resume") == AUTO or restarted()


def decide(cfg: DictConfig, run_dir: Path) -> Start:
    """Where ``cfg``'s run starts in ``run_dir``, checked (a bad checkpoint, another run's
    dir: one ConfigError line); writes nothing."""
    from syncbn_lab.multirun import finished_summary, resumable

    resume = cfg.trainer.get("resume")
    if not follows_the_run_dir(cfg):
        if resume:
            checkpoint.check_resume(cfg)
            if in_place(resume, run_dir):
                return Start(str(resume))
        check_run_dir(run_dir)
        return Start(str(resume) if resume else None)
    if restarted():
        _check_same_job(run_dir)
    finished = finished_summary(run_dir)
    if finished is not None:
        return Start(None, finished=finished, note=f"{run_dir} holds a finished run; nothing to do")
    if resumable(run_dir):
        with open_dict(cfg):
            cfg.trainer.resume = str(run_dir)
        checkpoint.check_resume(cfg)  # a checkpoint of other settings: one line
        return Start(str(run_dir), note=f"resuming: {run_dir} from its last checkpoint")
    given = None if resume in (None, AUTO) else str(resume)  # torchrun's first --resume
    with open_dict(cfg):
        cfg.trainer.resume = given
    if given is not None:
        checkpoint.check_resume(cfg)
    taken = [name for name in RUN_FILES if (run_dir / name).exists()]
    note = f"restart: {run_dir} holds no checkpoint yet; the run starts again" if taken else None
    return Start(given, note=note, clear=bool(taken))


def prepare(chosen: Start, run_dir: Path) -> None:
    """Make ``run_dir`` ready for what :func:`decide` chose: an unfinished run's files
    cleared, or its metrics.jsonl cut back to the checkpoint it continues; the torchrun job
    recorded."""
    from syncbn_lab.multirun import clear_unfinished

    if chosen.clear:
        clear_unfinished(run_dir)
    elif chosen.resume is not None and in_place(chosen.resume, run_dir):
        state = checkpoint.load(checkpoint.resolve(chosen.resume))
        keep_metrics_until(run_dir / "metrics.jsonl", state["step"])
    attempt = torchrun_restart()
    if attempt is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / ELASTIC_FILE).write_text(json.dumps({"run_id": attempt[0]}) + "\n")
        remember_run_dir(attempt[0], run_dir)


def in_place(resume: str, run_dir: Path) -> bool:
    """``trainer.resume`` names a checkpoint of this run dir: the run continues there."""
    return checkpoint.resolve(resume).resolve().is_relative_to(run_dir.resolve())


def keep_metrics_until(metrics: Path, step: int) -> None:
    """Drop the records that a stopped run logged after its checkpoint at ``step``: the
    resumed run logs them again."""
    if not metrics.exists():
        return
    kept = [record for record in _records(metrics) if record[1].get("step", 0) <= step]
    write_atomic(metrics, "".join(line for line, _ in kept))


def _records(metrics: Path) -> list[tuple[str, dict]]:
    """Each line of ``metrics`` with its record; a line cut short (a full disk, a kill in
    the middle of a write) is left out."""
    records = []
    for line in metrics.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append((line if line.endswith("\n") else line + "\n", record))
    return records


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run dir that already holds a run or cannot be written, touching nothing."""
    taken = [name for name in RUN_FILES if (run_dir / name).exists()]
    if taken:
        raise ConfigError(
            f"{run_dir} already holds a run ({', '.join(taken)}); choose a new "
            "hydra.run.dir, or continue it with trainer.resume=auto"
        )
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not (existing.is_dir() and os.access(existing, os.W_OK)):
        raise ConfigError(
            f"cannot write the run dir {run_dir} ({existing} is not a writable folder); "
            "point hydra.run.dir at a writable folder"
        )


def _check_same_job(run_dir: Path) -> None:
    """A restarted torchrun worker continues only a run dir its own job wrote."""
    attempt = torchrun_restart()
    record = run_dir / ELASTIC_FILE
    if attempt is None or not any((run_dir / name).exists() for name in RUN_FILES):
        return
    written_by = json.loads(record.read_text()).get("run_id") if record.exists() else None
    if written_by != attempt[0]:
        raise ConfigError(
            f"{run_dir} holds a run of another job (torchrun run id {written_by}, this "
            f"restart's is {attempt[0]}); choose a new hydra.run.dir"
        )


# torchrun restarts rank 0 with the same arguments: a run dir Hydra named by the time would be
# a new one, so rank 0 leaves the job's run dir where its restart finds it (scripts/train.py).
_POINTERS = Path(tempfile.gettempdir()) / "syncbn-lab-torchelastic"


def remember_run_dir(run_id: str, run_dir: Path) -> None:
    """Note ``run_dir`` as the run dir of torchrun job ``run_id`` on this machine."""
    _POINTERS.mkdir(parents=True, exist_ok=True)
    (_POINTERS / f"{run_id}.txt").write_text(str(run_dir.resolve()) + "\n")


def remembered_run_dir(run_id: str) -> Path | None:
    """The run dir that torchrun job ``run_id`` started on this machine, if noted."""
    pointer = _POINTERS / f"{run_id}.txt"
    return Path(pointer.read_text().strip()) if pointer.is_file() else None
