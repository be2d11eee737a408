"""trainer.channels_last, bf16 and trainer.compile through every norm variant.

References: the same model in float64 NCHW eager (for bf16 + channels_last), and the same
model eager in float32 (for compile, whose graph must hold the norm ops without a break).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from syncbn_lab.config import compose
from syncbn_lab.engine import compute
from syncbn_lab.errors import ConfigError
from syncbn_lab.models.resnet import GlobalAvgPool
from syncbn_lab.nn.batch_renorm import renorm_limits
from syncbn_lab.nn.registry import norm_layer
from syncbn_lab.parallel.emulated import EmulatedDevices

DEVICES = 4
VARIANTS = {  # bn config overrides; brn with its limits in force from the first batch
    "bn": ["bn=bn"],
    "sync": ["bn=sync"],
    "brn": ["bn=brn", "bn.warmup=0", "bn.ramp=0", "bn.rmax=1.5", "bn.dmax=0.5"],
    "gn": ["bn=gn", "bn.groups=4"],
}


def norm(variant: str, devices: int) -> nn.Module:
    cfg = compose(VARIANTS[variant])
    layer = norm_layer(cfg.bn, device_slices=devices, training_batches=100)(8)
    with torch.no_grad():  # affine parameters and running statistics away from 1 and 0
        layer.weight.copy_(torch.linspace(0.5, 1.5, 8))
        layer.bias.copy_(torch.linspace(-0.3, 0.3, 8))
        if getattr(layer, "running_mean", None) is not None:
            layer.running_mean.fill_(0.3)  # brn: r and d clip against these
            layer.running_var.fill_(2.0)
    return layer


@pytest.mark.parametrize("devices", [1, DEVICES])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_norm_layer_in_bf16_channels_last_matches_float64(variant, devices):
    """Every norm variant on bf16 channels_last input under autocast against the same layer in
    float64 on the same values: the output and the input gradient come back in bf16 and
    channels_last, within bf16's rounding of the exact result (2**-8 relative; the kernels
    keep their statistics in float32), and the running statistics stay float32."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 8, 5, 5, generator=g) * 2 + 1).bfloat16()
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    dy = (
        torch.randn(8, 8, 5, 5, generator=g)
        .bfloat16()
        .contiguous(memory_format=torch.channels_last)
    )
    fast = norm(variant, devices)
    reference = copy.deepcopy(fast).double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fast(x)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = reference(x64)
    y64.backward(dy.double())

    for out, exact in ((y, y64), (x.grad, x64.grad)):
        assert out.dtype == torch.bfloat16
        assert out.is_contiguous(memory_format=torch.channels_last)
        scale = exact.abs().max().item()
        torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=1e-4 * scale)
    for p, p64 in zip(fast.parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.double(), p64.grad, rtol=1e-3, atol=1e-3)
    for (name, b), (_, b64) in zip(fast.named_buffers(), reference.named_buffers(), strict=True):
        if b.is_floating_point():
            assert b.dtype == torch.float32, name
            torch.testing.assert_close(b.double(), b64, rtol=1e-5, atol=1e-6, msg=name)


def every_variant_model() -> nn.Module:
    """conv -> one layer of each norm variant (ReLU between) -> pool -> linear, emulating
    DEVICES devices: one graph holds them all, so one compile covers every variant."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(2, 8, 3, padding=1, bias=False)]
    for variant in VARIANTS:
        layers += [norm(variant, DEVICES), nn.ReLU(inplace=True)]
    layers += [GlobalAvgPool(), nn.Flatten(), nn.Linear(8, 3)]
    return EmulatedDevices(nn.Sequential(*layers), DEVICES).to(memory_format=torch.channels_last)


def step(model: nn.Module, x: torch.Tensor):
    """Logits, the input's gradient and the parameters' gradients of one training step."""
    x = x.detach().requires_grad_()
    logits = model(x)
    weights = torch.linspace(-1, 1, logits.numel()).view(logits.shape)
    (logits * weights).sum().backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return logits.detach(), x.grad, grads


def test_compile_fullgraph_matches_eager():
    """Every norm variant in one graph in training and one in eval (fullgraph: a break would
    raise), the same numbers as eager, and no recompilation on later steps. The aot_eager
    backend traces exactly what inductor gets (forward and backward graphs) without its C++
    build; test_compiled_run_matches_eager runs inductor."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, model = every_variant_model(), every_variant_model()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2, 6, 6, generator=g) * 2 + 1
    x = x.contiguous(memory_format=torch.channels_last)
    for _ in range(3):
        got, want = step(compiled, x), step(eager, x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        for a, b in zip(got[2], want[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for (name, a), (_, b) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    model.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 2  # train and eval, never recompiled


@pytest.mark.slow
def test_compiled_run_matches_eager(tiny_cfg, tmp_path):
    """trainer.compile=true through the engine with inductor, in channels_last on 4 emulated
    devices with SyncBN: the same losses and final parameters as the eager run (float32
    rounding apart), and the training graph compiled once."""
    from torch._dynamo.utils import counters

    from syncbn_lab.engine.checkpoint import load
    from syncbn_lab.train import run

    common = ["parallel=emulated", "parallel.devices=4", "trainer.max_steps=4", "bn=sync",
              "trainer.channels_last=true", "trainer.eval_images=32"]  # fmt: skip
    torch._dynamo.reset()
    counters.clear()
    run(tiny_cfg(*common, "trainer.compile=true"), tmp_path / "compiled")
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    run(tiny_cfg(*common), tmp_path / "eager")
    runs = ("compiled", "eager")
    losses = [
        [json.loads(line)["train/loss"] for line in (tmp_path / r / "metrics.jsonl").open()]
        for r in runs
    ]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=0)
    states = [
        load(tmp_path / r / "checkpoints/last.pt", torch.device("cpu"))["model"] for r in runs
    ]
    for key, value in states[1].items():
        if value.is_floating_point():
            torch.testing.assert_close(states[0][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_compiled_ddp_run_matches_eager(tiny_cfg, tmp_path):
    """trainer.compile=true under parallel=ddp (2 gloo ranks, SyncBN, channels_last): not one
    graph (DDP's buckets split it), the same losses as the eager DDP run within float32
    rounding, and compiled once: no recompilation over the steps that follow."""
    from syncbn_lab.train import run

    common = ["parallel=ddp", "parallel.devices=2", "trainer.max_steps=3", "bn=sync",
              "trainer.channels_last=true", "trainer.eval_images=32"]  # fmt: skip
    compiled = run(tiny_cfg(*common, "trainer.compile=true"), tmp_path / "compiled")
    eager = run(tiny_cfg(*common), tmp_path / "eager")
    losses = [
        [json.loads(line)["train/loss"] for line in (tmp_path / r / "metrics.jsonl").open()]
        for r in ("compiled", "eager")
    ]
    assert len(losses[0]) == len(losses[1]) >= 3  # a record a step, and the epoch's
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=0)
    assert compiled["test_loss"] == pytest.approx(eager["test_loss"], rel=1e-4)
    assert compiled["compile_graphs"] >= 1 and compiled["compile_recompiles"] == 0
    assert "compile_graphs" not in eager


def test_compile_failure_is_one_line():
    class ReadsBack(nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()  # what fullgraph refuses
            return x

    with pytest.raises(Exception) as raised:
        compute.compile_model(ReadsBack())(torch.ones(2))
    error = compute.compile_error(raised.value)
    assert isinstance(error, ConfigError)
    assert "\n" not in str(error) and "trainer.compile=false" in str(error)
    assert compute.compile_error(ValueError("not a compile error")) is None


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["trainer.compile=true", "parallel=dp", "parallel.devices=2"], "DataParallel"),
        (["trainer.channels_last=maybe"], "true or false"),
    ],
)
def test_combinations_that_cannot_run_fail_before_the_run(overrides, fragment):
    from syncbn_lab.config import validate

    with pytest.raises(ConfigError, match=fragment) as raised:
        validate(compose(overrides))
    assert "\n" not in str(raised.value)


def test_renorm_limits_are_the_schedule_in_float64():
    """BatchRenorm's limits, computed from its counter tensor (traceable), against the
    schedule written out in Python floats (also float64)."""
    for warmup, ramp in ((2, 4), (3, 0), (0, 7)):
        for batch in range(12):
            if ramp:
                progress = min(max((batch - warmup) / ramp, 0.0), 1.0)
            else:
                progress = 1.0 if batch >= warmup else 0.0
            expected = (1.0 + 2.0 * progress, 5.0 * progress)
            limits = renorm_limits(torch.tensor(batch), 3.0, 5.0, warmup, ramp)
            assert tuple(float(v) for v in limits) == expected
