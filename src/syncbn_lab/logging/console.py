"""What a run shows on the terminal: the copy of it in the run's train.log, and the block
that ends every run.

``log_terminal(path)`` copies everything this process writes to ``sys.stdout`` and
``sys.stderr`` (epoch lines, the final block, warnings, error lines, tracebacks) into
``path``, next to the log records that Hydra's file handler writes there. The process that
owns the run dir enters it (scripts/train.py, a Hydra job locally or on SLURM), and so does
rank 0 of a spawned DDP run, whose output the parent never sees; entering it again for the
same file does nothing, so no line is written twice.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

LOG_FILE = "train.log"  # hydra.job.name (configs/config.yaml) + ".log": Hydra's log file too


class _Tee(io.TextIOBase):
    """A text stream that writes to ``stream`` and appends the same text to ``log``.

    Writes holding a carriage return (a progress bar redrawing its line) reach only the
    terminal: the file keeps the lines that stay on the screen."""

    def __init__(self, stream: TextIO, log: TextIO, path: Path):
        self.stream, self.log, self.path = stream, log, path

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        if "\r" not in text and not self.log.closed:
            self._copy(self.log.write, text)
        return written

    def flush(self) -> None:
        self.stream.flush()
        if not self.log.closed:  # a Tee left behind after its block ended
            self._copy(self.log.flush)

    def _copy(self, write, *args) -> None:
        """``write(*args)`` on the log; a log that cannot be written (a full disk) is given
        up, so the terminal still shows the line that says why."""
        try:
            write(*args)
        except OSError:
            with contextlib.suppress(OSError):
                self.log.close()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


@contextlib.contextmanager
def log_terminal(path: Path, log_exceptions: bool = False) -> Iterator[None]:
    """Copy this process's stdout and stderr into ``path`` (appended) while inside. With
    ``log_exceptions`` (where whoever catches it prints its traceback, Hydra), an exception
    that leaves the block is written there with its traceback (an exit with a status is not:
    its message was printed already)."""
    path = Path(path).resolve()
    if isinstance(sys.stdout, _Tee) and sys.stdout.path == path:
        yield  # an outer block copies into this file already
        return
    log = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(saved[0], log, path), _Tee(saved[1], log, path)
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        if log_exceptions:
            log.write(traceback.format_exc())
        raise
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        sys.stdout, sys.stderr = saved
        log.close()


def display_path(path: Path | str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    absolute = Path(path).resolve()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def duration(seconds: float) -> str:
    """``83.2`` -> ``1 min 23 s``; ``7.25`` -> ``7.2 s``; ``3725`` -> ``1 h 2 min``."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _count(n: Any, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _percent(value: Any) -> str:
    return f"{value:.2f} %" if isinstance(value, int | float) and math.isfinite(value) else "n/a"


def result_block(
    summary: dict[str, Any], run_dir: Path, wandb_lines: list[str], running_stats: bool
) -> str:
    """The lines that end a run: test and best val accuracy, steps and wall time, the run
    dir and the W&B run. ``running_stats``: the model normalises with running (EMA)
    statistics in evaluation, so the test accuracy says which statistics it used."""
    test = _percent(summary.get("test_acc"))
    if running_stats:
        test += " (EMA statistics)"
    if "test_acc_precise_bn" in summary:
        test += f", {_percent(summary['test_acc_precise_bn'])} (PreciseBN)"
    if "test_acc_batch_stats" in summary:
        batch = summary.get("normalization_batch_size")
        test += f", {_percent(summary['test_acc_batch_stats'])} (test batches of {batch})"
    rows = [
        ("test accuracy", test),
        ("best val acc", _percent(summary.get("best_val_acc"))),
        ("precision", str(summary.get("precision"))),
        ("steps", f"{summary.get('steps')} ({_count(summary.get('epochs'), 'epoch')})"),
        ("wall time", duration(float(summary.get("wall_time_s", math.nan)))),
        ("run dir", display_path(run_dir)),
    ]
    rows += [("W&B" if i == 0 else "", line) for i, line in enumerate(wandb_lines)]
    width = max(len(name) for name, _ in rows)
    return "\n".join(
        ["-- run finished " + "-" * 48, *(f"{name:<{width}}  {text}" for name, text in rows)]
    )


def wandb_lines(run: Any) -> list[str]:
    """Where a W&B run went: offline, its folder and the command that uploads it; online,
    its URL; none, why."""
    if run is None:
        return ["off (logger=none)"]
    mode = run.settings.mode
    if mode == "disabled":
        return ["off (logger.mode=disabled)"]
    if mode == "offline":
        folder = display_path(run.settings.sync_dir)
        return [f"offline run in {folder}", f"upload it: wandb sync {folder}"]
    return [f"{run.name}: {run.url}"]
