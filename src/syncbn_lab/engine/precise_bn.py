"""PreciseBN: recompute BN population statistics with frozen weights (Wu and Johnson, 2021).

The running statistics that training leaves are an exponential moving average over batches
seen while the weights were still changing. PreciseBN replaces them, before the final
evaluation, by statistics measured on M training batches with the final weights, as fvcore's
``update_bn_stats`` does:

- the model runs in training mode without gradients, so every BN layer normalises with
  batch statistics exactly as in training (per device, or synchronised for SyncBN) and the
  layers downstream see the activations they saw in training;
- each BN layer's input is measured per *device batch*: the per-device batch, i.e. each
  slice of an emulating process's batch and each DDP rank's batch, whatever the BN variant;
- per channel, over the K = M x devices device batches, the cumulative averages of the batch
  mean mu_k and of the batch second moment var_k + mu_k^2 (var_k biased) give

      mean = avg_k mu_k,    var = avg_k (var_k + mu_k^2) - mean^2,

  the variance of all values seen (the population variance across batches, which is what
  fvcore's PreciseBN estimates; averaging the per-batch variances alone would leave out the
  spread of the batch means). ``running_var`` stores it unbiased over the K x n values;
- under DDP the averages are summed over ranks (one all_reduce), so every rank ends with the
  same statistics;
- Batch Renormalization layers normalise as BatchNorm (r = 1, d = 0) during the passes: their
  r and d come from the running statistics being replaced, which would feed back into the
  activations measured (and differ between DDP ranks, whose buffers are not synchronised here).

``num_batches_tracked`` and the training flag are restored; parameters are untouched.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn_lab.engine.compute import to_device
from syncbn_lab.parallel.context import Runtime


def bn_layers(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


class _PopulationStats:
    """Sums over device batches of mu_k and var_k + mu_k^2 for one layer, in float64."""

    def __init__(self, layer: _BatchNorm):
        self.layer = layer
        self.devices = int(getattr(layer, "device_slices", 1))
        channels = layer.num_features
        self.sum_mean = torch.zeros(channels, dtype=torch.float64, device=layer.running_mean.device)
        self.sum_square = torch.zeros_like(self.sum_mean)
        self.batches = 0  # device batches seen
        self.values = 0  # values per channel in one device batch

    @torch.no_grad()
    def __call__(self, layer: _BatchNorm, args: tuple) -> None:
        x: Tensor = args[0].detach()
        d = self.devices
        slices = x.reshape(d, x.shape[0] // d, *x.shape[1:]).transpose(1, 2)
        slices = slices.reshape(d, x.shape[1], -1).double()  # (devices, C, values)
        var, mean = torch.var_mean(slices, dim=2, correction=0)
        self.sum_mean += mean.sum(0)
        self.sum_square += (var + mean * mean).sum(0)
        self.batches += d
        self.values = slices.shape[2]


@torch.no_grad()
def update_bn_stats(
    model: nn.Module,
    batches: Iterable,
    num_batches: int,
    rt: Runtime,
    autocast=None,
    layout: torch.memory_format = torch.preserve_format,
) -> int:
    """Set every BN layer's running statistics to the population statistics of
    the first ``num_batches`` batches of ``batches`` (``(images, labels)`` pairs).

    Collective under DDP: every rank must call it with the same ``num_batches``. Returns the
    number of layers updated (0 for a model without BatchNorm). ``autocast`` makes the
    context of each forward, ``layout`` is the input batches' memory format.
    """
    layers = bn_layers(model)
    if not layers or num_batches < 1:
        return 0
    population = [_PopulationStats(layer) for layer in layers]
    counters = [layer.num_batches_tracked.clone() for layer in layers]
    handles = [
        layer.register_forward_pre_hook(stats)
        for layer, stats in zip(layers, population, strict=True)
    ]
    was_training = model.training
    model.train()
    plain = contextlib.ExitStack()  # Batch Renormalization measured as BatchNorm (r=1, d=0)
    for layer in layers:
        if hasattr(layer, "as_batchnorm"):
            plain.enter_context(layer.as_batchnorm())
    try:
        for images, _ in itertools.islice(batches, num_batches):
            images = to_device(images, rt.device, layout)
            with autocast() if autocast is not None else contextlib.nullcontext():
                model(images)
    finally:
        for handle in handles:
            handle.remove()
        plain.close()
        model.train(was_training)
    # One reduction for all layers: [sum_mean, sum_square] per layer and the batch counts.
    flat = torch.cat(
        [torch.cat([s.sum_mean, s.sum_square]) for s in population]
        + [
            torch.tensor(
                [float(s.batches) for s in population],
                dtype=torch.float64,
                device=population[0].sum_mean.device,
            )
        ]
    )
    rt.all_reduce_sum(flat)
    counts = flat[-len(population) :]
    offset = 0
    for stats, count, counter in zip(population, counts, counters, strict=True):
        layer, channels = stats.layer, stats.layer.num_features
        mean = flat[offset : offset + channels] / count
        square = flat[offset + channels : offset + 2 * channels] / count
        offset += 2 * channels
        total = count * stats.values
        var = (square - mean * mean).clamp_min(0) * (total / max(total - 1, 1))  # unbiased
        layer.running_mean.copy_(mean.to(layer.running_mean.dtype))
        layer.running_var.copy_(var.to(layer.running_var.dtype))
        layer.num_batches_tracked.copy_(counter)
    return len(layers)
