"""parallel=dp: torch.nn.DataParallel over N CUDA devices, optionally with the loss inside.

DataParallel scatters each batch into N equal consecutive chunks (the device slices of
``sampling.DeviceBatchSampler``), runs a replica of the module on each device, and gathers
the outputs on device 0. Each replica's BatchNorm normalises its own chunk; replica 0 updates
the module's running statistics in place, the other replicas' updates are discarded.

``parallel.loss_in_module=true`` wraps model and loss in :class:`LossInModule`, so each
replica returns three scalars instead of its logits: device 0 receives N x 3 numbers rather
than N x per-device batch x classes logits (DataParallel's memory imbalance), and the loss is
still the mean over the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from syncbn_lab.loss import at_least_fp32


class LossInModule(nn.Module):
    """model + cross-entropy: returns ``[[loss sum, correct, count]]`` (shape 1 x 3) for the
    samples it was given; DataParallel gathers these into N x 3 and the caller sums them."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        logits = self.model(images)
        loss_sum = F.cross_entropy(at_least_fp32(logits), labels, reduction="sum")
        correct = (logits.argmax(1) == labels).sum().to(loss_sum.dtype)
        count = torch.tensor(float(labels.numel()), device=loss_sum.device)
        return torch.stack([loss_sum, correct, count]).unsqueeze(0)


def loss_and_counts(outputs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gathered N x 3 outputs of LossInModule -> (mean loss over all samples, correct, count)."""
    loss_sum, correct, count = outputs.sum(0)
    return loss_sum / count, correct.detach(), count.detach()


def forward_loss_in_module(
    model: nn.Module, images: Tensor, labels: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The training step's (mean loss, correct, count) of a DataParallel-wrapped
    LossInModule: the replicas compute the loss, the gathered rows are summed."""
    return loss_and_counts(model(images, labels))


def data_parallel(model: nn.Module, devices: int, loss_in_module: bool) -> nn.Module:
    """``model`` (or model + loss, :class:`LossInModule`) replicated over cuda:0..N-1."""
    module = LossInModule(model) if loss_in_module else model
    return nn.DataParallel(module, device_ids=list(range(devices)))
