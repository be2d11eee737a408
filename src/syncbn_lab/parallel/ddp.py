"""Real DDP: N rank processes spawned from this one, or the ranks torchrun started.

Spawned ranks are supervised here, so that a failure ends the whole run cleanly:

- every rank sends its outcome to the parent over its own pipe: rank 0's summary, or the
  exception it raised (one line, traceback, and whether it is a collective failing because a
  *peer* went away, which is a consequence and never the cause);
- when any rank fails (raises, dies by a signal, or its collectives time out after
  ``parallel.timeout_s``), the parent waits a moment for the other reports, stops the
  processes still running (SIGKILL), and raises :class:`RankFailed` with the
  root cause: the first error that is not a collective failure, else the rank that died
  without a word, else the rank whose collective gave up first;
- a rank that loses its parent (the parent was killed) exits by itself (a lifeline pipe).

Ranks rendezvous on a TCPStore the parent hosts on a free port, so concurrent runs never
race for a port. ``forkserver`` ranks fork from a server that has imported torch once.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf, open_dict

from syncbn_lab.engine import preemption
from syncbn_lab.errors import ConfigError, OneLineError, one_line, say
from syncbn_lab.machine import available_cores, torchrun_env
from syncbn_lab.parallel.context import Runtime

if TYPE_CHECKING:
    from collections.abc import Callable

    from syncbn_lab.shape import RunShape

GRACE_S = 3.0  # after a first failure: time to collect the other ranks' reports

# Messages of collectives that fail because another rank went away or hung.
_PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "gloo/transport",
    "nccl communicator was aborted",
    "socket closed",
)


class RankFailed(OneLineError):
    """A rank of a DDP run failed; ``str()`` is one line, ``remote_traceback`` the rank's own.

    Attributes: ``rank`` (None when no rank reported), ``remote_traceback`` (text or ""),
    ``pids`` (the rank processes, all stopped by the time this is raised).
    """

    def __init__(self, line: str, rank: int | None, remote_traceback: str, pids: list[int]):
        super().__init__(line)
        self.rank, self.remote_traceback, self.pids = rank, remote_traceback, pids


class PeerFailed(RuntimeError):
    """Under torchrun: this rank's collective failed because another rank went away."""


@dataclass
class _Report:
    rank: int
    time: float
    kind: str  # "ok" | "error"
    summary: dict[str, Any] | None = None
    line: str = ""
    traceback: str = ""
    peer_failure: bool = False
    exception: BaseException | None = None  # user errors travel as themselves


# -- entry points ---------------------------------------------------------------------------
def launch_ddp(cfg: DictConfig, shape: RunShape, worker, run_dir: Path) -> dict[str, Any]:
    """Run ``worker`` on every rank; return rank 0's summary (raise RankFailed on failure).
    ``shape`` (``config.validate``'s) travels to the ranks with the config."""
    launched = torchrun_env()
    if launched is not None:
        return _run_torchrun_rank(cfg, shape, worker, run_dir, launched)
    return _spawn_and_supervise(cfg, shape, worker, run_dir)


def _run_torchrun_rank(
    cfg, shape: RunShape, worker, run_dir: Path, env: dict[str, int]
) -> dict[str, Any]:
    """This process is one of torchrun's ranks: join the group (env://) and run. Rank 0 tells
    the others its run dir and the checkpoint the run continues (``trainer.resume`` as rank 0
    decided it: ``auto`` and torchrun's restarts are decided there)."""
    device = _join_torchrun_group(cfg, shape, env)
    try:
        # Only rank 0 has a Hydra run dir (scripts/train.py gives the others a temporary one).
        holder = [str(run_dir), cfg.trainer.get("resume"), None]
        dist.broadcast_object_list(holder, src=0)
        if holder[2] is not None:  # see refuse_torchrun_ranks
            say(f"rank {env['rank']} stopped: rank 0 refused the run ({holder[2]})")
            _said_and_done()
            sys.exit(ConfigError.exit_status)
        if env["rank"] != 0:
            with open_dict(cfg):
                cfg.trainer.resume = holder[1]
        rt = Runtime(
            device=device,
            rank=env["rank"],
            world_size=env["world_size"],
            local_rank=env["local_rank"],
        )
        try:
            return worker(rt, cfg, shape, Path(holder[0]))
        except Exception as e:
            if _is_peer_failure(e):
                raise PeerFailed(
                    f"rank {env['rank']} stopped: a collective failed because another rank "
                    f"failed or hung ({one_line(e)}); see that rank's error"
                ) from e
            raise
    finally:
        _destroy_process_group()


def refuse_torchrun_ranks(cfg: DictConfig, shape: RunShape, error: OneLineError) -> NoReturn:
    """torchrun's rank 0 cannot start the run (``error`` says why): say so, join the group the
    other ranks wait in and tell them, and exit once each has said that it stops. (torchrun
    ends every rank as soon as one exits: a rank that exits first would cut off the others'
    lines, or glue them to its own.)"""
    say(one_line(error))
    env = torchrun_env()
    if env is not None:
        try:
            _join_torchrun_group(cfg, shape, env)
            dist.broadcast_object_list([None, None, one_line(error)], src=0)
            _said_and_done()
        except Exception:  # the others are gone already: rank 0's own line is what counts
            pass
        finally:
            _destroy_process_group()
    sys.exit(error.exit_status)


def _said_and_done() -> None:
    """Every rank has printed why it stops (a barrier; a rank already gone is no matter)."""
    try:
        dist.barrier()
    except Exception:
        pass


def _join_torchrun_group(cfg: DictConfig, shape: RunShape, env: dict[str, int]) -> torch.device:
    """Join torchrun's process group on this rank's device; returns the device.

    The group meets in torchrun's store (env://) under a prefix of its own per attempt: the
    agent's store outlives a restart, and without the prefix a restarted rank that comes
    first reads the addresses the failed attempt's ranks left there and waits on them."""
    device = _device_for(shape, env["local_rank"])
    _set_threads(cfg, env["local_world_size"])
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        dist.init_process_group(
            shape.backend,
            store=dist.PrefixStore(f"syncbn_lab/attempt_{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    except Exception as e:  # a rank that went away before the group formed
        raise PeerFailed(
            f"rank {env['rank']} could not join the process group ({one_line(e)[:200]}); "
            "see the other ranks' errors"
        ) from None
    return device


def _spawn_and_supervise(cfg: DictConfig, shape: RunShape, worker, run_dir: Path) -> dict[str, Any]:
    p = cfg.parallel
    world_size = int(p.devices)
    ctx = mp.get_context(p.start_method)
    if p.start_method == "forkserver":
        ctx.set_forkserver_preload(["syncbn_lab.parallel.ddp", "syncbn_lab.train"])
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        None,
        True,
        timeout=datetime.timedelta(seconds=p.timeout_s),
        wait_for_workers=False,
    )
    container = OmegaConf.to_container(cfg, resolve=True)
    lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
    procs, conns = [], {}
    try:
        for rank in range(world_size):
            report_r, report_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                name=f"syncbn-lab-rank{rank}",
                args=(
                    rank,
                    world_size,
                    store.port,
                    container,
                    shape,
                    str(run_dir),
                    worker,
                    dict(os.environ),
                    report_w,
                    lifeline_r,
                ),
            )
            proc.start()
            report_w.close()
            procs.append(proc)
            conns[report_r] = rank
        lifeline_r.close()
        with preemption.forward_to([proc.pid for proc in procs]):  # SIGTERM reaches every rank
            return _supervise(procs, conns)
    finally:
        _stop(procs)
        lifeline_w.close()
        for conn in conns:
            conn.close()
        del store


# -- the parent -----------------------------------------------------------------------------
def _supervise(procs: list, conns: dict[Connection, int]) -> dict[str, Any]:
    reports: dict[int, _Report] = {}
    exitcodes: dict[int, int] = {}
    sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    open_conns = dict(conns)
    failed_at: float | None = None
    while len(exitcodes) < len(procs) or open_conns:
        waiting = list(open_conns) + [s for s, r in sentinels.items() if r not in exitcodes]
        timeout = None if failed_at is None else max(0.0, failed_at + GRACE_S - time.monotonic())
        ready = wait(waiting, timeout) if waiting else []
        if not ready:
            break  # the grace period after a failure is over
        # Read reports before exits, so a rank's report is there when its exit is seen.
        for obj in sorted(ready, key=lambda o: o not in open_conns):
            if obj in open_conns:
                rank = open_conns[obj]
                try:
                    report = obj.recv()
                except (EOFError, OSError):
                    del open_conns[obj]
                    continue
                reports[rank] = report
                if report.kind == "error" and failed_at is None:
                    failed_at = time.monotonic()
            else:
                rank = sentinels[obj]
                procs[rank].join()
                exitcodes[rank] = procs[rank].exitcode
                if exitcodes[rank] != 0 and failed_at is None:
                    failed_at = time.monotonic()
    pids = [proc.pid for proc in procs]
    if failed_at is None and all(code == 0 for code in exitcodes.values()):
        summary = reports.get(0)
        return summary.summary if summary is not None and summary.summary else {}
    _stop(procs)
    raise _root_cause(reports, exitcodes, len(procs), pids)


def _root_cause(
    reports: dict[int, _Report], exitcodes: dict[int, int], world_size: int, pids: list[int]
) -> BaseException:
    errors = sorted(
        (r for r in reports.values() if r.kind == "error"), key=lambda r: (r.time, r.rank)
    )
    primary = [r for r in errors if not r.peer_failure]
    if primary:
        first = primary[0]
        if first.exception is not None:
            return first.exception  # a user error (bad config, missing data): one line
        return RankFailed(
            f"rank {first.rank} failed: {first.line}", first.rank, first.traceback, pids
        )
    silent_deaths = sorted(
        rank for rank, code in exitcodes.items() if code != 0 and rank not in reports
    )
    if silent_deaths:
        rank = silent_deaths[0]
        how = _describe_exit(exitcodes[rank])
        return RankFailed(f"rank {rank} died ({how}); the other ranks were stopped", rank, "", pids)
    hung = [r for r in range(world_size) if r not in reports and r not in exitcodes]
    if errors:
        first = errors[0]
        if hung:
            line = (
                f"rank(s) {', '.join(map(str, hung))} stopped responding: rank {first.rank}'s "
                f"collective gave up ({first.line})"
            )
            return RankFailed(line, hung[0], first.traceback, pids)
        return RankFailed(
            f"rank {first.rank} failed: {first.line}", first.rank, first.traceback, pids
        )
    codes = ", ".join(f"rank {r}: {_describe_exit(c)}" for r, c in sorted(exitcodes.items()))
    return RankFailed(f"ranks exited without a report ({codes})", None, "", pids)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(procs: list) -> None:
    """SIGKILL every rank still running. (Ranks take SIGTERM as a request to checkpoint at
    the next step, which a rank blocked in a collective never reaches.)"""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()


# -- one spawned rank ------------------------------------------------------------------------
def _rank_main(
    rank: int,
    world_size: int,
    store_port: int,
    container: dict,
    shape: RunShape,
    run_dir: str,
    worker,
    environ: dict[str, str],
    report: Connection,
    lifeline: Connection,
) -> None:
    """Entry point of a spawned rank: report the outcome, never print a traceback."""
    os.environ.clear()
    os.environ.update(environ)  # forkserver children would otherwise get the server's env
    _watch_parent(lifeline)
    if rank > 0:
        warnings.filterwarnings("ignore")  # one copy of each warning (rank 0's) is enough
    code = 0
    try:
        cfg = OmegaConf.create(container)
        device = _device_for(shape, rank)
        _set_threads(cfg, world_size)
        timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
        store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=timeout)
        dist.init_process_group(
            shape.backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        rt = Runtime(device=device, rank=rank, world_size=world_size, local_rank=rank)
        with preemption.stop_signals():
            summary = worker(rt, cfg, shape, Path(run_dir))
        report.send(_Report(rank, time.time(), "ok", summary=summary if rank == 0 else None))
    except KeyboardInterrupt:
        code = 130  # the terminal's Ctrl-C reached every rank; the parent reports it once
    except Exception as e:
        code = 1
        _send_error(report, rank, e)
    finally:
        _destroy_process_group()
        report.close()
    if container["parallel"]["start_method"] == "spawn":
        exit_rank(code)  # a spawned interpreter would tear down under gloo's threads
    sys.exit(code)  # forkserver children end with os._exit: no teardown, no atexit


def _send_error(report: Connection, rank: int, e: Exception) -> None:
    message = _Report(
        rank,
        time.time(),
        "error",
        line=one_line(e),
        traceback=traceback.format_exc(),
        peer_failure=_is_peer_failure(e),
        exception=e if isinstance(e, OneLineError) else None,
    )
    try:
        report.send(message)
    except Exception:  # the exception itself does not pickle: send it as text
        message.exception = None
        report.send(message)


def _watch_parent(lifeline: Connection) -> None:
    """Exit when the parent goes away (its end of the lifeline closes): no orphans."""

    def watch() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="parent-lifeline", daemon=True).start()


# -- helpers ------------------------------------------------------------------------------
def _device_for(shape: RunShape, local_rank: int) -> torch.device:
    if shape.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _set_threads(cfg: DictConfig, local_world_size: int) -> None:
    """trainer.threads, else the cores shared out among this machine's ranks."""
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    elif "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    else:
        torch.set_num_threads(max(1, available_cores() // local_world_size))


def _destroy_process_group() -> None:
    """Destroy the group if there is one; give up after 10 s (a wedged backend)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        done.set()

    threading.Thread(target=destroy, daemon=True).start()
    done.wait(10)


def run_torchrun_rank(main: Callable[[], object]) -> NoReturn:
    """Run ``main`` in a rank torchrun started and end the process with :func:`exit_rank`
    and the code of main's SystemExit (0 when main returns)."""
    code: object = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    exit_rank(code)


def exit_rank(code: object) -> NoReturn:
    """End a rank's process as Python's own exit does (the exit code as SystemExit reads
    it, the atexit functions, the flushed streams) without the interpreter's teardown.

    destroy_process_group leaves gloo's worker threads running. One that drops a finished
    collective's tensor while the interpreter tears down must take the GIL, Python ends the
    thread inside a C++ destructor, and std::terminate aborts the rank (SIGABRT) after its
    run has finished: the job then fails, or torchrun restarts it. A core dump of it shows
    ``ProcessGroupGloo::AsyncWork::~AsyncWork -> decref_pyobject -> take_gil ->
    pthread_exit`` on a worker thread while the main thread is in ``Py_FinalizeEx``; on 2
    cores about one exit in 50 to 100 of a two-rank gloo job."""
    atexit._run_exitfuncs()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # what sys.exit("message") prints
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to write
            pass
    os._exit(code or 0)


def _is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another rank died or hung."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(m in text for m in _PEER_FAILURE_MARKERS)
