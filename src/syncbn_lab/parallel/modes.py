"""The `parallel` config group: one :class:`ParallelMode` per mode, found by its config name.

| mode       | processes           | device slices a norm layer sees | reduction across devices   |
|------------|---------------------|---------------------------------|----------------------------|
| `single`   | 1                   | 1                               | none                       |
| `emulated` | 1                   | parallel.devices                | a sum over the slice axis  |
| `ddp`      | parallel.devices    | 1                               | torch.distributed          |
| `dp`       | 1 (N CUDA replicas) | 1 (each replica its own slice)  | none (no communicator)     |

A mode holds everything the rest of the code asks about it: its checks, how it launches the
worker(s), the Runtime each worker gets, how it wraps the model, and how many device slices a
norm layer sees. Nobody else compares mode names.

``parallel.devices`` is the number of devices of the run, in every mode. What one process
or one layer handles is derived from it here: ``slices_per_process`` (the device slices one
process's batch holds) and ``device_slices`` (the slices one norm layer normalises apart).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from omegaconf import DictConfig
from torch import nn

from syncbn_lab.checks import positive
from syncbn_lab.errors import ConfigError, warn_one_line
from syncbn_lab.machine import available_cores, torchrun_env
from syncbn_lab.parallel.context import Runtime
from syncbn_lab.parallel.wrap import Parallel

if TYPE_CHECKING:
    from syncbn_lab.shape import RunShape


class Variant(Protocol):
    """What a parallel mode's checks ask of a norm variant (``variants.NormVariant``)."""

    name: str
    synchronises: bool


Worker = Callable[[Runtime, DictConfig, "RunShape", Path], dict[str, Any]]
"""Everything one process of a run does (``train.worker``); a mode's ``launch`` runs it."""

GROUP = "parallel"
DIST_BN = ("none", "broadcast", "reduce")
BACKENDS = ("auto", "gloo", "nccl")
START_METHODS = ("forkserver", "spawn")


@dataclass(frozen=True)
class ParallelMode:
    """One parallel mode.

    ``emulated``: one process computes every device's slice, each norm layer normalising the
    slices apart. ``distributed``: one process per device, joined by torch.distributed.
    ``compile_refusal``: why trainer.compile cannot run under this mode (None: it can).
    """

    name: str
    emulated: bool = False
    distributed: bool = False
    compile_refusal: str | None = None

    def device_slices(self, devices: int) -> int:
        """Device slices one norm layer sees in a forward (and normalises apart)."""
        return devices if self.emulated else 1

    def slices_per_process(self, devices: int) -> int:
        """Device slices one process's batch holds (its loader yields them in order)."""
        return 1

    def check(self, cfg: DictConfig, variant: Variant, device: str) -> None:
        """The mode's own keys and impossible combinations, as one-line ConfigErrors."""
        dist_bn = cfg.parallel.get("dist_bn", "none")
        if dist_bn not in DIST_BN:
            raise ConfigError(
                f"parallel.dist_bn={dist_bn} is unknown; choose one of {', '.join(DIST_BN)}"
            )
        launched = torchrun_env()
        if launched is not None and not self.distributed and launched["world_size"] > 1:
            raise ConfigError(
                f"torchrun started WORLD_SIZE={launched['world_size']} processes but "
                f"parallel={self.name}; use parallel=ddp under torchrun"
            )
        if cfg.trainer.get("compile", False) and self.compile_refusal:
            raise ConfigError(self.compile_refusal)

    def backend(self, cfg: DictConfig, device: str) -> str | None:
        """The torch.distributed backend its processes join (None: no process group)."""
        return None

    def runtime(self, shape: RunShape) -> Runtime:
        """The Runtime of this mode's one process."""
        return Runtime(
            device=torch.device(shape.device), slices_per_process=shape.slices_per_process
        )

    def launch(
        self, cfg: DictConfig, shape: RunShape, worker: Worker, run_dir: Path
    ) -> dict[str, Any]:
        """Run ``worker`` in the process(es) this mode needs; return rank 0's summary."""
        return worker(self.runtime(shape), cfg, shape, run_dir)

    def wrap(self, model: nn.Module, cfg: DictConfig, rt: Runtime) -> Parallel:
        """``model`` (on ``rt.device``, norm layers built for the mode) wrapped to train."""
        return Parallel(model, model)


class _Single(ParallelMode):
    def check(self, cfg, variant, device):
        super().check(cfg, variant, device)
        if cfg.parallel.devices != 1:
            raise ConfigError(
                f"parallel={self.name} runs on one device but parallel.devices="
                f"{cfg.parallel.devices}; use parallel=emulated or parallel=ddp for several "
                "devices"
            )


class _Emulated(ParallelMode):
    """One process with exactly the numerics of N devices (parallel/emulated.py)."""

    def slices_per_process(self, devices):
        return devices

    def wrap(self, model, cfg, rt):
        from syncbn_lab.parallel.bn_buffers import EmulatedBNBuffers
        from syncbn_lab.parallel.emulated import EmulatedDevices

        p = cfg.parallel
        emulated = EmulatedDevices(
            model,
            p.devices,
            broadcast_buffers=p.broadcast_buffers,
            track_all_devices=p.dist_bn == "reduce",
        )
        return Parallel(emulated, model, EmulatedBNBuffers(emulated, p.dist_bn))


class _DataParallel(ParallelMode):
    """torch.nn.DataParallel: one process holding N CUDA devices (parallel/dp.py)."""

    def slices_per_process(self, devices):
        return devices

    def check(self, cfg, variant, device):
        super().check(cfg, variant, device)
        p = cfg.parallel
        visible = torch.cuda.device_count() if device == "cuda" else 0
        if visible < p.devices:
            raise ConfigError(
                f"parallel={self.name} parallel.devices={p.devices} needs {p.devices} CUDA "
                f"devices but {visible} are visible; use parallel=emulated "
                f"parallel.devices={p.devices} (same numerics in one process)"
            )
        if variant.synchronises:
            raise ConfigError(
                f"bn={variant.name} does not synchronise under DataParallel (its replicas would "
                "silently use per-replica statistics); use parallel=emulated or parallel=ddp "
                "with bn=sync"
            )

    def runtime(self, shape):
        # the process holds N devices; the loader yields their slices in order
        return Runtime(device=torch.device("cuda", 0), slices_per_process=shape.slices_per_process)

    def wrap(self, model, cfg, rt):
        from syncbn_lab.parallel.dp import data_parallel, forward_loss_in_module

        p = cfg.parallel
        wrapped = data_parallel(model, p.devices, p.loss_in_module)
        return Parallel(
            wrapped, model, model_loss=forward_loss_in_module if p.loss_in_module else None
        )


class _DDP(ParallelMode):
    """DistributedDataParallel: N spawned ranks, or the ranks torchrun started."""

    def check(self, cfg, variant, device):
        super().check(cfg, variant, device)
        p = cfg.parallel
        positive(p.timeout_s, "parallel.timeout_s")
        if p.start_method not in START_METHODS:
            raise ConfigError(
                f"parallel.start_method={p.start_method} is unknown; choose forkserver or spawn"
            )
        if p.backend not in BACKENDS:
            raise ConfigError(f"parallel.backend={p.backend} is unknown; choose auto, gloo or nccl")
        if self.backend(cfg, device) == "nccl" and device != "cuda":
            raise ConfigError(
                "parallel.backend=nccl needs CUDA; use parallel.backend=gloo (or auto) on CPU"
            )
        launched = torchrun_env()
        if launched is not None:
            if p.devices != launched["world_size"]:
                raise ConfigError(
                    f"torchrun started WORLD_SIZE={launched['world_size']} processes but "
                    f"parallel.devices={p.devices}; pass parallel.devices="
                    f"{launched['world_size']}"
                )
            return
        if device == "cuda" and torch.cuda.device_count() < p.devices:
            raise ConfigError(
                f"parallel={self.name} parallel.devices={p.devices} needs {p.devices} CUDA "
                f"devices (one per process) but {torch.cuda.device_count()} are visible; use "
                "parallel=emulated or trainer.device=cpu (gloo)"
            )
        if device == "cpu" and p.devices > available_cores():
            warn_one_line(
                f"parallel={self.name} starts {p.devices} gloo processes on "
                f"{available_cores()} CPU core(s): they time-share the cores (same results, "
                "slower; parallel=emulated gives the same numerics in one process)"
            )

    def backend(self, cfg, device):
        backend = cfg.parallel.backend
        return backend if backend != "auto" else ("nccl" if device == "cuda" else "gloo")

    def launch(self, cfg, shape, worker, run_dir):
        from syncbn_lab.parallel.ddp import launch_ddp

        return launch_ddp(cfg, shape, worker, run_dir)

    def wrap(self, model, cfg, rt):
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        from syncbn_lab.parallel.bn_buffers import DistributedBNBuffers
        from syncbn_lab.traffic import count_ddp_traffic

        p = cfg.parallel
        # torch >= 2.14 names broadcast_buffers forward_sync_buffers (same behaviour in forward)
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        sync_key = (
            "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        )
        ddp = DistributedDataParallel(
            model,
            device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
            find_unused_parameters=p.find_unused_parameters,
            **{sync_key: p.broadcast_buffers},
        )
        count_ddp_traffic(ddp)  # summary.json's comm_*_bytes_per_step
        return Parallel(ddp, model, DistributedBNBuffers(model, p.dist_bn))


MODES: dict[str, ParallelMode] = {}
"""Every parallel mode by config name."""


def register(mode: ParallelMode) -> ParallelMode:
    """Add ``mode`` to :data:`MODES` (a config with ``parallel.name`` = its name finds it)."""
    MODES[mode.name] = mode
    return mode


for _mode in (
    _Single("single"),
    _Emulated("emulated", emulated=True),
    _DDP("ddp", distributed=True),
    _DataParallel(
        "dp",
        compile_refusal=(
            "trainer.compile=true cannot compile DataParallel (its replicas are made on every "
            "forward); use trainer.compile=false, or parallel=emulated for the same numerics"
        ),
    ),
):
    register(_mode)


def mode(name: str) -> ParallelMode:
    """The mode called ``name``; a one-line ConfigError naming the choices otherwise."""
    try:
        return MODES[name]
    except KeyError:
        raise ConfigError(f"{GROUP}={name} is unknown; choose one of {', '.join(MODES)}") from None


def parallelize(model: nn.Module, cfg: DictConfig, rt: Runtime) -> Parallel:
    """Wrap ``model`` (already on ``rt.device``, norm layers built for the mode) as the
    parallel mode says."""
    return mode(cfg.parallel.name).wrap(model, cfg, rt)
