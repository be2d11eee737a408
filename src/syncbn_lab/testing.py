"""Helpers for tests and benchmarks that need real ``torch.distributed`` ranks on CPU.

:func:`run_distributed` spawns ``world_size`` processes, joins them in one gloo process group
and runs a function on every rank. Any failure (an exception on one rank, a crash, a hang)
fails the call with the rank's traceback instead of hanging the caller: the process group
has a timeout, the whole job has a timeout, and every process is terminated on the way out.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DistributedJobError",
    "Fault",
    "error_ratio",
    "fault_override",
    "free_port",
    "load_function",
    "run_difference",
    "run_distributed",
    "train_cli",
    "torch_batchnorm_class",
]


class DistributedJobError(RuntimeError):
    """A spawned rank failed, died or timed out."""


FAULT_ACTIONS = ("raise", "kill", "hang", "term", "requeue", "diverge")


class Fault:
    """A training callback (``trainer.callbacks``) that makes one rank fail after one step:
    ``raise`` a RuntimeError, ``kill`` itself with SIGKILL, ``hang`` forever, ``term``: send
    itself SIGTERM (as a cluster stopping the job does) and train on, ``requeue``: in a SLURM
    job, ``scontrol requeue`` it and wait for the signal that stops it, or ``diverge``: set
    its replica's parameters to NaN (a divergence that starts on one rank).

    The config carries it to every rank however the run starts (spawned DDP, torchrun,
    SLURM), so tests of failure handling go through the real CLI; :func:`fault_override`
    writes the command-line override.
    """

    def __init__(self, action: str, rank: int, step: int):
        if action not in FAULT_ACTIONS:
            raise ValueError(f"Fault action {action!r}; choose one of {', '.join(FAULT_ACTIONS)}")
        self.action, self.rank, self.step = action, int(rank), int(step)

    def __call__(self, trainer: Any) -> None:
        if trainer.rt.rank != self.rank or trainer.state.step != self.step:
            return
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


def fault_override(action: str, rank: int, step: int) -> str:
    """The Hydra override that installs ``Fault(action, rank, step)`` as the only callback."""
    Fault(action, rank, step)  # refuse a bad action here, not inside the ranks
    return (
        f"trainer.callbacks=[{{_target_:{Fault.__module__}.Fault,"
        f"action:{action},rank:{rank},step:{step}}}]"
    )


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_function(target: str | Callable[..., Any]) -> Callable[..., Any]:
    """``"path/to/file.py:name"`` -> that function (imported by path); callables pass through.

    Loading by path keeps test helpers importable in spawned children whatever pytest's
    import mode is.
    """
    if callable(target):
        return target
    path, _, name = target.rpartition(":")
    module_name = "_syncbn_target_" + Path(path).stem
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(module, name)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    target: str | Callable[..., Any],
    args: tuple,
    results: mp.Queue,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        value = load_function(target)(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _context() -> mp.context.BaseContext:
    """forkserver with torch preloaded: every rank forks from a process that already imported
    torch (once per test session) instead of importing it anew, which dominates the cost of a
    small job. Falls back to spawn where forkserver does not exist."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "syncbn_lab.nn"])
    return ctx


def run_distributed(
    target: str | Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 30.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` new gloo ranks.

    Returns the per-rank return values (picklable), ordered by rank. Raises
    :class:`DistributedJobError` with the failing rank's traceback if any rank raises, dies or
    the job exceeds ``timeout_s``; collectives themselves time out after ``pg_timeout_s``.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, pg_timeout_s, target, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise DistributedJobError(
                        f"rank {dead[0]} of {world_size} died with exit code "
                        f"{procs[dead[0]].exitcode} before reporting"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise DistributedJobError(
                        f"distributed job timed out after {timeout_s:.0f}s; ranks {missing} "
                        "did not finish (a collective that some rank never joined?)"
                    ) from None
                continue
            if not ok:
                raise DistributedJobError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        results.close()
    return [values[r] for r in range(world_size)]


def torch_batchnorm_class(input_dim: int) -> type:
    """The torch.nn BatchNorm class for a 2-D to 5-D input (the independent reference)."""
    import torch

    classes = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d}
    classes |= {4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
    return classes[input_dim]


def _float64_pair(actual: Any, expected: Any) -> tuple[Any, Any]:
    """Both as float64 tensors of one shape (AssertionError if the shapes differ); Python
    numbers become float64 directly (torch.as_tensor would round them to float32 first)."""
    import torch

    def as_float64(x: Any) -> Any:
        return x.detach().double() if torch.is_tensor(x) else torch.tensor(x, dtype=torch.float64)

    actual, expected = as_float64(actual), as_float64(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    return actual, expected


def error_ratio(actual: Any, expected: Any, atol: float = 1e-5, rtol: float = 1e-5) -> float:
    """max |actual - expected| / (atol + rtol * |expected|) in float64; <= 1 means close."""
    actual, expected = _float64_pair(actual, expected)
    if actual.numel() == 0:
        return 0.0
    ratio = (actual - expected).abs() / (atol + rtol * expected.abs())
    return float(ratio.nan_to_num(nan=float("inf")).max())


TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train.py"


def train_cli(overrides: list[str], run_dir: Path, timeout_s: float = 1800.0) -> Path:
    """Run ``scripts/train.py`` (the real CLI) with ``overrides`` into ``run_dir``; returns
    ``run_dir``, or raises RuntimeError with the end of its stderr if the run fails."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"train.py {' '.join(overrides)} exited with {result.returncode}:\n"
            f"{result.stderr[-3000:]}"
        )
    return Path(run_dir)


def _relative(actual: Any, expected: Any) -> float:
    """max |actual - expected| / max |expected| (the absolute difference where expected is
    all zeros), in float64: a normwise relative difference that zeros cannot blow up."""
    a, b = _float64_pair(actual, expected)
    if a.numel() == 0:
        return 0.0
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def _checkpoint_tensors(run_dir: Path) -> dict[str, Any]:
    """Every tensor of ``checkpoints/last.pt`` that training produced: the model's state and
    the optimizer's per-parameter state (e.g. SGD momentum buffers)."""
    import torch

    state = torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=True)
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    for index, per_param in state["optimizer"]["state"].items():
        for name, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{index}.{name}"] = value
    return tensors


def _train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss of the per-step records of ``metrics.jsonl``; the end-of-epoch
    records (whose ``epoch`` is an int, not a fraction of epochs) are left out."""
    import json

    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    return {r["step"]: r["train/loss"] for r in records if isinstance(r["epoch"], float)}


def run_difference(run_a: Path, run_b: Path) -> dict[str, Any]:
    """How far two training runs are apart: the worst relative difference of the per-step
    training loss (``loss``, over steps; ``loss_step`` is where), and of the tensors of
    ``checkpoints/last.pt`` (``checkpoint``, normwise per tensor; ``checkpoint_tensor``).

    Runs that logged different steps or saved different tensors raise AssertionError.
    """
    losses_a, losses_b = _train_losses(run_a), _train_losses(run_b)
    if sorted(losses_a) != sorted(losses_b) or not losses_a:
        raise AssertionError(f"logged steps differ: {sorted(losses_a)} vs {sorted(losses_b)}")
    loss = {step: _relative(losses_a[step], losses_b[step]) for step in losses_a}
    tensors_a, tensors_b = _checkpoint_tensors(run_a), _checkpoint_tensors(run_b)
    if sorted(tensors_a) != sorted(tensors_b):
        raise AssertionError(f"checkpoint tensors differ: {sorted(tensors_a ^ tensors_b)}")
    tensors = {name: _relative(tensors_a[name], tensors_b[name]) for name in tensors_a}
    loss_step = max(loss, key=loss.get)
    worst_tensor = max(tensors, key=tensors.get)
    return {
        "loss": loss[loss_step],
        "loss_step": loss_step,
        "loss_by_step": [loss[step] for step in sorted(loss)],
        "checkpoint": tensors[worst_tensor],
        "checkpoint_tensor": worst_tensor,
        "tensors": len(tensors),
        "worst": max(loss[loss_step], tensors[worst_tensor]),
    }
