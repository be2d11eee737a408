"""Real ``torch.distributed`` ranks on CPU for tests and benchmarks.

:func:`run_distributed` spawns ``world_size`` processes, joins them in one gloo process group
and runs a function on every rank. Any failure (an exception on one rank, a crash, a hang)
fails the call with the rank's traceback instead of hanging the caller: the process group
has a timeout, the whole job has a timeout, and every process is terminated on the way out.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


class DistributedJobError(RuntimeError):
    """A spawned rank failed, died or timed out."""


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
        # Pickled by value here: through the queue torch's reductions would hand a tensor's
        # storage over as a file descriptor, which the parent can only fetch while this
        # process lives (it exits right after; the parent then fails with ECONNRESET).
        results.put((rank, True, pickle.dumps(value)))
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
            values[rank] = pickle.loads(value)
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
