"""Wrap a built model for its parallel mode: what trains, what is evaluated and saved."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig
from torch import nn

from syncbn_lab.parallel.bn_buffers import BNBuffers, DistributedBNBuffers, EmulatedBNBuffers
from syncbn_lab.parallel.context import Runtime
from syncbn_lab.traffic import count_ddp_traffic


@dataclass
class Parallel:
    """``model`` trains (DDP, DataParallel, EmulatedDevices or the module itself);
    ``module`` is torchvision's ``model_without_ddp``: evaluated and checkpointed."""

    model: nn.Module
    module: nn.Module
    bn_buffers: BNBuffers = field(default_factory=BNBuffers)


def parallelize(model: nn.Module, cfg: DictConfig, rt: Runtime) -> Parallel:
    """Wrap ``model`` (already on ``rt.device``, norm layers built for the mode)."""
    p = cfg.parallel
    if p.name == "ddp":
        import inspect

        from torch.nn.parallel import DistributedDataParallel

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
    if p.name == "emulated":
        from syncbn_lab.parallel.emulated import EmulatedDevices

        emulated = EmulatedDevices(
            model,
            p.devices,
            broadcast_buffers=p.broadcast_buffers,
            track_all_devices=p.dist_bn == "reduce",
        )
        return Parallel(emulated, model, EmulatedBNBuffers(emulated, p.dist_bn))
    if p.name == "dp":
        from syncbn_lab.parallel.dp import data_parallel

        return Parallel(data_parallel(model, p.devices, p.loss_in_module), model)
    return Parallel(model, model)
