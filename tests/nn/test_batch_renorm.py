"""Batch Renormalization against independent references: torch.nn.BatchNorm2d (rmax=1,
dmax=0), a direct autograd implementation of the paper with r and d detached, gradcheck in
float64, BatchNorm's eval mode; the schedule, the state dict, the registry and the config."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, compose_config
from omegaconf import OmegaConf

from syncbn_lab.config import validate
from syncbn_lab.errors import ConfigError
from syncbn_lab.nn import BatchNorm, BatchRenorm
from syncbn_lab.nn.batch_renorm import batch_renorm, renorm_limits
from syncbn_lab.nn.registry import norm_layer, normalization_batch_size

C = 3


def inputs(shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + 1
    grad = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x.to(dtype), grad.to(dtype)


def init(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Non-trivial affine parameters and running statistics, the same for every module."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(1 + 0.5 * torch.randn(C, generator=g, dtype=torch.float64))
        module.bias.copy_(0.3 * torch.randn(C, generator=g, dtype=torch.float64))
        module.running_mean.copy_(torch.randn(C, generator=g, dtype=torch.float64))
        module.running_var.copy_(0.5 + torch.rand(C, generator=g, dtype=torch.float64) * 4)
    return module


def steps(module, batches):
    """Forward + backward of sum(y * grad) per batch: [(y, dx, dweight, dbias, rm, rv)]."""
    out = []
    for x, grad in batches:
        x = x.clone().requires_grad_()
        module.zero_grad()
        y = module(x)
        y.backward(grad)
        out.append(
            (y.detach(), x.grad, module.weight.grad.clone(), module.bias.grad.clone(),
             module.running_mean.clone(), module.running_var.clone())
        )  # fmt: skip
    return out


def paper_batch_renorm(x, weight, bias, running_mean, running_var, rmax, dmax, eps, momentum):
    """Algorithm 1 of Ioffe 2017 for one device in autograd ops; r and d detached."""
    dims = [0, *range(2, x.dim())]
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mu_b = x.mean(dims)
    var_b = x.var(dims, unbiased=False)
    sigma_b = torch.sqrt(var_b + eps)
    sigma = torch.sqrt(running_var + eps)
    r = (sigma_b / sigma).clamp(1 / rmax, rmax).detach()
    d = ((mu_b - running_mean) / sigma).clamp(-dmax, dmax).detach()
    xhat = (x - mu_b.view(shape)) / sigma_b.view(shape)
    y = weight.view(shape) * (xhat * r.view(shape) + d.view(shape)) + bias.view(shape)
    m = x.numel() // x.shape[1]
    with torch.no_grad():
        running_mean.lerp_(mu_b, momentum)
        running_var.lerp_(var_b * m / (m - 1), momentum)
    return y


def test_rmax_1_dmax_0_is_batchnorm2d_and_bitwise_our_batchnorm():
    batches = [inputs((8, C, 5, 5), seed) for seed in range(3)]
    brn = init(BatchRenorm(C, rmax=1, dmax=0, dtype=torch.float64))
    torch_bn = init(torch.nn.BatchNorm2d(C, dtype=torch.float64))
    for got, expected in zip(steps(brn, batches), steps(torch_bn, batches), strict=True):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # with 4 devices: every slice normalised alone, bit for bit our per-device BatchNorm
    for dtype in (torch.float64, torch.float32):
        batches = [inputs((16, C, 3, 3), seed, dtype) for seed in range(3)]
        kwargs = {"device_slices": 4, "dtype": dtype}
        brn = init(BatchRenorm(C, rmax=1, dmax=0, warmup_batches=0, ramp_batches=0, **kwargs))
        ours = init(BatchNorm(C, impl="reference", **kwargs))
        for got, expected in zip(steps(brn, batches), steps(ours, batches), strict=True):
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b)
        assert int(brn.num_batches_tracked) == int(ours.num_batches_tracked) == 3


@pytest.mark.parametrize(
    ("shape", "devices", "rmax", "dmax"),
    [((8, C, 4, 4), 1, 1.5, 0.5), ((12, C), 3, 1.2, 0.1), ((8, C, 2, 3, 2), 2, 3.0, 5.0)],
)
def test_matches_the_papers_algorithm_with_r_and_d_detached(shape, devices, rmax, dmax):
    brn = init(BatchRenorm(C, rmax=rmax, dmax=dmax, warmup_batches=0, ramp_batches=0,
                           device_slices=devices, dtype=torch.float64))  # fmt: skip
    brn.running_var.copy_(torch.tensor([0.2, 4.0, 60.0]))  # r above, inside, below the limits
    weight, bias = brn.weight.detach().clone(), brn.bias.detach().clone()
    running_mean, running_var = brn.running_mean.clone(), brn.running_var.clone()
    clipped = set()
    for seed in range(3):
        x, grad = inputs(shape, seed)
        got = steps(brn, [(x, grad)])[0]
        # device d holds slice d; only device 0's running statistics are kept
        xs = x.clone().requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        before = (running_mean.clone(), running_var.clone())
        ys = []
        for k, part in enumerate(xs.chunk(devices)):
            rm, rv = (running_mean, running_var) if k == 0 else (t.clone() for t in before)
            ys.append(paper_batch_renorm(part, w, b, rm, rv, rmax, dmax, brn.eps, 0.1))
            sigma_b = part.detach().transpose(0, 1).reshape(C, -1).var(1, unbiased=False)
            r = torch.sqrt(sigma_b + brn.eps) / torch.sqrt(before[1] + brn.eps)
            clipped |= {bool(v) for v in (r > rmax) | (r < 1 / rmax)}
        y = torch.cat(ys)
        y.backward(grad)
        expected = (y.detach(), xs.grad, w.grad, b.grad, running_mean, running_var)
        for a, e in zip(got, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-11, atol=1e-12)
    assert clipped == {True, False}  # both regimes of r occur


def test_gradcheck_float64_where_r_and_d_are_clipped():
    """Where r and d sit at their limits they are locally constant in x, so the hand-written
    backward is the true derivative and gradcheck can check it numerically."""
    x, _ = inputs((6, C, 3, 2))
    x = x.requires_grad_()
    weight = torch.tensor([1.3, -0.7, 0.9], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor([0.1, 0.2, -0.3], dtype=torch.float64, requires_grad=True)
    running_mean = torch.tensor([400.0, -400.0, 400.0], dtype=torch.float64)  # d at -+dmax
    for running_var in (torch.full((C,), 1e4, dtype=torch.float64),  # r at 1/rmax
                        torch.full((C,), 1e-4, dtype=torch.float64)):  # r at rmax  # fmt: skip

        def f(x, weight, bias, running_var=running_var):
            rm, rv = running_mean.clone(), running_var.clone()
            return batch_renorm(x, weight, bias, rm, rv, rmax=2.0, dmax=1.5, momentum=0.1,
                                eps=1e-5, devices=2)  # fmt: skip

        assert torch.autograd.gradcheck(f, (x, weight, bias))


def test_float32_against_the_float64_paper_algorithm():
    x, grad = inputs((16, C, 6, 6), dtype=torch.float32)
    brn = init(BatchRenorm(C, rmax=1.5, dmax=0.5, warmup_batches=0, ramp_batches=0))
    got = steps(brn, [(x, grad)])[0]
    reference = init(BatchRenorm(C, rmax=1.5, dmax=0.5, warmup_batches=0, ramp_batches=0,
                                 dtype=torch.float64))  # fmt: skip
    expected = steps(reference, [(x.double(), grad.double())])[0]
    for a, e in zip(got, expected, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), e, rtol=2e-5, atol=2e-5)


def test_eval_is_batchnorm_eval():
    brn = init(BatchRenorm(C, dtype=torch.float64)).eval()
    torch_bn = init(torch.nn.BatchNorm2d(C, dtype=torch.float64)).eval()
    x, grad = inputs((4, C, 3, 3))
    got, expected = steps(brn, [(x, grad)])[0], steps(torch_bn, [(x, grad)])[0]
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-13, atol=1e-13)
    assert int(brn.num_batches_tracked) == 0


def test_schedule_counts_training_batches_and_survives_the_state_dict():
    assert renorm_limits(0, 3.0, 5.0, 2, 4) == (1.0, 0.0)
    assert renorm_limits(2, 3.0, 5.0, 2, 4) == (1.0, 0.0)
    assert renorm_limits(3, 3.0, 5.0, 2, 4) == (1.5, 1.25)
    assert renorm_limits(6, 3.0, 5.0, 2, 4) == (3.0, 5.0)
    assert renorm_limits(100, 3.0, 5.0, 2, 4) == (3.0, 5.0)
    assert renorm_limits(1, 3.0, 5.0, 2, 0) == (1.0, 0.0)
    assert renorm_limits(2, 3.0, 5.0, 2, 0) == (3.0, 5.0)
    brn = BatchRenorm(C, warmup_batches=2, ramp_batches=4)
    seen = []
    for _ in range(4):
        seen.append(brn.limits())
        brn(torch.randn(4, C, 2, 2))
    assert seen == [(1.0, 0.0), (1.0, 0.0), (1.0, 0.0), (1.5, 1.25)]
    brn.eval()(torch.randn(4, C, 2, 2))  # eval does not advance the schedule
    assert brn.limits() == (2.0, 2.5)
    assert brn.state_dict().keys() == torch.nn.BatchNorm2d(C).state_dict().keys()
    resumed = BatchRenorm(C, warmup_batches=2, ramp_batches=4)
    resumed.load_state_dict(brn.state_dict())
    assert resumed.limits() == (2.0, 2.5)
    resumed.load_state_dict(torch.nn.BatchNorm2d(C).state_dict())  # torch's keys load as is
    assert "rmax=3.0, dmax=5.0, warmup_batches=2, ramp_batches=4" in repr(brn)


def test_constructor_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="rmax >= 1"):
        BatchRenorm(C, rmax=0.5)
    with pytest.raises(ValueError, match="dmax >= 0"):
        BatchRenorm(C, dmax=-1)
    with pytest.raises(ValueError, match="track_running_stats=True"):
        BatchRenorm(C, track_running_stats=False)
    with pytest.raises(ValueError, match="ramp_batches=-1"):
        BatchRenorm(C, ramp_batches=-1)
    with pytest.raises(ValueError, match="multiple of 3"):
        BatchRenorm(C, device_slices=3)(torch.randn(4, C))


def test_registry_turns_the_fractions_into_batches():
    cfg = OmegaConf.create(
        {"name": "brn", "eps": 1e-5, "momentum": 0.1, "rmax": 2.0, "dmax": 1.0,
         "warmup": 0.05, "ramp": 0.25}
    )  # fmt: skip
    layer = norm_layer(cfg, device_slices=4, training_batches=1000)(8)
    assert isinstance(layer, BatchRenorm) and layer.device_slices == 4
    assert (layer.warmup_batches, layer.ramp_batches, layer.rmax, layer.dmax) == (50, 250, 2, 1)
    with pytest.raises(ValueError, match="training_batches"):
        norm_layer(cfg)(8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["bn.rmax=0.9"], "bn.rmax=0.9 must be >= 1"),
        (["bn.dmax=-0.1"], "bn.dmax=-0.1 must be >= 0"),
        (["bn.warmup=1.5"], r"bn.warmup=1.5 must be a fraction of the run in \[0, 1\]"),
        (["bn.ramp=-0.5"], "bn.ramp=-0.5 must be a fraction"),
        (["bn.warmup=0.6", "bn.ramp=0.5"], "the ramp does not fit in the run"),
        (["bn.rmax=abc"], "bn.rmax=abc must be a number"),
        (["parallel=emulated", "parallel.devices=2", "trainer.accumulate=2"],
         "bn=brn under parallel=emulated"),
        (["parallel=emulated", "parallel.devices=2", "parallel.broadcast_buffers=false"],
         "parallel.broadcast_buffers=true, or parallel=ddp"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        validate(compose_config([*TINY, "bn=brn", *overrides]))
    assert "\n" not in str(info.value)


def test_default_brn_config_validates():
    validate(compose_config([*TINY, "bn=brn", "parallel=emulated", "parallel.devices=4"]))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["bn=bn"], 32),
        (["bn=brn"], 32),
        (["bn=bn", "parallel=emulated", "parallel.devices=4"], 8),
        (["bn=brn", "parallel=emulated", "parallel.devices=4"], 8),
        (["bn=bn", "parallel=emulated", "parallel.devices=4", "trainer.accumulate=2"], 4),
        (["bn=sync", "parallel=emulated", "parallel.devices=4"], 32),
        (["bn=sync", "parallel=emulated", "parallel.devices=4", "bn.group_size=2"], 16),
        (["bn=sync", "parallel=ddp", "parallel.devices=2", "trainer.accumulate=2"], 16),
        (["bn=gn", "parallel=emulated", "parallel.devices=4"], 1),
    ],
)
def test_normalization_batch_size(overrides, expected):
    cfg = compose_config([*TINY, *overrides])
    shape = validate(cfg)
    assert shape.normalization_batch_size == expected
    assert normalization_batch_size(cfg.bn, shape.per_device_batch_size, cfg.parallel) == expected


def test_as_batchnorm_is_batchnorm_for_the_block_only():
    brn = init(BatchRenorm(C, rmax=2, dmax=1, warmup_batches=0, ramp_batches=0,
                           dtype=torch.float64))  # fmt: skip
    ours = init(BatchNorm(C, impl="reference", dtype=torch.float64))
    x, grad = inputs((8, C, 3, 3))
    with brn.as_batchnorm():
        assert brn.limits() == (1.0, 0.0)
        for a, b in zip(steps(brn, [(x, grad)])[0], steps(ours, [(x, grad)])[0], strict=True):
            assert torch.equal(a, b)
    assert brn.limits() == (2.0, 1.0)


@pytest.mark.parametrize(
    ("dtype", "channels_last", "tol"),
    [(torch.float32, True, 2e-5), (torch.bfloat16, False, 3e-2), (torch.bfloat16, True, 3e-2)],
)
def test_layouts_and_half_inputs_against_float64(dtype, channels_last, tol):
    """bf16 input (as under autocast) keeps float32 parameters and statistics; channels_last
    input keeps its layout. Both match the float64 run to the input's precision."""
    x, grad = inputs((8, C, 4, 4))
    kwargs = {"rmax": 1.5, "dmax": 0.5, "warmup_batches": 0, "ramp_batches": 0, "device_slices": 2}
    reference = steps(init(BatchRenorm(C, dtype=torch.float64, **kwargs)), [(x, grad)])[0]
    x, grad = x.to(dtype), grad.to(dtype)
    if channels_last:
        x, grad = (t.contiguous(memory_format=torch.channels_last) for t in (x, grad))
    brn = init(BatchRenorm(C, **kwargs))
    got = steps(brn, [(x, grad)])[0]
    assert got[0].dtype == got[1].dtype == dtype and brn.running_var.dtype == torch.float32
    assert got[0].is_contiguous(memory_format=torch.channels_last) == channels_last
    for a, e in zip(got, reference, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=tol, atol=tol)
