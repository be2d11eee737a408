"""Checks of the composed config that Hydra cannot make, and the values derived from it.

Every check raises ``ConfigError`` with one line naming the problem and the fix, before
any process starts or any file is written.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from syncbn_lab.engine import compute
from syncbn_lab.errors import ConfigError, warn_one_line

PRECISIONS = ("fp32", "fp64", "bf16", "fp16")
PARALLEL_MODES = ("single", "emulated", "ddp", "dp")
DIST_BN = ("none", "broadcast", "reduce")
BACKENDS = ("auto", "gloo", "nccl")


def validate(cfg: DictConfig) -> DictConfig:
    """Check ``cfg`` and add ``cfg.derived`` (per-device batch, device type). Returns cfg."""
    t, p = cfg.trainer, cfg.parallel
    _positive(t.global_batch_size, "trainer.global_batch_size")
    _positive(t.epochs, "trainer.epochs")
    _positive(t.accumulate, "trainer.accumulate")
    _positive(t.log_every, "trainer.log_every")
    _positive(t.eval_every, "trainer.eval_every")
    _positive(t.eval_batch_size, "trainer.eval_batch_size")
    _positive(p.devices, "parallel.devices")
    if t.max_steps is not None:
        _positive(t.max_steps, "trainer.max_steps")
    if t.get("eval_images") is not None:
        _positive(t.eval_images, "trainer.eval_images")
    if t.get("overfit_batches") is not None:
        _positive(t.overfit_batches, "trainer.overfit_batches")
    from syncbn_lab.engine.checkpoint import parse_every

    parse_every(t.get("checkpoint_every"))
    if p.name == "single" and p.devices != 1:
        raise ConfigError(
            f"parallel=single runs on one device but parallel.devices={p.devices}; "
            "use parallel=emulated or parallel=ddp for several devices"
        )
    split = p.devices * t.accumulate
    if t.global_batch_size % split:
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by "
            f"parallel.devices x trainer.accumulate = {p.devices} x {t.accumulate}; "
            "pick a global batch that is a multiple of their product"
        )
    if t.precision not in PRECISIONS:
        raise ConfigError(
            f"trainer.precision={t.precision} is unknown; choose one of {', '.join(PRECISIONS)}"
        )
    device = resolve_device(t.device)
    if t.precision == "fp16" and device != "cuda":
        raise ConfigError(
            "trainer.precision=fp16 needs CUDA; use trainer.precision=bf16 or fp32 on CPU"
        )
    if cfg.bn.name == "torch_sync" and device != "cuda":
        raise ConfigError(
            "bn=torch_sync (torch.nn.SyncBatchNorm) runs only on CUDA; use bn=sync, "
            "this project's SyncBatchNorm, which also runs on CPU"
        )
    _check_components(cfg)
    _check_callbacks(t.get("callbacks"))
    compute.check(cfg)
    if cfg.bn.name == "brn":
        _check_batch_renorm(cfg)
    derived = {"per_device_batch_size": t.global_batch_size // split, "device": device}
    derived.update(_check_parallel(cfg, device))
    with open_dict(cfg):
        cfg.derived = OmegaConf.create(derived)
    return cfg


# Numeric config values and their allowed interval (low, high, low itself allowed), checked
# where the composed config has the key; None = unbounded.
_RANGES = {
    "bn.eps": (0.0, None, False),
    "bn.momentum": (0.0, 1.0, True),
    "optim.lr": (0.0, None, True),
    "optim.momentum": (0.0, None, True),
    "optim.weight_decay": (0.0, None, True),
    "optim.eps": (0.0, None, False),
    "sched.warmup_epochs": (0.0, None, True),
    "sched.warmup_start_ratio": (0.0, 1.0, True),
    "sched.min_lr_ratio": (0.0, 1.0, True),
    "sched.pct_start": (0.0, 1.0, False),
    "sched.div_factor": (0.0, None, False),
    "sched.final_div_factor": (0.0, None, False),
    "sched.gamma": (0.0, None, False),
}
_NULLABLE = {"bn.momentum"}  # null = cumulative average


def _check_components(cfg: DictConfig) -> None:
    """Names and values of the data, model, bn, optim and sched groups, which would otherwise
    fail with a traceback deep inside the run (or after the first epoch)."""
    from syncbn_lab import models
    from syncbn_lab.data import DATASET_NAMES
    from syncbn_lab.engine.optim import OPTIMIZERS, SCHEDULES
    from syncbn_lab.nn.registry import NAMES as BN_NAMES

    names = {
        "data": (DATASET_NAMES, cfg.data.get("name")),
        "model": ((*models.CIFAR_DEPTHS, *models.TORCHVISION_ARCHS), cfg.model.name),
        "bn": (BN_NAMES, cfg.bn.name),
        "optim": (OPTIMIZERS, cfg.optim.name),
        "sched": (SCHEDULES, cfg.sched.name),
    }
    for group, (valid, name) in names.items():
        if name not in valid:
            raise ConfigError(
                f"{group}.name={name} is unknown; choose one with {group}=<name>, one of "
                f"{', '.join(valid)}"
            )
    if "width" in cfg.model:
        _positive(cfg.model.width, "model.width")
    for key, (low, high, low_allowed) in _RANGES.items():
        group, field = key.split(".")
        if field in cfg[group]:
            nullable = key in _NULLABLE
            _in_range(cfg[group][field], key, low, high, low_allowed, nullable=nullable)
    if "betas" in cfg.optim:
        betas = cfg.optim.betas
        if not (OmegaConf.is_list(betas) and len(betas) == 2):
            raise ConfigError(
                f"optim.betas={betas} must be two numbers, e.g. optim.betas=[0.9,0.999]"
            )
        for i, beta in enumerate(betas):
            _in_range(beta, f"optim.betas[{i}]", 0.0, 1.0, True, high_allowed=False)
    if "milestones" in cfg.sched:
        milestones = cfg.sched.milestones
        if not OmegaConf.is_list(milestones):
            raise ConfigError(
                f"sched.milestones={milestones} must be a list of fractions of trainer.epochs, "
                "e.g. sched.milestones=[0.5,0.75]"
            )
        for i, m in enumerate(milestones):
            _in_range(m, f"sched.milestones[{i}]", 0.0, None, True)
    bn = cfg.bn
    if bn.name == "sync":
        from syncbn_lab.nn.functional import IMPLS

        if bn.get("impl", "auto") not in IMPLS:
            raise ConfigError(f"bn.impl={bn.impl} is unknown; choose one of {', '.join(IMPLS)}")
        if bn.get("group_size") is not None:
            _positive(bn.group_size, "bn.group_size")
            if cfg.parallel.devices % bn.group_size:
                raise ConfigError(
                    f"bn.group_size={bn.group_size} does not divide parallel.devices="
                    f"{cfg.parallel.devices}; pick a divisor of the device count (or null)"
                )
    if bn.name == "gn":
        _positive(bn.groups, "bn.groups")
        _check_groups(cfg, bn.groups)


def _check_groups(cfg: DictConfig, groups: int) -> None:
    """bn=gn: bn.groups (capped at a layer's channels) must divide every norm layer's
    channels; the model is built on the meta device (no memory, no compute) to find them."""
    from torch import nn

    from syncbn_lab import models

    channels: set[int] = set()

    def record(c: int) -> nn.Module:
        channels.add(c)
        return nn.Identity()

    with torch.device("meta"):
        models.build(cfg.model, record, num_classes=10, in_channels=3)
    counts = sorted(channels)
    if any(c % min(groups, c) for c in counts):
        valid = [g for g in range(1, counts[-1] + 1) if all(c % min(g, c) == 0 for c in counts)]
        raise ConfigError(
            f"bn.groups={groups} does not divide the channels of every norm layer of "
            f"model={cfg.model.name} ({', '.join(map(str, counts))}); choose bn.groups from "
            f"{', '.join(map(str, valid))}"
        )


def _check_callbacks(nodes) -> None:
    """trainer.callbacks: a list of Hydra nodes whose ``_target_`` can be imported."""
    if not nodes:
        return
    if not OmegaConf.is_list(nodes):
        raise ConfigError(
            f"trainer.callbacks={nodes} must be a list of {{_target_: module.name, ...}} nodes"
        )
    for node in nodes:
        target = str(node.get("_target_")) if OmegaConf.is_dict(node) else str(node)
        module, _, name = target.rpartition(".")
        try:
            found = callable(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError, ValueError):
            found = False
        if not found:
            raise ConfigError(
                f"trainer.callbacks: cannot import _target_={target}; give each callback a "
                "_target_ naming an importable callable (module.name)"
            )


def _check_batch_renorm(cfg: DictConfig) -> None:
    """bn=brn: the limits, the schedule's fractions, and the emulation's one limitation."""
    bn, p = cfg.bn, cfg.parallel
    for key in ("rmax", "dmax", "warmup", "ramp"):
        value = bn.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"bn.{key}={value} must be a number; set it in configs/bn/brn.yaml")
    if not 1 <= bn.rmax < float("inf"):
        raise ConfigError(f"bn.rmax={bn.rmax} must be >= 1 (r is clipped to [1/rmax, rmax])")
    if not 0 <= bn.dmax < float("inf"):
        raise ConfigError(f"bn.dmax={bn.dmax} must be >= 0 (d is clipped to [-dmax, dmax])")
    for key in ("warmup", "ramp"):
        if not 0 <= bn[key] <= 1:
            raise ConfigError(f"bn.{key}={bn[key]} must be a fraction of the run in [0, 1]")
    if bn.warmup + bn.ramp > 1:
        raise ConfigError(
            f"bn.warmup + bn.ramp = {bn.warmup} + {bn.ramp} > 1: the ramp does not fit in the "
            "run; lower bn.warmup or bn.ramp"
        )
    accumulate, broadcast = cfg.trainer.accumulate, p.get("broadcast_buffers", True)
    if p.name == "emulated" and p.devices > 1 and (accumulate > 1 or not broadcast):
        raise ConfigError(
            "bn=brn under parallel=emulated gives every device device 0's running statistics, "
            "which is what DDP does only when every forward starts from rank 0's buffers; use "
            "trainer.accumulate=1 and parallel.broadcast_buffers=true, or parallel=ddp"
        )


def torchrun_env() -> dict[str, int] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK (and LOCAL_WORLD_SIZE) when torchrun started this process."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(k in os.environ for k in keys):
        return None
    env = {k.lower(): int(os.environ[k]) for k in keys}
    env["local_world_size"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"]))
    return env


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _check_parallel(cfg: DictConfig, device: str) -> dict:
    """The parallel mode's impossible combinations; returns derived values (DDP backend)."""
    p, bn = cfg.parallel, cfg.bn.name
    if p.name not in PARALLEL_MODES:
        raise ConfigError(
            f"parallel={p.name} is unknown; choose one of {', '.join(PARALLEL_MODES)}"
        )
    dist_bn = p.get("dist_bn", "none")
    if dist_bn not in DIST_BN:
        raise ConfigError(
            f"parallel.dist_bn={dist_bn} is unknown; choose one of {', '.join(DIST_BN)}"
        )
    launched = torchrun_env()
    if launched is not None and p.name != "ddp" and launched["world_size"] > 1:
        raise ConfigError(
            f"torchrun started WORLD_SIZE={launched['world_size']} processes but "
            f"parallel={p.name}; use parallel=ddp under torchrun"
        )
    if p.name == "emulated" and bn == "torch_sync":
        raise ConfigError(
            "bn=torch_sync cannot emulate devices (torch.nn.SyncBatchNorm synchronises only "
            "across DDP processes); use bn=sync with parallel=emulated"
        )
    if p.name == "dp":
        return _check_dp(p, bn, device)
    if p.name != "ddp":
        return {}
    _positive(p.timeout_s, "parallel.timeout_s")
    if p.start_method not in ("forkserver", "spawn"):
        raise ConfigError(
            f"parallel.start_method={p.start_method} is unknown; choose forkserver or spawn"
        )
    if p.backend not in BACKENDS:
        raise ConfigError(f"parallel.backend={p.backend} is unknown; choose auto, gloo or nccl")
    backend = p.backend if p.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ConfigError(
            "parallel.backend=nccl needs CUDA; use parallel.backend=gloo (or auto) on CPU"
        )
    if launched is not None:
        if p.devices != launched["world_size"]:
            raise ConfigError(
                f"torchrun started WORLD_SIZE={launched['world_size']} processes but "
                f"parallel.devices={p.devices}; pass parallel.devices={launched['world_size']}"
            )
        return {"backend": backend}
    if device == "cuda" and torch.cuda.device_count() < p.devices:
        raise ConfigError(
            f"parallel=ddp parallel.devices={p.devices} needs {p.devices} CUDA devices (one "
            f"per process) but {torch.cuda.device_count()} are visible; use parallel=emulated "
            "or trainer.device=cpu (gloo)"
        )
    if device == "cpu" and p.devices > available_cores():
        warn_one_line(
            f"parallel=ddp starts {p.devices} gloo processes on {available_cores()} CPU "
            "core(s): they time-share the cores (same results, slower; parallel=emulated "
            "gives the same numerics in one process)"
        )
    return {"backend": backend}


def _check_dp(p: DictConfig, bn: str, device: str) -> dict:
    visible = torch.cuda.device_count() if device == "cuda" else 0
    if visible < p.devices:
        raise ConfigError(
            f"parallel=dp parallel.devices={p.devices} needs {p.devices} CUDA devices but "
            f"{visible} are visible; use parallel=emulated parallel.devices={p.devices} "
            "(same numerics in one process)"
        )
    if bn in ("sync", "torch_sync"):
        raise ConfigError(
            f"bn={bn} does not synchronise under DataParallel (its replicas would silently "
            "use per-replica statistics); use parallel=emulated or parallel=ddp with bn=sync"
        )
    return {}


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"trainer.device={name} is unknown; choose auto, cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu"
        )
    return name


def _positive(value, key: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}={value} must be a positive integer")


def _in_range(
    value,
    key: str,
    low: float,
    high: float | None,
    low_allowed: bool,
    high_allowed: bool = True,
    nullable: bool = False,
) -> None:
    if value is None and nullable:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        ok = (value > low or (low_allowed and value == low)) and (
            high is None or value < high or (high_allowed and value == high)
        )
    if not ok:
        upper = "inf)" if high is None else f"{high:g}{']' if high_allowed else ')'}"
        interval = f"{'[' if low_allowed else '('}{low:g}, {upper}"
        extra = " or null" if nullable else ""
        raise ConfigError(f"{key}={value} must be a number in {interval}{extra}")


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The config scripts/train.py would get for ``overrides`` (for tests and benchmarks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides or []))
