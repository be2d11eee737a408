"""Checks of the composed config that Hydra cannot make, and the run's shape derived from it.

Every check raises ``ConfigError`` with one line naming the problem and the fix, before
any process starts or any file is written.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

import syncbn_lab.resolvers  # noqa: F401 - registers the configs' ${mul:...}
from syncbn_lab.checks import in_range, positive
from syncbn_lab.errors import ConfigError
from syncbn_lab.machine import available_cores, torchrun_env
from syncbn_lab.parallel.modes import mode
from syncbn_lab.shape import RunShape
from syncbn_lab.variants import GROUP as VARIANT_GROUP
from syncbn_lab.variants import NormVariant, variant

__all__ = ["available_cores", "compose", "derive", "torchrun_env", "validate"]

PRECISIONS = ("auto", "fp32", "fp64", "bf16", "fp16")


def derive(cfg: DictConfig) -> RunShape:
    """The run's shape from ``cfg`` (no checks beyond what computing it needs; see
    :func:`validate`)."""
    t, p = cfg.trainer, cfg.parallel
    norm, parallel = variant(cfg.bn.name), mode(p.name)
    device = resolve_device(t.device)
    per_device = t.global_batch_size // (p.devices * t.accumulate)
    return RunShape(
        variant=norm.name,
        mode=parallel.name,
        devices=p.devices,
        per_device_batch_size=per_device,
        slices_per_process=parallel.slices_per_process(p.devices),
        device_slices=parallel.device_slices(p.devices),
        normalization_batch_size=norm.normalization_batch_size(cfg.bn, per_device, p.devices),
        device=device,
        backend=parallel.backend(cfg, device),
    )


def validate(cfg: DictConfig) -> RunShape:
    """Check ``cfg`` (one-line ConfigError for the first problem) and return its shape."""
    t, p = cfg.trainer, cfg.parallel
    combined = cfg.get("sweep", {}).get("combines")
    if combined:
        raise ConfigError(
            f"experiment={cfg.study} trains nothing: it reports the runs of "
            f"{', '.join(combined)}; train one of those instead"
        )
    positive(t.global_batch_size, "trainer.global_batch_size")
    positive(t.epochs, "trainer.epochs")
    positive(t.accumulate, "trainer.accumulate")
    positive(t.log_every, "trainer.log_every")
    _check_eval_every(t.eval_every)
    positive(t.eval_batch_size, "trainer.eval_batch_size")
    positive(p.devices, "parallel.devices")
    if t.max_steps is not None:
        positive(t.max_steps, "trainer.max_steps")
    if t.get("eval_dense_epochs") is not None:
        positive(t.eval_dense_epochs, "trainer.eval_dense_epochs")
    positive(t.get("eval_sparse_every", 1), "trainer.eval_sparse_every")
    if t.get("eval_images") is not None:
        positive(t.eval_images, "trainer.eval_images")
    if t.get("overfit_batches") is not None:
        positive(t.overfit_batches, "trainer.overfit_batches")
    from syncbn_lab.engine.checkpoint import parse_every

    parse_every(t.get("checkpoint_every"))
    parallel = mode(p.name)
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
    norm = _check_components(cfg)
    _check_callbacks(t.get("callbacks"))
    for key in ("channels_last", "compile", "eval_batch_stats", "preflight"):
        if not isinstance(t.get(key, False), bool):
            raise ConfigError(f"trainer.{key}={t.get(key)} must be true or false")
    norm.check(cfg, parallel, device)
    parallel.check(cfg, norm, device)
    return derive(cfg)


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


def _check_components(cfg: DictConfig) -> NormVariant:
    """Names and values of the data, model, bn, optim and sched groups, which would otherwise
    fail with a traceback deep inside the run (or after the first epoch); returns the norm
    variant."""
    from syncbn_lab import models
    from syncbn_lab.data import DATASET_NAMES
    from syncbn_lab.engine.optim import OPTIMIZERS, SCHEDULES

    names = {
        "data": (DATASET_NAMES, cfg.data.get("name")),
        "model": ((*models.CIFAR_DEPTHS, *models.TORCHVISION_ARCHS), cfg.model.name),
    }
    for group, (valid, name) in names.items():
        _known(group, name, valid)
    norm = variant(cfg[VARIANT_GROUP].name)
    _known("optim", cfg.optim.name, OPTIMIZERS)
    _known("sched", cfg.sched.name, SCHEDULES)
    if "width" in cfg.model:
        positive(cfg.model.width, "model.width")
    for key, (low, high, low_allowed) in _RANGES.items():
        group, field = key.split(".")
        if field in cfg[group]:
            nullable = key in _NULLABLE
            in_range(cfg[group][field], key, low, high, low_allowed, nullable=nullable)
    if "betas" in cfg.optim:
        betas = cfg.optim.betas
        if not (OmegaConf.is_list(betas) and len(betas) == 2):
            raise ConfigError(
                f"optim.betas={betas} must be two numbers, e.g. optim.betas=[0.9,0.999]"
            )
        for i, beta in enumerate(betas):
            in_range(beta, f"optim.betas[{i}]", 0.0, 1.0, True, high_allowed=False)
    if "milestones" in cfg.sched:
        milestones = cfg.sched.milestones
        if not OmegaConf.is_list(milestones):
            raise ConfigError(
                f"sched.milestones={milestones} must be a list of fractions of trainer.epochs, "
                "e.g. sched.milestones=[0.5,0.75]"
            )
        for i, m in enumerate(milestones):
            in_range(m, f"sched.milestones[{i}]", 0.0, None, True)
    return norm


def _check_eval_every(value) -> None:
    """trainer.eval_every: a whole number of epochs, or a fraction of one below 1."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and value > 0 and (value < 1 or float(value).is_integer())):
        raise ConfigError(
            f"trainer.eval_every={value} must be a whole number of epochs (1, 2, ...) or a "
            "fraction of an epoch in (0, 1), e.g. 0.25 to evaluate four times an epoch"
        )


def _known(group: str, name, valid) -> None:
    if name not in valid:
        raise ConfigError(
            f"{group}.name={name} is unknown; choose one with {group}=<name>, one of "
            f"{', '.join(valid)}"
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


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The config scripts/train.py would get for ``overrides`` (for tests and benchmarks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides or []))
