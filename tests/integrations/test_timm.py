"""timm's BatchNormAct2d through convert_sync_batchnorm: a real timm model keeps its
activations (equal outputs in one process), and on 2 gloo ranks the converted layer equals
timm's own layer on the union of the ranks' batches (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")
from timm.layers.norm_act import BatchNormAct2d  # noqa: E402

from syncbn_lab.nn import (  # noqa: E402
    SyncBatchNormAct,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from syncbn_lab.parallel.gloo_jobs import run_distributed  # noqa: E402

TOL = {"rtol": 1e-10, "atol": 1e-10}
SIZES = [2, 5]  # per-rank batches: uneven on purpose
CHANNELS = 3


def _timm_model() -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=5).double()
    with torch.no_grad():  # affine parameters away from 1 and 0, so a lost term shows
        for layer in model.modules():
            if isinstance(layer, BatchNormAct2d):
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.uniform_(-0.5, 0.5)
    return model


def test_timm_model_converts_with_its_activations_and_equal_outputs():
    original = _timm_model()
    n_layers = sum(isinstance(m, BatchNormAct2d) for m in original.modules())
    acts = [type(m.act) for m in original.modules() if isinstance(m, BatchNormAct2d)]
    assert n_layers > 10 and nn.Identity in acts and len(set(acts)) > 1  # with and without act
    reference = copy.deepcopy(original)
    keys = list(original.state_dict())
    synced = convert_sync_batchnorm(original)
    layers = [m for m in synced.modules() if isinstance(m, SyncBatchNormAct)]
    assert len(layers) == n_layers and [type(m.act) for m in layers] == acts
    assert not any(isinstance(m, BatchNormAct2d) for m in synced.modules())
    assert list(synced.state_dict()) == keys

    x = torch.randn(4, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for model in (synced, reference):
        model.train()
        model(x).square().sum().backward()
    torch.testing.assert_close(synced(x), reference(x), **TOL)  # train: batch statistics
    for (name, p), q in zip(synced.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    synced.eval(), reference.eval()
    torch.testing.assert_close(synced(x), reference(x), **TOL)  # eval: the running statistics

    again = convert_sync_batchnorm(synced)
    assert again is synced and [m for m in again.modules() if isinstance(m, SyncBatchNormAct)] == (
        layers
    )
    reverted = revert_sync_batchnorm(synced)
    assert sum(type(m) is BatchNormAct2d for m in reverted.modules()) == n_layers
    torch.testing.assert_close(reverted(x), reference(x), **TOL)


def _layer() -> BatchNormAct2d:
    torch.manual_seed(0)
    layer = BatchNormAct2d(CHANNELS, act_layer=nn.SiLU).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    return layer


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(sum(SIZES), CHANNELS, 4, 4, dtype=torch.float64, generator=g) * 2 + 1
    return x, torch.randn(x.shape, dtype=torch.float64, generator=g)


def two_steps_on_a_rank(rank: int, world_size: int) -> dict:
    """Two training steps of the converted layer on this rank's shard of the global batch."""
    import timm.layers.norm_act  # noqa: F401  (as in a user's process: timm imported)

    layer = convert_sync_batchnorm(_layer())
    start, stop = sum(SIZES[:rank]), sum(SIZES[: rank + 1])
    out = {"type": type(layer).__name__, "act": type(layer.act).__name__}
    for step in range(2):
        x, grad = _batches(step)
        x = x[start:stop].requires_grad_()
        layer.zero_grad()
        y = layer(x)
        y.backward(grad[start:stop])
        out[step] = {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad.clone()}
        out[step]["db"] = layer.bias.grad.clone()
    out["running"] = (layer.running_mean.clone(), layer.running_var.clone())
    return out


def test_converted_batchnorm_act_on_two_gloo_ranks_equals_timm_on_the_union():
    ranks = run_distributed(f"{__file__}:two_steps_on_a_rank", 2, timeout_s=90)
    assert all(r["type"] == "SyncBatchNormAct" and r["act"] == "SiLU" for r in ranks)
    reference = _layer()
    for step in range(2):
        x, grad = _batches(step)
        x.requires_grad_()
        reference.zero_grad()
        y = reference(x)
        y.backward(grad)  # L = sum over the union = the sum of the ranks' losses
        got = [r[step] for r in ranks]
        torch.testing.assert_close(torch.cat([g["y"] for g in got]), y, **TOL)
        torch.testing.assert_close(torch.cat([g["dx"] for g in got]), x.grad, **TOL)
        torch.testing.assert_close(sum(g["dw"] for g in got), reference.weight.grad, **TOL)
        torch.testing.assert_close(sum(g["db"] for g in got), reference.bias.grad, **TOL)
    for r in ranks:
        torch.testing.assert_close(r["running"][0], reference.running_mean, **TOL)
        torch.testing.assert_close(r["running"][1], reference.running_var, **TOL)
