"""Evaluation with the statistics of test batches: BatchNorm's train-test inconsistency.

A model trained with BatchNorm normalises each training batch of b images with that batch's
own statistics, and each test image with the running (EMA) or PreciseBN population
statistics. Wu and Johnson ("Rethinking 'Batch' in BatchNorm", 2021, §4) measure the gap
between the two by also evaluating as the model was trained: each group of b test images
normalised with its own mean and (biased) variance. At a small b, evaluation with population
statistics can be worse than this (the inconsistency), or better (the noise of small batches
hurts both).

Within :func:`batch_statistics` every BN layer of the model (BatchNorm, SyncBatchNorm, Batch
Renormalization as BatchNorm with r = 1 and d = 0, torch's) normalises each group of ``group``
consecutive samples of its input with the group's statistics, whatever the training flag, by
``syncbn_lab.nn.functional.batch_norm`` on the groups as device slices. Running statistics
and ``num_batches_tracked`` are neither read nor written, and nothing is synchronised: a
group lies within one batch of one process (``parallel.sampling.eval_loader`` with ``group``
hands out whole groups). A last group of fewer samples (10,000 test images in groups of 64
leave 16) is normalised with its own statistics.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn_lab.nn import functional as F


@contextlib.contextmanager
def batch_statistics(model: nn.Module, group: int) -> Iterator[int]:
    """Within: every BN layer of ``model`` normalises groups of ``group`` consecutive samples
    with their own statistics (see the module's docstring). Yields the number of such layers
    (0: the model has no batch statistics, e.g. GroupNorm)."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    for layer in layers:
        layer.forward = functools.partial(_in_groups, layer, group)  # an instance attribute
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


def _in_groups(layer: _BatchNorm, group: int, x: Tensor) -> Tensor:
    """``x`` normalised per group of ``group`` samples with ``layer``'s affine parameters; the
    samples after the last whole group form one group of their own."""
    whole = x.shape[0] - x.shape[0] % group
    parts = [(x[:whole], whole // group), (x[whole:], 1)]
    out = [
        F.batch_norm(
            part,
            layer.weight,
            layer.bias,
            None,  # no running statistics: none is read, none is updated
            None,
            training=True,
            momentum=0.0,
            eps=layer.eps,
            devices=groups,
            impl=getattr(layer, "impl", "auto"),
        )
        for part, groups in parts
        if part.shape[0]
    ]
    return out[0] if len(out) == 1 else torch.cat(out)
