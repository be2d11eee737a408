"""Swap the BatchNorm layers of a model for SyncBatchNorm and back, keeping their state.

Both functions reuse the original Parameter and buffer tensors (so optimizers holding the
parameters keep working, and requires_grad, device and dtype are unchanged), carry the
layer's submodules over, and copy the training flag, ``device_slices``, ``impl`` and a
``qconfig`` if present.

Which classes convert:

- ``torch.nn.BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm`` and this package's
  ``BatchNorm`` become :class:`SyncBatchNorm`; this package's SyncBatchNorm is kept (the
  same object) and given the requested group, so converting twice changes nothing;
- a BatchNorm subclass registered with :func:`register_batchnorm_subclass` becomes its
  SyncBatchNorm subclass. timm's ``BatchNormAct2d`` (and timm's own ``SyncBatchNormAct``)
  become :class:`SyncBatchNormAct`, which applies the layer's ``drop`` and ``act`` after
  normalising; the mapping is registered the first time a layer is converted while timm is
  imported (this package never imports timm);
- any other subclass of BatchNorm is refused with one line naming it: a SyncBatchNorm would
  lose what it adds.

Reverting needs a class to revert to: a layer converted here remembers the class it came
from and gets it back; a registered SyncBatchNorm subclass becomes its BatchNorm class; any
other SyncBatchNorm (``torch.nn.SyncBatchNorm`` built directly, or ours built directly)
becomes ``torch.nn.BatchNorm2d``, the right choice for ResNet-style models (use this
package's ``BatchNorm`` if your model mixes dimensions).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from syncbn_lab.nn.sync_batchnorm import (
    TORCH_BN_TAKES_BIAS,
    BatchNorm,
    SyncBatchNorm,
    SyncBatchNormAct,
    is_sync_batchnorm,
)

__all__ = ["convert_sync_batchnorm", "register_batchnorm_subclass", "revert_sync_batchnorm"]

# Classes converted without loss of behaviour: their forward is plain BatchNorm.
_PLAIN_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, BatchNorm)
_SYNC_BATCHNORMS = (SyncBatchNorm, nn.SyncBatchNorm)
_ORIGINAL_CLASS = "_converted_from"

# A registered BatchNorm subclass -> its SyncBatchNorm subclass, and that one (and any
# other synchronised form of it) -> the BatchNorm subclass it reverts to.
_TO_SYNC: dict[type, type] = {SyncBatchNormAct: SyncBatchNormAct}
_TO_PLAIN: dict[type, type] = {}


def register_batchnorm_subclass(
    batchnorm: type[_BatchNorm], sync: type[SyncBatchNorm], *also: type[_BatchNorm]
) -> None:
    """Convert ``batchnorm`` (a BatchNorm subclass) into ``sync``, a subclass of this
    package's SyncBatchNorm that does what ``batchnorm`` adds, and revert ``sync`` into
    ``batchnorm``. ``also``: other classes (another library's synchronised form of the same
    layer) that convert into ``sync`` too. The layer's submodules are carried over by name;
    ``sync`` is built with SyncBatchNorm's arguments, ``batchnorm`` with torch BatchNorm's
    first five and ``device``."""
    if not (issubclass(batchnorm, _BatchNorm) and issubclass(sync, SyncBatchNorm)):
        raise TypeError(
            "register_batchnorm_subclass takes a BatchNorm subclass and a subclass of "
            f"syncbn_lab.nn.SyncBatchNorm, got {batchnorm.__qualname__} and {sync.__qualname__}"
        )
    for cls in (batchnorm, sync, *also):
        _TO_SYNC[cls] = sync
    for cls in (sync, *also):
        _TO_PLAIN[cls] = batchnorm


def _register_timm() -> None:
    """timm's BatchNormAct2d and SyncBatchNormAct <-> SyncBatchNormAct, if timm is imported."""
    norm_act = sys.modules.get("timm.layers.norm_act")
    if norm_act is not None and norm_act.BatchNormAct2d not in _TO_SYNC:
        register_batchnorm_subclass(
            norm_act.BatchNormAct2d, SyncBatchNormAct, norm_act.SyncBatchNormAct
        )


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    group_size: int | None = None,
) -> nn.Module:
    """Replace every BatchNorm in ``module`` by :class:`SyncBatchNorm` or the registered
    SyncBatchNorm subclass of its class (returns the new root; see the module docstring).

    Call it after ``model.to(device)`` and before wrapping the model in DDP. Raises
    ``TypeError`` for a BatchNorm subclass it does not know, before changing anything.
    """
    _register_timm()
    for layer in module.modules():
        if isinstance(layer, LazyModuleMixin) and layer.has_uninitialized_params():
            name = type(layer).__name__
            raise ValueError(f"{name} is not initialised yet; run one forward pass first")
    _refuse_unknown(module, "convert", _PLAIN_BATCHNORMS + _SYNC_BATCHNORMS, _TO_SYNC)
    return _convert(module, process_group, group_size)


def _convert(module: nn.Module, process_group, group_size) -> nn.Module:
    module_output = module
    if isinstance(module, _BatchNorm):
        cls = type(module)
        target = _TO_SYNC.get(cls, SyncBatchNorm)
        if cls is target:  # already ours: the same layer, in the requested group
            module.set_group(process_group, group_size)
        else:
            module_output = _rebuild(
                module,
                target,
                process_group,
                group_size=group_size,
                impl=getattr(module, "impl", "auto"),
                bias=module.bias is not None,
            )
            original = getattr(module, _ORIGINAL_CLASS, None) or _TO_PLAIN.get(cls, cls)
            if not issubclass(original, _SYNC_BATCHNORMS):
                setattr(module_output, _ORIGINAL_CLASS, original)
    for name, child in module.named_children():
        module_output.add_module(name, _convert(child, process_group, group_size))
    return module_output


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every SyncBatchNorm in ``module`` by a plain BatchNorm (returns the new root).

    The class is the one recorded by :func:`convert_sync_batchnorm`, else the registered
    BatchNorm class of a SyncBatchNorm subclass, else ``torch.nn.BatchNorm2d``. Raises
    ``TypeError`` for a subclass of a SyncBatchNorm class it does not know.
    """
    _register_timm()
    _refuse_unknown(module, "revert", _SYNC_BATCHNORMS, _TO_PLAIN, only=_SYNC_BATCHNORMS)
    return _revert(module)


def _revert(module: nn.Module) -> nn.Module:
    module_output = module
    if is_sync_batchnorm(module):
        cls = type(module)
        target = getattr(module, _ORIGINAL_CLASS, None) or _TO_PLAIN.get(cls, nn.BatchNorm2d)
        kwargs = {"impl": getattr(module, "impl", "auto")} if issubclass(target, BatchNorm) else {}
        if kwargs or (TORCH_BN_TAKES_BIAS and target in _PLAIN_BATCHNORMS):
            kwargs["bias"] = module.bias is not None  # else _move_state removes a bias it lacks
        module_output = _rebuild(module, target, **kwargs)
    for name, child in module.named_children():
        module_output.add_module(name, _revert(child))
    return module_output


def _refuse_unknown(
    module: nn.Module,
    verb: str,
    known: tuple[type, ...],
    registered: dict[type, type],
    only: tuple[type, ...] = (_BatchNorm,),
) -> None:
    """The one-line TypeError for the first layer under ``module`` (an instance of ``only``)
    whose class neither is one of ``known`` nor registered: it would lose behaviour."""
    for layer in module.modules():
        cls = type(layer)
        if isinstance(layer, only) and cls not in known and cls not in registered:
            raise TypeError(
                f"{verb}_sync_batchnorm does not know {cls.__module__}.{cls.__qualname__}, "
                "a BatchNorm subclass whose additions it would lose; register the class that "
                "keeps them with syncbn_lab.nn.register_batchnorm_subclass, or replace the "
                "layer by torch.nn.BatchNorm2d first"
            )


def _rebuild(source: _BatchNorm, cls: type[_BatchNorm], *args, **kwargs) -> _BatchNorm:
    """A ``cls`` with ``source``'s first five constructor arguments, then ``args`` and
    ``kwargs``, built on meta and given ``source``'s state."""
    target = cls(
        source.num_features,
        source.eps,
        source.momentum,
        source.affine,
        source.track_running_stats,
        *args,
        device="meta",
        **kwargs,
    )
    _move_state(source, target)
    return target


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
