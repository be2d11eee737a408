"""The fused op under torch.compile(fullgraph=True): one graph, same numbers as eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncbn_lab.nn import _ext, ops

pytestmark = pytest.mark.skipif(
    not _ext.load(), reason=f"syncbn_lab._C not built: {_ext.unavailable_reason()}"
)


class FusedBatchNorm(nn.Module):
    """Minimal module over ops.batch_norm_train (running stats from slice 0, like DDP rank 0)."""

    def __init__(self, channels: int, devices: int, group_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, channels))
        self.bias = nn.Parameter(torch.linspace(-0.2, 0.2, channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.devices, self.group_size = devices, group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ops.batch_norm_train(x, self.weight, self.bias, self.devices, self.group_size, 1e-5)
        count = x.numel() // x.shape[1] // out.mean.shape[0]
        with torch.no_grad():
            self.running_mean.lerp_(out.mean[0], 0.1)
            self.running_var.lerp_(out.var[0] * (count / (count - 1)), 0.1)
        return out.y


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        FusedBatchNorm(8, devices=2, group_size=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        FusedBatchNorm(8, devices=2, group_size=2),
    ).to(memory_format=torch.channels_last)


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    y = model(x)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return y.detach(), grads


@pytest.mark.slow
def test_compile_fullgraph_matches_eager():
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    eager = make_model()
    compiled_model = make_model()
    compiled = torch.compile(compiled_model, fullgraph=True)
    y_ref, grads_ref = step(eager, x)
    for _ in range(2):  # the second call reuses the compiled graph
        y, grads = step(compiled, x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-5)
    step(eager, x)  # the compiled model took two steps: so must the eager one
    for (n, b), (_, b_ref) in zip(
        compiled_model.named_buffers(), eager.named_buffers(), strict=True
    ):
        torch.testing.assert_close(b, b_ref, atol=1e-6, rtol=1e-5, msg=n)
