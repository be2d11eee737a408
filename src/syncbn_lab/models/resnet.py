"""ResNets whose norm layer comes from a factory, so the bn config decides what normalises.

Two families:

* CIFAR-style ResNets of He et al. (2016, section 4.2): a 3x3 stem, three stages of
  ``n`` basic blocks at widths w, 2w, 4w (w = 16 in the paper), global average pooling
  and a linear classifier; depth = 6n + 2 (resnet8: n=1, resnet20: n=3, resnet56: n=9).
  Shortcuts that change shape are 1x1 convolutions followed by a norm layer (the
  paper's option B), so every normalisation in the network goes through the factory.
* torchvision's resnet18/resnet50 with an optional small-image stem (3x3 conv,
  stride 1, no max-pool), the usual choice for 28-32 pixel inputs.

Every 1x1 convolution with a stride (the shortcuts of both families) is a
:class:`SubsampledConv1x1`: the same parameters, values and gradients, computed so that
oneDNN's strided 1x1 kernel, which is broken on AVX2 CPUs, is never taken.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

NormFactory = Callable[[int], nn.Module]


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class SubsampledConv1x1(nn.Conv2d):
    """A 1x1 convolution with stride s, computed as ``x[:, :, ::s, ::s]`` and a stride-1 1x1
    convolution: the same output, gradients and state-dict keys (``weight``, ``bias``).

    Why: oneDNN's AVX2 ``jit_1x1`` backward-weights kernel of a strided 1x1 convolution on
    channels_last input with fewer than 8 input channels writes past its workspace (oneDNN
    issue 6035, torch 2.14.1): the weight gradient is silently wrong at two threads, the
    process crashes at one. The subsampled input goes through the stride-1 kernel, which is
    right. ``tests/models/test_strided_1x1.py`` says whether the installed torch still has
    the bug, so this class can go when it does not.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, bias: bool = False):
        super().__init__(in_channels, out_channels, 1, stride=stride, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step_h, step_w = self.stride
        # a dense copy in x's layout: torch.compile would otherwise hand the strided view to
        # oneDNN as it is, and oneDNN takes that for a strided convolution's input (the same
        # broken kernel: a compiled channels_last run crashed at one thread under AVX2,
        # tests/models/test_strided_1x1.py)
        layout = torch.channels_last if _channels_last(x) else torch.contiguous_format
        subsampled = x[:, :, ::step_h, ::step_w].contiguous(memory_format=layout)
        return F.conv2d(subsampled, self.weight, self.bias, groups=self.groups)


def _channels_last(x: torch.Tensor) -> bool:
    return (
        x.dim() == 4
        and x.is_contiguous(memory_format=torch.channels_last)
        and (not x.is_contiguous())
    )


def subsample_strided_1x1(model: nn.Module) -> nn.Module:
    """Replace every plain strided 1x1 convolution of ``model`` (no padding, no dilation) by a
    :class:`SubsampledConv1x1` holding the same Parameters; returns ``model``."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not _is_strided_1x1(child):
                continue
            replacement = SubsampledConv1x1.__new__(SubsampledConv1x1)
            replacement.__dict__.update(child.__dict__)  # same Parameters, hooks and flags
            setattr(module, name, replacement)
    return model


def _is_strided_1x1(m: nn.Module) -> bool:
    return (
        type(m) is nn.Conv2d
        and m.kernel_size == (1, 1)
        and m.stride != (1, 1)
        and m.padding == (0, 0)
        and m.dilation == (1, 1)
        and m.padding_mode == "zeros"
    )


class _GlobalAvgPool(torch.autograd.Function):
    """Mean over the spatial dims whose gradient has the input's memory layout.

    The forward is ``x.mean((2, 3), keepdim=True)``, which is what adaptive average pooling
    to 1x1 computes. Autograd's gradient of it is a broadcast view that strides like an NCHW
    tensor; for a channels_last input the ReLU backward before the pool then mixes two
    layouts and runs ~10x slower than on matching ones (1.8 ms instead of 0.2 ms for
    64x64x7x7 in bfloat16 at one thread). This backward writes the gradient in the input's
    layout; the values are the same.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        ctx.channels_last = x.is_contiguous(memory_format=torch.channels_last)
        return x.mean((2, 3), keepdim=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        n, c, h, w = ctx.shape
        layout = torch.channels_last if ctx.channels_last else torch.contiguous_format
        return (grad / (h * w)).expand(n, c, h, w).contiguous(memory_format=layout)


class GlobalAvgPool(nn.Module):
    """``nn.AdaptiveAvgPool2d(1)`` for 4-D input, with a gradient in the input's layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GlobalAvgPool.apply(x)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: NormFactory):
        super().__init__()
        self.conv1 = conv3x3(in_channels, out_channels, stride)
        self.bn1 = norm(out_channels)
        self.conv2 = conv3x3(out_channels, out_channels)
        self.bn2 = norm(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                SubsampledConv1x1(in_channels, out_channels, stride),
                norm(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """The CIFAR ResNet family (depth 6n+2) of He et al. 2016."""

    def __init__(
        self,
        depth: int,
        num_classes: int,
        norm: NormFactory,
        in_channels: int = 3,
        width: int = 16,
        zero_init_residual: bool = False,
    ):
        super().__init__()
        if (depth - 2) % 6 != 0 or depth < 8:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 with n >= 1, got {depth}")
        blocks_per_stage = (depth - 2) // 6
        self.stem = nn.Sequential(conv3x3(in_channels, width), norm(width), nn.ReLU(inplace=True))
        stages, channels = [], width
        for stage, stage_width in enumerate((width, 2 * width, 4 * width)):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                stages.append(BasicBlock(channels, stage_width, stride, norm))
                channels = stage_width
        self.stages = nn.Sequential(*stages)
        self.pool = GlobalAvgPool()
        self.fc = nn.Linear(channels, num_classes)
        _init_weights(self, zero_init_residual, last_norms=lambda b: [b.bn2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def _init_weights(model: nn.Module, zero_init_residual: bool, last_norms) -> None:
    """Kaiming-normal convolutions; norm weights 1 and biases 0; optionally zero the
    last norm of each residual branch so every block starts as the identity (Goyal et al.)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif hasattr(m, "weight") and isinstance(m, nn.modules.batchnorm._NormBase | nn.GroupNorm):
            if m.weight is not None:
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
    if zero_init_residual:
        for block in model.modules():
            if isinstance(block, BasicBlock) or type(block).__name__ in (
                "BasicBlock",
                "Bottleneck",
            ):
                for norm in last_norms(block):
                    if getattr(norm, "weight", None) is not None:
                        nn.init.zeros_(norm.weight)


def torchvision_resnet(
    arch: str,
    num_classes: int,
    norm: NormFactory,
    in_channels: int = 3,
    small_input_stem: bool = True,
    zero_init_residual: bool = False,
) -> nn.Module:
    """torchvision's resnet18/resnet50 with our norm factory and an optional small-image stem."""
    from torchvision import models

    if arch not in ("resnet18", "resnet50"):
        raise ValueError(f"unknown torchvision ResNet '{arch}'; choose resnet18 or resnet50")
    model = getattr(models, arch)(weights=None, num_classes=num_classes, norm_layer=norm)
    if small_input_stem:
        model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    model.avgpool = GlobalAvgPool()
    subsample_strided_1x1(model)  # the downsample shortcuts
    last = "bn3" if arch == "resnet50" else "bn2"
    _init_weights(model, zero_init_residual, last_norms=lambda b: [getattr(b, last, None)])
    return model
