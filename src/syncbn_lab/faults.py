"""Fault injection through the real CLI: a training callback that makes one rank fail, so
the failure handling (DDP's supervisor, multirun, SLURM) is tested as a user meets it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import torch

FAULT_ACTIONS = ("raise", "kill", "hang", "term", "requeue", "diverge")


class Fault:
    """A training callback (``trainer.callbacks``) that makes one rank fail after one step:
    ``raise`` a RuntimeError, ``kill`` itself with SIGKILL, ``hang`` forever, ``term``: send
    itself SIGTERM (as a cluster stopping the job does) and train on, ``requeue``: in a SLURM
    job, ``scontrol requeue`` it and wait for the signal that stops it, or ``diverge``: set
    its replica's parameters to NaN (a divergence that starts on one rank).

    The config carries it to every rank however the run starts (spawned DDP, torchrun,
    SLURM), so tests of failure handling go through the real CLI; :func:`fault_override`
    writes the command-line override. It fires in torchrun's attempt ``attempt`` only (0:
    the first, and always outside torchrun), and with ``devices`` only in runs over that
    many devices (a sweep's cells that fail as they run, beside cells that finish).
    """

    def __init__(
        self, action: str, rank: int, step: int, attempt: int = 0, devices: int | None = None
    ):
        if action not in FAULT_ACTIONS:
            raise ValueError(f"Fault action {action!r}; choose one of {', '.join(FAULT_ACTIONS)}")
        self.action, self.rank, self.step = action, int(rank), int(step)
        self.attempt = int(attempt)
        self.devices = None if devices is None else int(devices)

    def __call__(self, trainer: Any) -> None:
        if trainer.rt.rank != self.rank or trainer.state.step != self.step:
            return
        if self.devices is not None and trainer.cfg.parallel.devices != self.devices:
            return
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) != self.attempt:
            return  # a worker that torchrun restarted trains past the step its fault was for
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.action == "requeue":
            from syncbn_lab.engine import preemption

            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
            deadline = time.monotonic() + 60
            while preemption.requested() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        if self.action == "diverge":
            with torch.no_grad():
                for parameter in trainer.module.parameters():
                    parameter.fill_(float("nan"))
            return
        while self.action == "hang":
            time.sleep(1)
        raise RuntimeError(f"injected fault on rank {self.rank} at step {self.step}")


def fault_override(action: str, rank: int, step: int, devices: int | None = None) -> str:
    """The Hydra override that installs ``Fault(action, rank, step, devices=devices)`` as the
    only callback."""
    Fault(action, rank, step, devices=devices)  # refuse a bad action here, not in the ranks
    only = "" if devices is None else f",devices:{devices}"
    return (
        f"trainer.callbacks=[{{_target_:{Fault.__module__}.Fault,"
        f"action:{action},rank:{rank},step:{step}{only}}}]"
    )
