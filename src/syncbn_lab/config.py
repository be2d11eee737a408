"""Checks of the composed config that Hydra cannot make, and the run's shape derived from it.

Every check raises ``ConfigError`` with one line naming the problem and the fix, before
any process starts or any file is written.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import syncbn_lab.resolvers  # noqa: F401 - registers the configs' ${mul:...}
from syncbn_lab.checks import boolean, in_range, one_of, positive, text, texts, whole
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


def _number(
    low: float,
    high: float | None = None,
    low_allowed: bool = True,
    high_allowed: bool = True,
    nullable: bool = False,
) -> Callable[[Any, str], None]:
    """The check of a finite number in (low, high), each end included when allowed."""
    return functools.partial(
        in_range,
        low=low,
        high=high,
        low_allowed=low_allowed,
        high_allowed=high_allowed,
        nullable=nullable,
    )


_FRACTION = _number(0.0, 1.0)  # [0, 1]
_OPEN_FRACTION = _number(0.0, 1.0, low_allowed=False, high_allowed=False)  # (0, 1)
_ABOVE_0 = _number(0.0, low_allowed=False)  # (0, inf)
_AT_LEAST_0 = _number(0.0)  # [0, inf)
_SEED = functools.partial(whole, high=2**32 - 1)  # what every generator (numpy's too) takes
_NULLABLE_TEXT = functools.partial(text, nullable=True)

# Keys of the composed config and their check, applied where the config has the key (the
# data, model, bn, optim, sched and logger groups' options differ in their keys). The keys
# checked elsewhere: validate's own (trainer's counts), the names (_check_components),
# bn.* of a variant (variants.py), parallel.* of a mode (parallel/modes.py).
_KEYS: dict[str, Callable[[Any, str], None]] = {
    "study": text,
    "skip_finished": boolean,
    "trainer.seed": _SEED,
    "trainer.deterministic": boolean,
    "trainer.num_workers": whole,
    "trainer.grad_clip": _number(0.0, low_allowed=False, nullable=True),
    "trainer.threads": functools.partial(whole, low=1, nullable=True),
    "trainer.precise_bn_batches": whole,
    "trainer.resume": _NULLABLE_TEXT,
    "model.zero_init_residual": boolean,
    "model.small_input_stem": boolean,
    "bn.eps": _ABOVE_0,
    "bn.momentum": _number(0.0, 1.0, nullable=True),  # null = cumulative average
    "parallel.broadcast_buffers": boolean,
    "parallel.find_unused_parameters": boolean,
    "parallel.loss_in_module": boolean,
    "optim.lr": _AT_LEAST_0,
    "optim.momentum": _number(0.0, 1.0, high_allowed=False),
    "optim.nesterov": boolean,
    "optim.weight_decay": _AT_LEAST_0,
    "optim.eps": _ABOVE_0,
    "optim.exclude_norm_and_bias": boolean,
    "sched.warmup_epochs": _AT_LEAST_0,
    "sched.warmup_start_ratio": _FRACTION,
    "sched.min_lr_ratio": _FRACTION,
    "sched.pct_start": _number(0.0, 1.0, low_allowed=False),
    "sched.div_factor": _ABOVE_0,
    "sched.final_div_factor": _ABOVE_0,
    "sched.gamma": _ABOVE_0,
    "logger.mode": functools.partial(one_of, choices=("offline", "online", "disabled")),
    "logger.project": text,
    "logger.entity": _NULLABLE_TEXT,
    "logger.group": _NULLABLE_TEXT,
    "logger.tags": texts,
    "logger.run_name": _NULLABLE_TEXT,
    "data.root": text,
    "data.download": boolean,
    "data.download_timeout": _ABOVE_0,
    "data.verify_checksums": boolean,
    "data.normalize": boolean,
    "data.augment": boolean,
    "data.crop_padding": whole,
    "data.hflip": boolean,
    "data.augment_seed": _SEED,
    "data.heterogeneity": _number(0.0, 1.0, high_allowed=False),
    "data.heterogeneity_seed": _SEED,
    "data.val_size": positive,
    "data.split_seed": _SEED,
    "data.val_fraction": _OPEN_FRACTION,
    "data.test_fraction": _OPEN_FRACTION,
    "data.train_dir": text,
    "data.val_dir": text,
    "data.test_dir": text,
    "data.image_size": positive,
    "data.channels": positive,
    "data.in_memory": boolean,
    "data.num_train": positive,
    "data.num_val": positive,
    "data.num_test": positive,
    "data.num_classes": functools.partial(whole, low=2),
    "data.noise_std": _AT_LEAST_0,
    "data.seed": _SEED,
}
LOGGERS = ("wandb", "none")


def _check_keys(cfg: DictConfig) -> None:
    """Every key of :data:`_KEYS` that ``cfg`` has, then the combinations of them."""
    for prefix, node in (("", cfg), *((f"{g}.", cfg[g]) for g in (*_OPTION_GROUPS, "trainer"))):
        for field, value in node.items_ex(resolve=True):
            check = _KEYS.get(f"{prefix}{field}")
            if check is not None:
                check(value, f"{prefix}{field}")
    data, optim = cfg.data, cfg.optim
    if optim.get("nesterov") and optim.get("momentum", 0) == 0:
        raise ConfigError(
            "optim.nesterov=true needs optim.momentum > 0 (Nesterov momentum without "
            "momentum); set optim.momentum or optim.nesterov=false"
        )
    if "val_fraction" in data and "test_fraction" in data:
        if data.val_fraction + data.test_fraction >= 1:
            raise ConfigError(
                f"data.val_fraction + data.test_fraction = {data.val_fraction} + "
                f"{data.test_fraction} >= 1 leaves no training images; lower one of them"
            )
    if "mean" in data or "std" in data:
        _check_channel_stats(data)


def _check_channel_stats(data: DictConfig) -> None:
    """data.mean and data.std: one number per channel of data.channels (1 or 3), std > 0."""
    one_of(str(data.get("channels")), "data.channels", ("1", "3"))
    for key, low_allowed in (("mean", True), ("std", False)):
        values = data.get(key)
        if not OmegaConf.is_list(values) or len(values) != data.channels:
            raise ConfigError(
                f"data.{key}={values} must be a list of {data.channels} numbers, one per "
                "channel of data.channels"
            )
        for i, value in enumerate(values):
            in_range(value, f"data.{key}[{i}]", 0.0, None, low_allowed)


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
    for group in _OPTION_GROUPS:
        _check_option_keys(cfg, group)
    norm = variant(cfg[VARIANT_GROUP].name)
    _known("optim", cfg.optim.name, OPTIMIZERS)
    _known("sched", cfg.sched.name, SCHEDULES)
    if "width" in cfg.model:
        positive(cfg.model.width, "model.width")
    _known("logger", cfg.logger.get("name"), LOGGERS)
    _check_keys(cfg)
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
            in_range(m, f"sched.milestones[{i}]", 0.0, 1.0, True)
    return norm


_OPTION_GROUPS = ("data", "model", VARIANT_GROUP, "parallel", "optim", "sched", "logger")


@functools.cache
def _option_keys(group: str, name: str) -> frozenset[str] | None:
    """The keys configs/<group>/<name>.yaml gives its node (None: no such file)."""
    path = CONFIG_DIR / group / f"{name}.yaml"
    return frozenset(OmegaConf.load(path)) if path.is_file() else None


def _check_option_keys(cfg: DictConfig, group: str) -> None:
    """``<group>.name`` names an option of the group whose keys the node has: set alone
    (``bn.name=brn`` on the bn option), it would run with keys the option does not have."""
    name = cfg[group].get("name")
    keys = _option_keys(group, name) if isinstance(name, str) else None
    missing = sorted(keys - set(cfg[group])) if keys is not None else []
    if missing:
        raise ConfigError(
            f"{group}.name={name} but the {group} config lacks {', '.join(missing)} of "
            f"configs/{group}/{name}.yaml; choose the option with {group}={name}"
        )


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
    if nodes is None:
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
