"""Float64 BatchNorm in plain torch ops, independent of csrc/ and of syncbn_lab.nn.functional.

Gradients come from autograd through these lines, so they check the kernels' hand-written
backward formulas against the chain rule.
"""

from __future__ import annotations

import torch
from torch import Tensor


def reference_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    groups: int = 1,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor, Tensor]:
    """y, mean (groups, C), biased var (groups, C) of x cut into `groups` slices, in float64."""
    n_total, channels = x.shape[:2]
    xs = x.double().reshape(groups, n_total // groups, channels, -1)
    mean = xs.mean(dim=(1, 3), keepdim=True)
    var = ((xs - mean) ** 2).mean(dim=(1, 3), keepdim=True)
    y = (xs - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.double().view(1, 1, channels, 1)
    if bias is not None:
        y = y + bias.double().view(1, 1, channels, 1)
    return y.reshape(x.shape), mean.reshape(groups, channels), var.reshape(groups, channels)


def reference_with_grads(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    dy: Tensor,
    groups: int = 1,
    eps: float = 1e-5,
) -> dict[str, Tensor | None]:
    """Outputs and float64 gradients of sum(y * dy) with respect to x, weight and bias."""
    x64 = x.detach().double().requires_grad_()
    w64 = None if weight is None else weight.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    y, mean, var = reference_batch_norm(x64, w64, b64, groups, eps)
    (y * dy.double()).sum().backward()
    return {
        "y": y.detach(),
        "mean": mean.detach(),
        "var": var.detach(),
        "dx": x64.grad,
        "dweight": None if w64 is None else w64.grad,
        "dbias": None if b64 is None else b64.grad,
    }
