"""What wrapping a model for its parallel mode gives: what trains, what is evaluated and saved
(the modes' ``wrap``, :func:`syncbn_lab.parallel.modes.parallelize`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from syncbn_lab.parallel.bn_buffers import BNBuffers


@dataclass
class Parallel:
    """``model`` trains (DDP, DataParallel, EmulatedDevices or the module itself);
    ``module`` is torchvision's ``model_without_ddp``: evaluated and checkpointed."""

    model: nn.Module
    module: nn.Module
    bn_buffers: BNBuffers = field(default_factory=BNBuffers)
    model_loss: Callable | None = None
    """``model_loss(model, images, labels) -> (mean loss, correct, count)`` when the wrapped
    model computes the loss itself (``parallel.dp.LossInModule``); None: it returns logits."""
