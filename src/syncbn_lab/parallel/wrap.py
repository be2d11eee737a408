"""What wrapping a model for its parallel mode gives: what trains, what is evaluated and saved
(the modes' ``wrap``, :func:`syncbn_lab.parallel.modes.parallelize`)."""

from __future__ import annotations

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
    loss_in_model: bool = False
    """``model(images, labels)`` returns the gathered [loss sum, correct, count] rows
    (``parallel.dp.LossInModule``) instead of logits."""
