"""A study's sweep: the Hydra multiruns an experiment declares, run one after the other into
one sweep dir, with a line per finished run (scripts/sweep.py is the entry point).

The experiment's own grid (``hydra.sweeper.params``) is the first multirun; then each of its
``sweep.parts`` (configs/experiment/*.yaml), in order: overrides on top of the grid (a part
set to null, one that the experiment inherits, is not run). A part
that chooses a distributed parallel mode (real DDP) runs one job at a time, since its ranks
take the cores, and is left out when the grid itself already runs under such a mode.
``--smoke`` swaps in ``sweep.smoke`` (configs/config.yaml): its overrides on every run, and
its parts.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import OmegaConf

from syncbn_lab.disk import make_folder
from syncbn_lab.errors import UserError, one_line
from syncbn_lab.logging import log_report
from syncbn_lab.logging.console import display_path
from syncbn_lab.machine import available_cores
from syncbn_lab.multirun import SweepProgress, multirun_config

LAUNCHERS = {"joblib": "hydra/launcher=joblib", "slurm": "hydra/launcher=submitit_slurm"}
LOG = "sweep.log"  # the jobs' own output, all attempts appended
POLL_S = 1.0  # how often the sweep dir is read for finished runs
GRID = "grid"  # the name of the first part: the experiment's own grid


def merge(defaults: list[str], overrides: list[str]) -> list[str]:
    """``defaults`` with every key that ``overrides`` sets replaced by its value there."""
    given = {o.split("=", 1)[0] for o in overrides}
    return [d for d in defaults if d.split("=", 1)[0] not in given] + overrides


def declared(experiment: str, smoke: bool) -> tuple[list[str], dict[str, list[str]]]:
    """What ``experiment`` declares for its sweep: the overrides on every run (the smoke
    sweep's, or none) and its parts after the grid, name -> overrides."""
    from syncbn_lab.config import CONFIG_DIR, compose

    known = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
    if experiment not in known:
        raise UserError(f"--experiment {experiment} is unknown; choose one of {', '.join(known)}")
    sweep = compose([f"experiment={experiment}"]).sweep
    if sweep.combines:
        studies = list(sweep.combines)
        archives = " ".join(f"reports/{s}/runs.tar.gz" for s in studies)
        raise UserError(
            f"experiment={experiment} trains nothing: it reports the runs of "
            f"{', '.join(studies)}; sweep those (--experiment {studies[0]} ...), then "
            f"python scripts/report.py {archives} --experiment {experiment}"
        )
    chosen = sweep.smoke if smoke else sweep
    common = list(sweep.smoke.overrides) if smoke else []
    parts = OmegaConf.to_container(chosen.parts) if chosen.parts is not None else {}
    # parts: null runs the grid alone; a part set to null (one an experiment inherits) is dropped
    return common, {k: list(v) for k, v in parts.items() if v is not None}


def _mode_of(overrides: list[str], default: str | None) -> str | None:
    """The parallel mode ``overrides`` choose (the last ``parallel=`` wins), or ``default``."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "parallel"]
    return chosen[-1] if chosen else default


def plan(
    experiment: str, smoke: bool, parallel: str, launcher: str, overrides: list[str]
) -> list[dict]:
    """The sweep's multiruns in order, each ``{"part": name, "overrides": [...]}``."""
    from syncbn_lab.parallel.modes import mode

    if launcher not in LAUNCHERS:
        raise UserError(f"--launcher {launcher} is unknown; choose joblib or slurm")
    common, parts = declared(experiment, smoke)
    base = [f"parallel={parallel}", LAUNCHERS[launcher]]
    if launcher == "joblib":
        base.append(f"hydra.launcher.n_jobs={available_cores()}")  # one job per core
    base = merge([*base, *common], overrides)
    grid_distributed = mode(_mode_of(base, parallel)).distributed
    out = []
    for part, part_overrides in {GRID: [], **parts}.items():
        # each multirun numbers its jobs from 0: a part's run dirs start with the part's name
        named = [] if part == GRID else [f"hydra.sweep.subdir={part}_{run_dir_pattern()}"]
        merged = merge(merge(base, named), part_overrides)
        own_mode = _mode_of(part_overrides, None)  # a part that chooses its own mode
        if own_mode is not None and mode(own_mode).distributed:
            if grid_distributed:
                continue  # the grid is real DDP already
            if launcher == "joblib":
                merged = merge(merged, ["hydra.launcher.n_jobs=1"])  # its ranks take the cores
        out.append({"part": part, "overrides": merged})
    return out


def run_dir_pattern() -> str:
    """configs/config.yaml's name of a sweep's run dir (``hydra.sweep.subdir``), unresolved:
    ``<job number>_<bn>_<parallel><devices>_s<seed>``."""
    from omegaconf import OmegaConf

    from syncbn_lab.config import CONFIG_DIR

    config = OmegaConf.load(CONFIG_DIR / "config.yaml")
    return OmegaConf.to_container(config, resolve=False)["hydra"]["sweep"]["subdir"]


def pin_precision(experiment: str, parts: list[dict]) -> list[dict]:
    """``parts`` with ``trainer.precision=auto`` resolved once, here, and pinned in every
    part's overrides: one study never mixes precisions, and a sweep resumed on another
    machine (its sweep.json) trains as it started."""
    from syncbn_lab.config import resolve_device
    from syncbn_lab.engine.precision import resolve

    pinned = []
    for part in parts:
        arguments = multirun_overrides(Path("."), experiment, part["overrides"])
        try:
            cfg = multirun_config(arguments).trainer
        except Exception as e:  # a bad override: Hydra's message as one line
            raise UserError(" ".join(str(e).split())) from None
        chosen = resolve(cfg.precision, torch.device(resolve_device(cfg.device)))
        overrides = part["overrides"]
        swept = any(o.startswith("trainer.precision=") and "," in o for o in overrides)
        if chosen != cfg.precision and not swept:
            overrides = merge(overrides, [f"trainer.precision={chosen}"])
        pinned.append({**part, "overrides": overrides})
    return pinned


def multirun_overrides(sweep_dir: Path, experiment: str, overrides: list[str]) -> list[str]:
    """The arguments of one Hydra multirun of the sweep, after ``train.py -m``."""
    return [
        f"experiment={experiment}",
        f"hydra.sweep.dir={sweep_dir}",
        "skip_finished=true",  # a run already finished in this sweep dir is not run again
        *overrides,
    ]


def multirun(
    train_script: Path,
    arguments: list[str],
    progress: SweepProgress,
    log: Path,
    verbose: bool,
    landed: Callable[[], None] = lambda: None,
) -> int:
    """One Hydra multirun of ``train_script``; prints a line per run as it finishes and then
    calls ``landed``. The jobs' output goes to ``log``, or to the terminal when ``verbose``.
    Returns its exit status (1: some jobs failed)."""
    command = [sys.executable, str(train_script), "-m", *arguments]
    cwd = train_script.parent.parent
    with open(log, "a") as out:
        out.write("+ " + " ".join(command[1:]) + "\n")
        out.flush()
        if verbose:
            print("+", " ".join(command[1:]), flush=True)
            job = subprocess.Popen(command, cwd=cwd)
        else:
            job = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        while True:
            finished = job.poll() is not None  # read the runs once more after the end
            lines = progress.poll()
            for line in lines:
                print(line, flush=True)
            if lines:
                landed()
            if finished:
                return job.returncode
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(POLL_S)


def log_report_to_wandb(arguments: list[str], report_dir: Path, sweep_dir: Path, name: str):
    """The report as one W&B run in the sweep's group, where the runs logged to W&B (the
    logger config of the sweep's runs: offline by default)."""
    logger = multirun_config(arguments).logger
    if logger.name != "wandb":
        return
    group = logger.group or name
    try:
        lines = log_report(report_dir, logger, group, sweep_dir)
    except Exception as e:  # the report is written; W&B is a copy of it
        print(f"warning: the report was not logged to W&B ({one_line(e)})", file=sys.stderr)
        return
    print(f"W&B: the report is run 'report' of group {group}, {lines[0]}", flush=True)
    if (os.environ.get("WANDB_MODE") or logger.mode) == "offline":
        runs = f"{display_path(sweep_dir)}/*/wandb/offline-run-*"
        report = f"{display_path(sweep_dir)}/wandb/offline-run-*"
        print(f"W&B: upload the runs and the report: wandb sync {runs} {report}", flush=True)


LOCK_SUFFIX = ".lock"  # <sweep dir>.lock, <archive>.lock: the sweep that works on it


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, /proc), to tell it from a later
    process given the same pid; None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(owner: dict) -> bool | None:
    """Whether the process that wrote ``owner`` still runs: None where it ran on another
    host (which this one cannot ask)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = owner.get("started_ticks")
    return started is None or _process_start(pid) in (None, started)


@contextlib.contextmanager
def locked(path: Path, what: str) -> Iterator[None]:
    """Hold ``path + .lock`` while inside: a file created exclusively, naming this host, pid
    and command. Another sweep that holds it is one UserError line naming it; a lock whose
    process is gone (killed, its machine rebooted: same host) is taken over with a line."""
    lock = path.with_name(path.name + LOCK_SUFFIX)
    owner = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_ticks": _process_start(os.getpid()),
        "since": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    unwritable = f"put {what} in a writable folder"
    make_folder(lock.parent, unwritable)
    for _ in range(2):  # a stale lock is removed once, then taken
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                held = json.loads(lock.read_text())
            except (OSError, ValueError):
                held = {}
            alive = _alive(held)
            if alive is False and held:
                print(
                    f"note: {lock} was left by pid {held.get('pid')}, which is gone; taking it",
                    file=sys.stderr,
                    flush=True,
                )
                lock.unlink(missing_ok=True)
                continue
            fix = "wait for it to end, or stop it" if alive else f"if it is gone, rm {lock}"
            raise UserError(
                f"{what} {path} is in use by another sweep (pid {held.get('pid', '?')} on "
                f"{held.get('host', '?')} since {held.get('since', '?')}: "
                f"{held.get('command', '?')}); {fix}"
            ) from None
        except OSError as e:  # a folder that cannot be written, a full disk
            raise UserError(
                f"cannot write {lock}, the lock of {what} ({e.strerror}); {unwritable}"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(owner) + "\n")
        break
    try:
        yield
    finally:
        try:  # only our own lock: a sweep that took over a stale one keeps its own
            if json.loads(lock.read_text()).get("pid") == owner["pid"]:
                lock.unlink()
        except (OSError, ValueError):
            pass
