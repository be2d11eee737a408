"""Batch Renormalization against independent references: torch.nn.BatchNorm2d (rmax=1,
dmax=0), a direct autograd implementation of the paper with r and d detached, gradcheck in
float64, BatchNorm's eval mode; the schedule, the state dict, the registry and the config.
Both implementations (``impl``) run the reference tests; the fused one also runs against the
reference in float64 and bf16, with a spy proving that it ran the kernels."""

from __future__ import annotations

import collections
import copy
import logging

import pytest
import torch
from conftest import TINY, compose_config
from omegaconf import OmegaConf

from syncbn_lab.config import validate
from syncbn_lab.errors import ConfigError
from syncbn_lab.nn import BatchNorm, BatchRenorm, _ext, ops
from syncbn_lab.nn import batch_renorm as batch_renorm_module
from syncbn_lab.nn import functional as F
from syncbn_lab.nn.batch_renorm import batch_renorm, renorm_limits
from syncbn_lab.nn.registry import norm_layer, normalization_batch_size

C = 3
needs_ext = pytest.mark.skipif(
    not _ext.load(), reason=f"syncbn_lab._C not built: {_ext.unavailable_reason()}"
)
IMPLS = ["reference", pytest.param("fused", marks=needs_ext)]


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


@pytest.mark.parametrize("impl", IMPLS)
def test_rmax_1_dmax_0_is_batchnorm2d_and_our_batchnorm(impl):
    batches = [inputs((8, C, 5, 5), seed) for seed in range(3)]
    brn = init(BatchRenorm(C, rmax=1, dmax=0, impl=impl, dtype=torch.float64))
    torch_bn = init(torch.nn.BatchNorm2d(C, dtype=torch.float64))
    for got, expected in zip(steps(brn, batches), steps(torch_bn, batches), strict=True):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # with 4 devices: every slice normalised alone, our per-device BatchNorm of the same impl
    # (bit for bit for the reference; the fused BatchNorm is one other kernel, batch_norm_train)
    for dtype in (torch.float64, torch.float32):
        batches = [inputs((16, C, 3, 3), seed, dtype) for seed in range(3)]
        kwargs = {"device_slices": 4, "dtype": dtype, "impl": impl}
        brn = init(BatchRenorm(C, rmax=1, dmax=0, warmup_batches=0, ramp_batches=0, **kwargs))
        ours = init(BatchNorm(C, **kwargs))
        for got, expected in zip(steps(brn, batches), steps(ours, batches), strict=True):
            for a, b in zip(got, expected, strict=True):
                if impl == "reference":
                    assert torch.equal(a, b)
                else:
                    tol = 1e-12 if dtype == torch.float64 else 1e-5
                    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        assert int(brn.num_batches_tracked) == int(ours.num_batches_tracked) == 3


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("shape", "devices", "rmax", "dmax"),
    [((8, C, 4, 4), 1, 1.5, 0.5), ((12, C), 3, 1.2, 0.1), ((8, C, 2, 3, 2), 2, 3.0, 5.0)],
)
def test_matches_the_papers_algorithm_with_r_and_d_detached(shape, devices, rmax, dmax, impl):
    brn = init(BatchRenorm(C, rmax=rmax, dmax=dmax, warmup_batches=0, ramp_batches=0,
                           device_slices=devices, impl=impl, dtype=torch.float64))  # fmt: skip
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


@pytest.mark.parametrize("impl", IMPLS)
def test_gradcheck_float64_where_r_and_d_are_clipped(impl):
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
                                eps=1e-5, devices=2, impl=impl)  # fmt: skip

        assert torch.autograd.gradcheck(f, (x, weight, bias))


@pytest.mark.parametrize("impl", IMPLS)
def test_float32_against_the_float64_paper_algorithm(impl):
    x, grad = inputs((16, C, 6, 6), dtype=torch.float32)
    brn = init(BatchRenorm(C, rmax=1.5, dmax=0.5, warmup_batches=0, ramp_batches=0, impl=impl))
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
        (["bn.impl=cuda"], "bn.impl=cuda is unknown; choose one of auto, reference, fused"),
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
                           impl="reference", dtype=torch.float64))  # fmt: skip
    ours = init(BatchNorm(C, impl="reference", dtype=torch.float64))
    x, grad = inputs((8, C, 3, 3))
    with brn.as_batchnorm():
        assert brn.limits() == (1.0, 0.0)
        for a, b in zip(steps(brn, [(x, grad)])[0], steps(ours, [(x, grad)])[0], strict=True):
            assert torch.equal(a, b)
    assert brn.limits() == (2.0, 1.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("dtype", "channels_last", "tol"),
    [(torch.float32, True, 2e-5), (torch.bfloat16, False, 3e-2), (torch.bfloat16, True, 3e-2)],
)
def test_layouts_and_half_inputs_against_float64(dtype, channels_last, tol, impl):
    """bf16 input (as under autocast) keeps float32 parameters and statistics; channels_last
    input keeps its layout. Both match the float64 reference run to the input's precision."""
    x, grad = inputs((8, C, 4, 4))
    kwargs = {"rmax": 1.5, "dmax": 0.5, "warmup_batches": 0, "ramp_batches": 0, "device_slices": 2}
    reference = steps(
        init(BatchRenorm(C, dtype=torch.float64, impl="reference", **kwargs)), [(x, grad)]
    )[0]
    x, grad = x.to(dtype), grad.to(dtype)
    if channels_last:
        x, grad = (t.contiguous(memory_format=torch.channels_last) for t in (x, grad))
    brn = init(BatchRenorm(C, impl=impl, **kwargs))
    got = steps(brn, [(x, grad)])[0]
    assert got[0].dtype == got[1].dtype == dtype and brn.running_var.dtype == torch.float32
    assert got[0].is_contiguous(memory_format=torch.channels_last) == channels_last
    for a, e in zip(got, reference, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=tol, atol=tol)


# --- the fused kernels (impl="fused", and "auto" where they are built) ------------------------


@pytest.fixture
def kernel_calls(monkeypatch) -> collections.Counter:
    """Calls of the kernels of BatchRenorm's fused path and of its reference Function: a
    fused layer that fell back to the reference would pass any comparison with it."""
    seen: collections.Counter = collections.Counter()

    def spy(owner, name, key):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            seen[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in ("local_stats", "forward_elemt", "backward_reduce", "backward_elemt"):
        spy(ops, name, name)
    spy(batch_renorm_module._BatchRenormFunction, "apply", "reference")
    return seen


def as_layout(batches, channels_last: bool):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return [tuple(t.contiguous(memory_format=fmt) for t in batch) for batch in batches]


@needs_ext
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("devices", [1, 2, 8])
def test_fused_matches_the_reference_in_float64(devices, channels_last, kernel_calls):
    """Output, input/weight/bias gradients, running statistics and num_batches_tracked within
    1e-12 over 5 steps through the schedule (warm-up, ramp, final limits), r clipped in two
    channels (running variances far below and above the batches'), in x's layout."""
    kwargs = {"rmax": 2.0, "dmax": 1.0, "warmup_batches": 1, "ramp_batches": 2}
    layers = {}
    for impl in ("reference", "fused"):
        layer = BatchRenorm(C, device_slices=devices, impl=impl, dtype=torch.float64, **kwargs)
        layers[impl] = init(layer)
        layer.running_var.copy_(torch.tensor([0.2, 4.0, 60.0]))
    batches = as_layout([inputs((16, C, 3, 4), seed) for seed in range(5)], channels_last)
    got, want = (steps(layers[impl], batches) for impl in ("fused", "reference"))
    for step_got, step_want in zip(got, want, strict=True):
        for a, b in zip(step_got, step_want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        for t in step_got[:2]:  # y and dx
            assert t.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert int(layers["fused"].num_batches_tracked) == int(layers["reference"].num_batches_tracked)
    assert int(layers["fused"].num_batches_tracked) == 5
    assert kernel_calls["reference"] == 5  # the reference layer's steps only
    assert kernel_calls["forward_elemt"] == kernel_calls["backward_elemt"] == 5


@needs_ext
@pytest.mark.parametrize("devices", [1, 4])
def test_fused_under_bf16_autocast_and_channels_last_against_float64(devices, kernel_calls):
    """What the trainer runs with trainer.precision=bf16 and trainer.channels_last=true: bf16
    output and input gradient in channels_last, float32 statistics and parameter gradients,
    within the bf16 tolerance of the float64 reference."""
    x, grad = inputs((16, C, 4, 4))
    kwargs = {"rmax": 1.5, "dmax": 0.5, "warmup_batches": 0, "ramp_batches": 0}
    kwargs["device_slices"] = devices
    exact = init(BatchRenorm(C, dtype=torch.float64, impl="reference", **kwargs))
    want = steps(exact, [(x, grad)])[0]
    brn = init(BatchRenorm(C, impl="fused", **kwargs))
    [(x, grad)] = as_layout([(x.bfloat16(), grad.bfloat16())], channels_last=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = steps(brn, [(x, grad)])[0]
    for t in got[:2]:
        assert t.dtype == torch.bfloat16 and t.is_contiguous(memory_format=torch.channels_last)
    for t in (*got[2:], *brn.buffers()):
        assert t.dtype in (torch.float32, torch.int64)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=3e-2, atol=3e-2)
    assert kernel_calls["forward_elemt"] == 1 and kernel_calls["reference"] == 1  # `exact`


@needs_ext
def test_fused_hands_a_large_offset_to_the_reference(kernel_calls):
    """|mu_B| / sigma_B > 16 in float32 (mean 1e3, std 0.02): the kernels' float32 mean
    would be too coarse, so the call runs the reference, decided before the running update
    (which happens once)."""
    x, grad = inputs((8, C, 4, 4), dtype=torch.float32)
    x = x * 0.01 + 1e3
    fused = init(BatchRenorm(C, impl="fused", rmax=1.5, dmax=0.5))
    reference = copy.deepcopy(fused)
    reference.impl = "reference"
    for a, b in zip(steps(fused, [(x, grad)])[0], steps(reference, [(x, grad)])[0], strict=True):
        assert torch.equal(a, b)
    assert kernel_calls["reference"] == 2 and kernel_calls["local_stats"] == 1
    assert "forward_elemt" not in kernel_calls


@needs_ext
def test_auto_runs_the_kernels_and_says_so_once(monkeypatch, caplog, kernel_calls):
    """The default impl (bn.impl=auto in configs/bn/brn.yaml) takes the kernels, with bn's
    one info line."""
    monkeypatch.setattr(F, "_announced", set())
    caplog.set_level(logging.INFO, logger=F.__name__)
    cfg = compose_config([*TINY, "bn=brn"]).bn
    brn = norm_layer(cfg, device_slices=2, training_batches=100)(C)
    assert brn.impl == "auto" and "impl" not in repr(brn)
    for _ in range(2):
        brn(torch.randn(4, C, 3, 3)).sum().backward()
    assert kernel_calls["forward_elemt"] == 2 and "reference" not in kernel_calls
    assert [r.getMessage() for r in caplog.records] == [
        "bn impl auto -> fused kernels (syncbn_lab._C)"
    ]
    cfg.impl = "reference"
    assert norm_layer(cfg, training_batches=100)(C).impl == "reference"


def test_auto_without_the_extension_runs_the_reference(monkeypatch, kernel_calls):
    monkeypatch.setattr(F, "_announced", set())
    monkeypatch.setattr(ops, "available", lambda warn=True: False)
    monkeypatch.setattr(_ext, "unavailable_reason", lambda: "ImportError: pretend")
    with pytest.warns(UserWarning, match=r"bn impl auto -> reference \(extension not built"):
        BatchRenorm(C)(torch.randn(4, C, 2, 2))
    assert kernel_calls == {"reference": 1}
    with pytest.raises(RuntimeError, match="make build-ext"):
        BatchRenorm(C, impl="fused")


@needs_ext
def test_fused_compiles_fullgraph_without_recompiling():
    """torch.compile(fullgraph=True) of a conv + fused BatchRenorm on 4 device slices over
    steps where the limits change (read from num_batches_tracked inside the graph): one
    training graph and one eval graph, holding the kernels, the same numbers as eager."""
    import torch._dynamo.testing

    def model():
        torch.manual_seed(0)
        brn = BatchRenorm(8, impl="fused", device_slices=4, rmax=2.0, dmax=1.0,
                          warmup_batches=1, ramp_batches=2)  # fmt: skip
        with torch.no_grad():
            brn.running_var.fill_(0.5)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), brn).to(
            memory_format=torch.channels_last
        )

    torch._dynamo.reset()
    eager, compiled_model = model(), model()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, fullgraph=True, dynamic=False, backend=backend)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = (torch.randn(8, 3, 6, 6, generator=g) + 1).contiguous(memory_format=torch.channels_last)
        y, y_ref = compiled(x), eager(x)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        y.square().sum().backward()
        y_ref.square().sum().backward()
    for (name, a), (_, b) in zip(
        [*compiled_model.named_parameters(), *compiled_model.named_buffers()],
        [*eager.named_parameters(), *eager.named_buffers()],
        strict=True,
    ):
        torch.testing.assert_close(a.grad if a.grad is not None else a,
                                   b.grad if b.grad is not None else b,
                                   rtol=1e-4, atol=1e-5, msg=name)  # fmt: skip
    compiled_model.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    assert backend.frame_count == 2  # training and eval, never recompiled
    targets = {str(n.target) for gm in backend.graphs for m in gm.modules() for n in m.graph.nodes}
    assert {"syncbn_lab.local_stats", "syncbn_lab.forward_elemt"} <= {
        t.removeprefix("torch.ops.").removesuffix(".default") for t in targets
    }, targets
