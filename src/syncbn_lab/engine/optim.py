"""Optimizers and learning-rate schedules from the `optim` and `sched` config groups."""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch import nn

from syncbn_lab.errors import ConfigError

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "onecycle", "step")


def parameter_groups(model: nn.Module, weight_decay: float, exclude_norm_and_bias: bool):
    """Split parameters into decayed and not decayed (norm weights and all biases)."""
    if not exclude_norm_and_bias:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    decay, no_decay = [], []
    for module in model.modules():
        is_norm = isinstance(module, nn.modules.batchnorm._NormBase | nn.GroupNorm | nn.LayerNorm)
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                (no_decay if is_norm or name == "bias" else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.weight_decay, cfg.exclude_norm_and_bias)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            groups,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    valid = ", ".join(OPTIMIZERS)
    raise ConfigError(f"unknown optim '{cfg.name}'; choose one of {valid} (optim=<name>)")


def lr_factor(cfg: DictConfig, step: int, total_steps: int, steps_per_epoch: int) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based) of ``total_steps``.

    A pure function of the step, so a resumed run needs no scheduler state.
    """
    total_steps = max(total_steps, 1)
    if cfg.name == "onecycle":
        rise = max(1, round(cfg.pct_start * total_steps))
        start = 1.0 / cfg.div_factor
        if step < rise:
            return start + (1.0 - start) * step / rise
        end = start / cfg.final_div_factor
        progress = (step - rise) / max(1, total_steps - rise)
        return end + (1.0 - end) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    warmup = round(cfg.get("warmup_epochs", 0.0) * steps_per_epoch)
    if step < warmup:
        ratio = cfg.warmup_start_ratio
        return ratio + (1.0 - ratio) * step / warmup
    if cfg.name == "cosine":
        progress = (step - warmup) / max(1, total_steps - warmup)
        floor = cfg.min_lr_ratio
        return floor + (1.0 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    if cfg.name == "step":
        epochs_done = step / max(1, steps_per_epoch)
        total_epochs = total_steps / max(1, steps_per_epoch)
        passed = sum(epochs_done >= m * total_epochs for m in cfg.milestones)
        return cfg.gamma**passed
    valid = ", ".join(SCHEDULES)
    raise ConfigError(f"unknown sched '{cfg.name}'; choose one of {valid} (sched=<name>)")
