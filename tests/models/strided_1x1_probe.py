"""Run as a script (in a subprocess, so that a crash is an exit status): train a width-4
resnet8 for a few steps in channels_last and in NCHW and print, as JSON, the largest
relative difference between the two runs' parameters (float32), at the thread count given.

``--broken`` builds the shortcuts as plain strided ``nn.Conv2d`` (what torch computes with
oneDNN's strided 1x1 kernel) instead of the project's :class:`SubsampledConv1x1`; with
``ONEDNN_MAX_CPU_ISA=AVX2`` in the environment that kernel is the broken one (oneDNN issue
6035) on any x86 CPU. ``tests/models/test_strided_1x1.py`` runs it both ways.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

from syncbn_lab.models.resnet import CifarResNet, SubsampledConv1x1

STEPS, BATCH = 4, 32


def plain_strided_shortcuts(model: nn.Module) -> nn.Module:
    """Put the strided nn.Conv2d back where SubsampledConv1x1 stands (same Parameters)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, SubsampledConv1x1):
                plain = nn.Conv2d.__new__(nn.Conv2d)
                plain.__dict__.update(child.__dict__)
                setattr(module, name, plain)
    return model


def train(layout: torch.memory_format, broken: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = CifarResNet(8, 10, nn.BatchNorm2d, in_channels=1, width=4)
    if broken:
        plain_strided_shortcuts(model)
    model = model.to(memory_format=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        images = torch.randn(BATCH, 1, 16, 16, generator=data).to(memory_format=layout)
        labels = torch.randint(0, 10, (BATCH,), generator=data)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--broken", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    nchw = train(torch.contiguous_format, args.broken)
    nhwc = train(torch.channels_last, args.broken)
    errors = {
        name: ((nhwc[name] - p).norm() / p.norm().clamp(min=1e-12)).item()
        for name, p in nchw.items()
    }
    worst = max(errors, key=errors.get)
    print(json.dumps({"worst": worst, "error": errors[worst], "threads": args.threads}))


if __name__ == "__main__":
    main()
