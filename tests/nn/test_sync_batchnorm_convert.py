"""convert_sync_batchnorm / revert_sync_batchnorm keep every piece of state."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from syncbn_lab.nn import (
    BatchNorm,
    BatchRenorm,
    SyncBatchNorm,
    SyncBatchNormAct,
    convert_sync_batchnorm,
    is_sync_batchnorm,
    register_batchnorm_subclass,
    revert_sync_batchnorm,
)
from syncbn_lab.nn.sync_batchnorm import TORCH_BN_TAKES_BIAS


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.Flatten(2), nn.BatchNorm1d(4, momentum=None, eps=1e-3)),
        nn.Unflatten(2, (2, 2)),
        nn.Unflatten(3, (1, 2)),
        nn.BatchNorm3d(4, affine=False),
        nn.Flatten(2),
        BatchNorm(4, track_running_stats=False, impl="reference", device_slices=2),
    )
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if m.weight is not None:
                with torch.no_grad():
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-1, 1)
            if m.running_mean is not None:
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.num_batches_tracked.fill_(5)
    model[1].weight.requires_grad_(False)
    model[2][1].eval()
    return model


def _norms(model):
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _state(bn):
    return {
        "class": type(bn),
        "params": [(p, p is not None and p.requires_grad) for p in (bn.weight, bn.bias)],
        "buffers": [bn.running_mean, bn.running_var, bn.num_batches_tracked],
        "hyper": (bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats),
        "training": bn.training,
        "device_slices": getattr(bn, "device_slices", 1),
    }


def _assert_same_state(before, after, classes):
    assert [type(b) for b in after] == classes
    for b, a in zip(before, after, strict=True):
        sb, sa = _state(b), _state(a)
        for (pb, gb), (pa, ga) in zip(sb["params"], sa["params"], strict=True):
            assert pa is pb and ga == gb  # the very same Parameter: optimizers keep working
        for tb, ta in zip(sb["buffers"], sa["buffers"], strict=True):
            assert ta is tb
        assert sa["hyper"] == sb["hyper"] and sa["training"] == sb["training"]
    assert [_state(a)["device_slices"] for a in after] == [1, 1, 1, 2]


def test_convert_then_revert_keeps_everything():
    model = _model()
    before = _norms(model)
    states = [_state(b) for b in before]
    x = torch.randn(2, 3, 4, 4)
    model.eval()
    expected = model(x)
    for bn, s in zip(before, states, strict=True):
        bn.train(s["training"])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # known classes convert silently
        synced = convert_sync_batchnorm(model, group_size=2)
    converted = _norms(synced)
    _assert_same_state(before, converted, [SyncBatchNorm] * 4)
    assert all(m.group_size == 2 for m in converted)
    assert converted[3].impl == "reference"
    synced.eval()
    torch.testing.assert_close(synced(x), expected)  # eval: same running statistics

    for bn, s in zip(converted, states, strict=True):
        bn.train(s["training"])
    reverted = _norms(revert_sync_batchnorm(synced))
    classes = [nn.BatchNorm2d, nn.BatchNorm1d, nn.BatchNorm3d, BatchNorm]
    _assert_same_state(before, reverted, classes)
    assert reverted[3].impl == "reference"


def test_convert_torch_sync_batchnorm_and_revert_defaults_to_batchnorm2d():
    torch_sync = nn.SyncBatchNorm(4, momentum=0.3)
    torch_sync.running_mean.fill_(2.0)
    ours = convert_sync_batchnorm(torch_sync)
    assert type(ours) is SyncBatchNorm and ours.momentum == 0.3
    assert ours.running_mean is torch_sync.running_mean
    plain = revert_sync_batchnorm(ours)
    assert type(plain) is nn.BatchNorm2d and plain.running_mean is torch_sync.running_mean
    built_directly = revert_sync_batchnorm(SyncBatchNorm(4))
    assert type(built_directly) is nn.BatchNorm2d


@pytest.mark.skipif(not TORCH_BN_TAKES_BIAS, reason="this torch's BatchNorm takes no bias")
def test_revert_also_handles_torch_sync_batchnorm():
    model = nn.Sequential(nn.SyncBatchNorm(4, bias=False))
    reverted = revert_sync_batchnorm(model)
    assert type(reverted[0]) is nn.BatchNorm2d and reverted[0].bias is None


def test_unknown_subclass_is_refused_with_its_name_and_the_model_is_unchanged():
    class FancyBatchNorm(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.BatchNorm2d(4), FancyBatchNorm(4))
    with pytest.raises(TypeError, match="FancyBatchNorm") as raised:
        convert_sync_batchnorm(model)
    assert "\n" not in str(raised.value) and "register_batchnorm_subclass" in str(raised.value)
    assert [type(m) for m in model] == [nn.BatchNorm2d, FancyBatchNorm]  # nothing converted
    with pytest.raises(TypeError, match="BatchRenorm"):  # ours too: its renorm would be lost
        convert_sync_batchnorm(BatchRenorm(4))

    class FancySync(SyncBatchNorm):
        pass

    with pytest.raises(TypeError, match="FancySync"):
        revert_sync_batchnorm(nn.Sequential(FancySync(4)))


def test_registered_subclass_keeps_its_submodules_and_reverts(monkeypatch):
    """A BatchNorm subclass that adds a submodule converts into the registered SyncBatchNorm
    subclass that applies it: the same output in one process, the same state-dict keys, and
    revert gives the original class back."""
    from syncbn_lab.nn import convert

    class ScaledBatchNorm(nn.BatchNorm2d):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.act = nn.Tanh()

        def forward(self, x):
            return self.act(super().forward(x))

    class ScaledSync(SyncBatchNormAct):
        pass

    monkeypatch.setattr(convert, "_TO_SYNC", dict(convert._TO_SYNC))
    monkeypatch.setattr(convert, "_TO_PLAIN", dict(convert._TO_PLAIN))
    register_batchnorm_subclass(ScaledBatchNorm, ScaledSync)
    torch.manual_seed(0)
    original = ScaledBatchNorm(4).double()
    with torch.no_grad():
        original.weight.uniform_(0.5, 1.5)
    x = torch.randn(6, 4, 3, 3, dtype=torch.float64) * 3 + 1
    expected = original(x)
    keys = list(original.state_dict())
    synced = convert_sync_batchnorm(original)
    assert type(synced) is ScaledSync and isinstance(synced.act, nn.Tanh)
    assert list(synced.state_dict()) == keys
    torch.testing.assert_close(synced(x), expected, rtol=1e-12, atol=1e-12)
    reverted = revert_sync_batchnorm(synced)
    assert type(reverted) is ScaledBatchNorm and reverted.act is synced.act
    with pytest.raises(TypeError, match="subclass of syncbn_lab.nn.SyncBatchNorm"):
        register_batchnorm_subclass(ScaledBatchNorm, nn.SyncBatchNorm)


def test_converting_twice_changes_nothing():
    model = _model()
    once = convert_sync_batchnorm(model, group_size=2)
    layers, tensors = _norms(once), [*once.parameters(), *once.buffers()]
    twice = convert_sync_batchnorm(once, group_size=2)
    assert twice is once and _norms(twice) == layers  # the same layer objects
    assert all(
        a is b for a, b in zip([*twice.parameters(), *twice.buffers()], tensors, strict=True)
    )
    reverted = _norms(revert_sync_batchnorm(twice))
    assert [type(m) for m in reverted] == [
        nn.BatchNorm2d,
        nn.BatchNorm1d,
        nn.BatchNorm3d,
        BatchNorm,
    ]
    regrouped = convert_sync_batchnorm(SyncBatchNorm(4, group_size=2), process_group=None)
    assert regrouped.group_size is None  # a second call with another group regroups in place


def test_is_sync_batchnorm_sees_ours_and_torchs():
    assert is_sync_batchnorm(SyncBatchNorm(4)) and is_sync_batchnorm(nn.SyncBatchNorm(4))
    assert is_sync_batchnorm(SyncBatchNormAct(4))
    assert not is_sync_batchnorm(nn.BatchNorm2d(4)) and not is_sync_batchnorm(BatchNorm(4))
    assert not isinstance(SyncBatchNorm(4), nn.SyncBatchNorm)  # why the helper exists


def test_process_group_is_passed_on_and_lazy_modules_are_refused():
    group = object()  # stands for a ProcessGroup; not used without distributed
    converted = convert_sync_batchnorm(nn.BatchNorm2d(4), process_group=group)
    assert converted.process_group is group
    with pytest.raises(ValueError, match="run one forward pass first"):
        convert_sync_batchnorm(nn.LazyBatchNorm2d())


@pytest.mark.parametrize("torch_takes_bias", [True, False], ids=["new_torch", "torch_2_11"])
def test_revert_without_bias_gives_a_torch_batchnorm_without_bias(torch_takes_bias, monkeypatch):
    """Also where torch's BatchNorm takes no `bias` argument (2.11): emulated by the flag."""
    if torch_takes_bias and not TORCH_BN_TAKES_BIAS:
        pytest.skip("this torch's BatchNorm takes no bias")
    from syncbn_lab.nn import convert, sync_batchnorm

    if not torch_takes_bias:
        monkeypatch.setattr(convert, "TORCH_BN_TAKES_BIAS", False)
        monkeypatch.setattr(sync_batchnorm, "TORCH_BN_TAKES_BIAS", False)
        # what torch 2.11 does with a bias argument
        monkeypatch.setattr(nn.BatchNorm2d, "__init__", _without_bias_argument(nn.BatchNorm2d))
    ours = SyncBatchNorm(4, bias=False)
    assert ours.bias is None and [name for name, _ in ours.named_parameters()] == ["weight"]
    with torch.no_grad():
        ours.weight.fill_(3.0)
    ours.reset_parameters()  # torch 2.11's own would call init.zeros_(None)
    assert torch.equal(ours.weight, torch.ones(4))
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
    reverted = revert_sync_batchnorm(ours)
    assert type(reverted) is nn.BatchNorm2d and reverted.bias is None
    assert reverted.weight is ours.weight
    assert [name for name, _ in reverted.named_parameters()] == ["weight"]
    x = torch.randn(3, 4, 2, 2)
    expected = nn.functional.batch_norm(x, None, None, ours.weight, None, training=True)
    torch.testing.assert_close(reverted(x), expected)


def _without_bias_argument(cls):
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        if "bias" in kwargs:
            raise TypeError("__init__() got an unexpected keyword argument 'bias'")
        init(self, *args, **kwargs)

    return __init__
