"""The training and evaluation loss's one precision rule, shared by the loop, evaluation and
DataParallel's loss-in-module replicas."""

from __future__ import annotations

import torch
from torch import Tensor


def at_least_fp32(logits: Tensor) -> Tensor:
    """Half-precision logits in float32 for the loss; float32 and float64 as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
