"""Swap the BatchNorm layers of a model for SyncBatchNorm and back, keeping their state.

Both functions reuse the original Parameter and buffer tensors (so optimizers holding the
parameters keep working, and requires_grad, device and dtype are unchanged) and copy the
training flag, ``device_slices``, ``impl`` and a ``qconfig`` if present.

Reverting needs a class to revert to: a layer converted by :func:`convert_sync_batchnorm`
remembers the class it came from (``torch.nn.BatchNorm1d/2d/3d`` or this package's
``BatchNorm``) and gets it back; any other SyncBatchNorm (``torch.nn.SyncBatchNorm`` built
directly, or ours built directly) becomes ``torch.nn.BatchNorm2d``, the right choice for
ResNet-style models (use this package's ``BatchNorm`` if your model mixes dimensions).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from syncbn_lab.nn.sync_batchnorm import TORCH_BN_TAKES_BIAS, BatchNorm, SyncBatchNorm

__all__ = ["convert_sync_batchnorm", "revert_sync_batchnorm"]

# Classes converted without loss of behaviour: their forward is plain BatchNorm.
_PLAIN_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, BatchNorm)
_SYNC_BATCHNORMS = (SyncBatchNorm, nn.SyncBatchNorm)
_ORIGINAL_CLASS = "_converted_from"


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    group_size: int | None = None,
) -> nn.Module:
    """Replace every BatchNorm in ``module`` by :class:`SyncBatchNorm` (returns the new root).

    Converts ``torch.nn.BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm`` and this package's
    ``BatchNorm``/``SyncBatchNorm`` (re-created with the given group). Other subclasses of
    ``_BatchNorm`` are converted too, with a warning naming the class whose extra behaviour
    is lost. Call it after ``model.to(device)`` and before wrapping the model in DDP.
    """
    if isinstance(module, _BatchNorm):
        cls = type(module)
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"{cls.__name__} is not initialised yet; run one forward pass first")
        if cls not in _PLAIN_BATCHNORMS + _SYNC_BATCHNORMS:
            _warn_lost_behaviour(cls, "SyncBatchNorm")
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            device="meta",
            group_size=group_size,
            impl=getattr(module, "impl", "auto"),
            bias=module.bias is not None,
        )
        _move_state(module, converted)
        original = getattr(module, _ORIGINAL_CLASS, None) or cls
        if original in _PLAIN_BATCHNORMS:
            setattr(converted, _ORIGINAL_CLASS, original)
        module_output: nn.Module = converted
    else:
        module_output = module
    for name, child in module.named_children():
        module_output.add_module(name, convert_sync_batchnorm(child, process_group, group_size))
    return module_output


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every SyncBatchNorm in ``module`` by a plain BatchNorm (returns the new root).

    The class is the one recorded by :func:`convert_sync_batchnorm`, else
    ``torch.nn.BatchNorm2d``. Subclasses of the SyncBatchNorm classes get a warning.
    """
    if isinstance(module, _SYNC_BATCHNORMS):
        cls = type(module)
        if cls not in _SYNC_BATCHNORMS:
            _warn_lost_behaviour(cls, "BatchNorm")
        target = getattr(module, _ORIGINAL_CLASS, None) or nn.BatchNorm2d
        kwargs = {"impl": getattr(module, "impl", "auto")} if issubclass(target, BatchNorm) else {}
        if kwargs or TORCH_BN_TAKES_BIAS:  # else _move_state removes a bias the source lacks
            kwargs["bias"] = module.bias is not None
        reverted = target(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            device="meta",
            **kwargs,
        )
        _move_state(module, reverted)
        module_output: nn.Module = reverted
    else:
        module_output = module
    for name, child in module.named_children():
        module_output.add_module(name, revert_sync_batchnorm(child))
    return module_output


def _move_state(source: _BatchNorm, target: _BatchNorm) -> None:
    """Hand ``source``'s parameters, buffers and flags to ``target`` (built on meta)."""
    with torch.no_grad():
        for name in ("weight", "bias"):  # None too: an affine BN without a bias keeps none
            setattr(target, name, getattr(source, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            if getattr(source, name, None) is not None:
                setattr(target, name, getattr(source, name))
    target.training = source.training
    if isinstance(target, BatchNorm):
        target.device_slices = getattr(source, "device_slices", 1)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig


def _warn_lost_behaviour(cls: type, into: str) -> None:
    warnings.warn(
        f"converting {cls.__module__}.{cls.__qualname__} to {into}: it is a subclass of "
        "BatchNorm and whatever it adds to BatchNorm is lost in the conversion",
        UserWarning,
        stacklevel=3,
    )
