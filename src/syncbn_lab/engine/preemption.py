"""Stop signals: SIGTERM and SLURM's warning signal ask a run to stop at the next step.

A cluster ends a job with SIGTERM (``scancel``, ``scontrol requeue``, preemption, the time
limit) and, when asked with ``sbatch --signal``, warns it first with another signal
(submitit asks for SIGUSR2 90 s before the time limit). While :func:`stop_signals` is
active these signals only set a flag; the training loop reads it after every optimizer
step (``Trainer.agree``: one collective, so every DDP rank stops at the same step), saves a
checkpoint and raises :class:`syncbn_lab.errors.Preempted`.

The handler that was installed before (submitit's in a SLURM job: it checkpoints the job's
callable and requeues the job on SIGUSR2) runs afterwards, through :func:`chain`, once the
checkpoint is on disk and the job's error.json says why it stopped. A process that
supervises others (the spawned DDP ranks) forwards the signal to them with
:func:`forward_to`. Ctrl-C (SIGINT) stays an immediate stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)

_received: int | None = None
_previous: dict[int, object] = {}
_forward_pids: list[int] = []


def requested() -> int | None:
    """The stop signal this process received (the first one), or None."""
    return _received


def _handle(signum: int, frame: FrameType | None) -> None:
    global _received
    if _received is None:
        _received = signum
    for pid in _forward_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Turn the stop signals into a request to stop at the next step boundary, and restore
    the handlers before. A no-op outside the main thread (Python handles signals there)."""
    global _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received = None
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    _previous.update(before)
    for s in STOP_SIGNALS:
        signal.signal(s, _handle)
    try:
        yield
    finally:
        _received = None
        for s, handler in before.items():
            signal.signal(s, handler)  # type: ignore[arg-type]


@contextlib.contextmanager
def forward_to(pids: list[int]) -> Iterator[None]:
    """While active, a stop signal received here is also sent to ``pids`` (spawned ranks)."""
    _forward_pids[:] = pids
    try:
        yield
    finally:
        _forward_pids.clear()


def chain(signum: int) -> None:
    """Run the handler that was installed before :func:`stop_signals` for ``signum``, the
    signal that stopped the run, if it was a Python function (submitit's: requeue the SLURM
    job)."""
    handler = _previous.get(signum)
    if callable(handler):
        handler(signum, None)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
