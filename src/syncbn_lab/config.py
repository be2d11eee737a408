"""Checks of the composed config that Hydra cannot make, and the values derived from it.

Every check raises ``ConfigError`` with one line naming the problem and the fix, before
any process starts or any file is written.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from syncbn_lab.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")


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
    with open_dict(cfg):
        cfg.derived = OmegaConf.create(
            {
                "per_device_batch_size": t.global_batch_size // split,
                "device": device,
            }
        )
    return cfg


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


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The config scripts/train.py would get for ``overrides`` (for tests and benchmarks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides or []))
