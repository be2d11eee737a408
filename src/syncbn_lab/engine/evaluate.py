"""Evaluation: loss and accuracy over a loader, summed across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from syncbn_lab.engine.compute import to_device
from syncbn_lab.engine.precision import autocast
from syncbn_lab.loss import at_least_fp32
from syncbn_lab.parallel.context import Runtime


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    rt: Runtime,
    precision: str,
    layout: torch.memory_format = torch.preserve_format,
) -> dict[str, float]:
    """Mean loss and accuracy (percent) over every sample of ``loader`` on all ranks;
    ``layout`` is the input batches' memory format (``trainer.channels_last``)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=rt.device)  # loss sum, correct, count
    for images, labels in loader:
        images = to_device(images, rt.device, layout)
        labels = labels.to(rt.device, non_blocking=True)
        with autocast(rt.device, precision):
            logits = model(images)
        totals[0] += F.cross_entropy(at_least_fp32(logits), labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += labels.numel()
    rt.all_reduce_sum(totals)
    model.train(was_training)
    loss_sum, correct, count = totals.tolist()
    count = max(count, 1.0)
    return {"loss": loss_sum / count, "acc": 100.0 * correct / count, "count": int(count)}
