"""BatchNorm / SyncBatchNorm modules in one process: torch parity, state dicts, communication."""

from __future__ import annotations

import pytest
import torch
from helpers import error_ratio, torch_batchnorm_class

from syncbn_lab.nn import BatchNorm, LocalCommunicator, SyncBatchNorm
from syncbn_lab.nn.sync_batchnorm import TORCH_BN_TAKES_BIAS

C = 4


def _step(module, x, grad):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(grad)
    return y.detach(), x.grad


def _pair(ours, theirs, shape, steps=3, tol=1e-5):
    """Run both modules on the same batches; return the worst error ratio seen."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if theirs.weight is not None:
            theirs.weight.uniform_(0.5, 1.5, generator=g)
            theirs.bias.uniform_(-0.5, 0.5, generator=g)
    ours.load_state_dict(theirs.state_dict())
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(*shape, generator=g) * 2 + 1
        grad = torch.randn(*shape, generator=g)
        for a, b in zip(_step(ours, x, grad), _step(theirs, x, grad), strict=True):
            worst = max(worst, error_ratio(a, b, tol, tol))
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True):
        worst = max(worst, error_ratio(a, b, tol, tol))
    if theirs.weight is not None:
        worst = max(worst, error_ratio(ours.weight.grad, theirs.weight.grad, tol, tol))
        worst = max(worst, error_ratio(ours.bias.grad, theirs.bias.grad, tol, tol))
    return worst


@pytest.mark.parametrize("cls", [BatchNorm, SyncBatchNorm])
@pytest.mark.parametrize("shape", [(6, C), (6, C, 5), (6, C, 3, 4), (6, C, 2, 3, 2)])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"momentum": None},
        {"affine": False},
        {"track_running_stats": False},
    ],
)
def test_single_process_equals_torch_batchnorm(cls, shape, kwargs):
    ours, theirs = cls(C, **kwargs), torch_batchnorm_class(len(shape))(C, **kwargs)
    assert _pair(ours, theirs, shape) <= 1
    ours.eval()
    theirs.eval()
    assert _pair(ours, theirs, shape, steps=1) <= 1


def test_sync_over_emulated_devices_equals_full_batch():
    ours, theirs = SyncBatchNorm(C, device_slices=3), torch.nn.BatchNorm2d(C)
    assert _pair(ours, theirs, (6, C, 3, 2)) <= 1


def test_per_device_running_stats_follow_device_zero():
    ours, theirs = BatchNorm(C, device_slices=2), torch.nn.BatchNorm2d(C)
    x = torch.randn(8, C, 3, 3)
    ours(x)
    theirs(x[:4])
    assert error_ratio(ours.running_mean, theirs.running_mean) <= 1
    assert error_ratio(ours.running_var, theirs.running_var) <= 1


def test_emulated_group_size_equals_batchnorm_per_group():
    ours = SyncBatchNorm(C, group_size=2, device_slices=4)
    x = torch.randn(8, C, 3, 3)
    reference = torch.nn.BatchNorm2d(C)
    expected = torch.cat([reference(x[:4]), torch.nn.BatchNorm2d(C)(x[4:])])
    assert error_ratio(ours(x), expected) <= 1
    assert error_ratio(ours.running_var, reference.running_var) <= 1


@pytest.mark.parametrize("source_cls", [torch.nn.BatchNorm2d, torch.nn.SyncBatchNorm])
@pytest.mark.parametrize("cls", [BatchNorm, SyncBatchNorm])
def test_state_dict_round_trip_with_torch(source_cls, cls):
    source = source_cls(C)
    with torch.no_grad():
        source.weight.uniform_()
        source.bias.uniform_()
        source.running_mean.uniform_()
        source.running_var.uniform_(1, 2)
        source.num_batches_tracked.fill_(7)
    ours = cls(C)
    ours.load_state_dict(source.state_dict())  # strict: same keys
    back = source_cls(C)
    back.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == list(source.state_dict())
    for key, value in source.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_local_communicator_used_once_per_direction_and_never_in_eval(monkeypatch):
    calls = []

    def counting(self, t):
        calls.append(t.numel())
        return t

    monkeypatch.setattr(LocalCommunicator, "all_reduce_sum", counting)
    # The reference always reduces (here over one slice); the fused single-op path has nothing
    # to reduce and does not (tests/nn/test_fused_dispatch.py covers it).
    layer = SyncBatchNorm(C, impl="reference")
    x = torch.randn(4, C, 3, 3, requires_grad=True)
    layer(x).sum().backward()
    assert calls == [2 * C + 1, 2 * C]
    calls.clear()
    layer.eval()
    layer(x).sum().backward()
    assert calls == []


def test_per_device_batchnorm_never_communicates(monkeypatch):
    monkeypatch.setattr(LocalCommunicator, "all_reduce_sum", lambda self, t: pytest.fail())
    layer = BatchNorm(C, device_slices=2)
    layer(torch.randn(4, C, 3, requires_grad=True)).sum().backward()


def test_constructor_and_input_checks():
    layer = SyncBatchNorm(C, impl="reference", group_size=2)
    assert layer.impl == "reference" and layer.group_size == 2 and layer.process_group is None
    assert "group_size=2" in repr(layer)
    with pytest.raises(ValueError, match="unknown BatchNorm impl 'cuda'"):
        SyncBatchNorm(C, impl="cuda")
    with pytest.raises(ValueError, match="either process_group or group_size"):
        SyncBatchNorm(C, process_group=object(), group_size=2)
    with pytest.raises(ValueError, match="got input with 3 channels"):
        SyncBatchNorm(C)(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match="2-D to 5-D"):
        BatchNorm(C)(torch.randn(2, C, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        SyncBatchNorm(C, group_size=0)
    with pytest.raises(ValueError, match="device_slices must be a positive integer, got 0"):
        BatchNorm(C, device_slices=0)
    assert "device_slices=3" in repr(SyncBatchNorm(C, device_slices=3))


def test_bias_false_like_torch():
    ours = SyncBatchNorm(C, bias=False)
    assert ours.bias is None and [name for name, _ in ours.named_parameters()] == ["weight"]
    # Older torch (2.11) has no `bias` argument: its BN's bias is zero as initialised.
    theirs = torch.nn.BatchNorm2d(C, bias=False) if TORCH_BN_TAKES_BIAS else torch.nn.BatchNorm2d(C)
    x = torch.randn(4, C, 2, 2)
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if k != "bias"})
    assert error_ratio(ours(x), theirs(x)) <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_module_end_to_end(dtype):
    """A model cast to fp16/bf16 (parameters and buffers too) trains and stays close to fp32."""
    full = SyncBatchNorm(C, device_slices=2)
    half = SyncBatchNorm(C, device_slices=2).to(dtype)
    x = torch.randn(8, C, 4, 4) * 3 + 5
    grad = torch.randn_like(x)
    y_full, dx_full = _step(full, x, grad)
    y_half, dx_half = _step(half, x.to(dtype), grad.to(dtype))
    assert (
        y_half.dtype == dx_half.dtype == half.weight.grad.dtype == half.running_var.dtype == dtype
    )
    assert error_ratio(y_half, y_full, 3e-2, 3e-2) <= 1
    assert error_ratio(dx_half, dx_full, 3e-2, 3e-2) <= 1
    assert error_ratio(half.running_var, full.running_var, 1e-2, 1e-2) <= 1
