"""Model construction from the `model` config group."""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from syncbn_lab.models.resnet import CifarResNet, NormFactory, torchvision_resnet

CIFAR_DEPTHS = {"resnet8": 8, "resnet20": 20, "resnet56": 56}
TORCHVISION_ARCHS = ("resnet18", "resnet50")


def build(cfg: DictConfig, norm: NormFactory, num_classes: int, in_channels: int) -> nn.Module:
    """Build the model named by ``cfg.name`` with ``norm`` as its normalisation factory."""
    name = cfg.name
    if name in CIFAR_DEPTHS:
        return CifarResNet(
            CIFAR_DEPTHS[name],
            num_classes,
            norm,
            in_channels=in_channels,
            width=cfg.width,
            zero_init_residual=cfg.zero_init_residual,
        )
    if name in TORCHVISION_ARCHS:
        return torchvision_resnet(
            name,
            num_classes,
            norm,
            in_channels=in_channels,
            small_input_stem=cfg.small_input_stem,
            zero_init_residual=cfg.zero_init_residual,
        )
    valid = ", ".join([*CIFAR_DEPTHS, *TORCHVISION_ARCHS])
    raise ValueError(f"unknown model '{name}'; choose one of: {valid}")


__all__ = ["build", "CifarResNet", "torchvision_resnet"]
