"""impl="fused" / "auto" in BatchNorm and SyncBatchNorm: the fused kernels against the reference.

Both implementations run side by side on the same batches (two training steps, so running
statistics and momentum are exercised); every output, input gradient, weight/bias gradient and
running statistic must agree within 1e-5 in fp32. A spy on ``syncbn_lab.nn.ops`` proves the
fused layer really ran the kernels (a fused layer that fell back to the reference would pass
any comparison with it). The gloo jobs compare both with each other and with float64 torch
BatchNorm over the union of the ranks' batches.
"""

from __future__ import annotations

import collections
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import error_ratio, torch_batchnorm_class
from torch import nn

from syncbn_lab.nn import BatchNorm, LocalCommunicator, SyncBatchNorm, _ext, ops
from syncbn_lab.nn import functional as F
from syncbn_lab.parallel.gloo_jobs import load_function, run_distributed

C = 3
KERNELS = ("batch_norm_train", "local_stats", "forward_elemt", "backward_reduce", "backward_elemt")
SINGLE_OP = {"batch_norm_train"}
REDUCED = {"local_stats", "forward_elemt", "backward_reduce", "backward_elemt"}
NAMES = ("output", "input_grad", "weight_grad", "bias_grad", "running_mean", "running_var")

needs_ext = pytest.mark.skipif(
    not _ext.load(), reason=f"syncbn_lab._C not built: {_ext.unavailable_reason()}"
)


def spy_on_kernels(patch) -> collections.Counter:
    """Count calls of the ops wrappers and of the reference; ``patch(obj, name, value)``."""
    seen: collections.Counter = collections.Counter()

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in KERNELS:
        patch(ops, name, spy(name, getattr(ops, name)))
    patch(F, "_reference_batch_norm", spy("reference", F._reference_batch_norm))
    patch(F, "_eval_batch_norm", spy("torch eval", F._eval_batch_norm))
    return seen


@pytest.fixture
def calls(monkeypatch) -> collections.Counter:
    return spy_on_kernels(monkeypatch.setattr)


def make_layer(kind: str, impl: str, devices: int = 1, group_size=None, **kwargs):
    if kind == "bn":
        layer = BatchNorm(C, impl=impl, device_slices=devices, **kwargs)
    else:
        layer = SyncBatchNorm(C, impl=impl, group_size=group_size, device_slices=devices, **kwargs)
    g = torch.Generator().manual_seed(7)
    if layer.weight is not None:
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5, generator=g)
            layer.bias.uniform_(-0.5, 0.5, generator=g)
    return layer


def batches(shape, dtype=torch.float32, memory_format=torch.contiguous_format, steps=2, seed=0):
    """Per-channel offsets and scales, rounded to ``dtype`` (the same values for both impls).

    Offsets stay near the spread and slices hold at least 4 values, so that |mean| / std of
    every slice stays below the large-offset guard (tested on its own below): the kernels run.
    (With 2-value slices |mean| / std is Cauchy-distributed and exceeds 16 for ~4% of them.)"""
    g = torch.Generator().manual_seed(seed)
    view = (1, shape[1]) + (1,) * (len(shape) - 2)
    out = []
    for _ in range(steps):
        scale = (0.5 + torch.rand(shape[1], generator=g)).view(view)
        offset = torch.randn(shape[1], generator=g).view(view)
        x = (torch.randn(*shape, generator=g) * scale + offset).to(dtype)
        grad = torch.randn(*shape, generator=g).to(dtype)
        out.append(
            (
                x.contiguous(memory_format=memory_format),
                grad.contiguous(memory_format=memory_format),
            )
        )
    return out


def run_layer(layer, steps) -> list[torch.Tensor | None]:
    """Outputs and input grads of every step, then parameter grads and running statistics."""
    ys, dxs = [], []
    for x, grad in steps:
        x = x.detach().clone().requires_grad_()
        y = layer(x)
        y.backward(grad)
        ys.append(y.detach())
        dxs.append(x.grad)
    params = [None, None] if layer.weight is None else [layer.weight.grad, layer.bias.grad]
    return [torch.cat(ys), torch.cat(dxs), *params, layer.running_mean, layer.running_var]


def worst_ratios(fused, reference, tol, names=NAMES) -> dict[str, float]:
    ratios = {}
    for name, a, b in zip(names, fused, reference, strict=True):
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        ratios[name] = error_ratio(a, b, tol, tol)
    return ratios


def assert_close_ratios(ratios: dict[str, float]) -> None:
    assert all(r <= 1 for r in ratios.values()), ratios


# --- one process: shapes, layouts, devices, sync, groups --------------------------------------

SHAPES = {
    "2d": ((16, C), torch.contiguous_format),
    "3d": ((16, C, 6), torch.contiguous_format),
    "nchw": ((8, C, 3, 4), torch.contiguous_format),
    "channels_last": ((8, C, 3, 4), torch.channels_last),
    "5d": ((8, C, 2, 3, 2), torch.contiguous_format),
    "channels_last_3d": ((8, C, 2, 3, 2), torch.channels_last_3d),
}
CONFIGS = {  # kind, devices, group_size; the kernels each one must run
    "bn-d1": ("bn", 1, None, SINGLE_OP),
    "bn-d2": ("bn", 2, None, SINGLE_OP),
    "bn-d4": ("bn", 4, None, SINGLE_OP),
    "sync-d1": ("sync", 1, None, SINGLE_OP),
    "sync-d2": ("sync", 2, None, REDUCED),
    "sync-d4": ("sync", 4, None, REDUCED),
    "sync-d4-g2": ("sync", 4, 2, REDUCED),
}


@needs_ext
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_equals_reference_fp32(calls, config, shape):
    kind, devices, group_size, kernels = CONFIGS[config]
    dims, memory_format = SHAPES[shape]
    steps = batches(dims, memory_format=memory_format)
    fused_layer = make_layer(kind, "fused", devices, group_size)
    fused = run_layer(fused_layer, steps)
    assert set(calls) == kernels, calls  # the kernels ran, the reference did not
    assert fused[0].is_contiguous(memory_format=memory_format)
    assert fused[1].is_contiguous(memory_format=memory_format)
    reference = run_layer(make_layer(kind, "reference", devices, group_size), steps)
    assert calls["reference"] == len(steps)  # guards the spy itself
    assert_close_ratios(worst_ratios(fused, reference, 1e-5))
    assert int(fused_layer.num_batches_tracked) == len(steps)


@needs_ext
@pytest.mark.parametrize(
    "kwargs", [{"momentum": None}, {"affine": False}, {"track_running_stats": False}]
)
@pytest.mark.parametrize("config", ["bn-d2", "sync-d1", "sync-d4-g2"])
def test_fused_equals_reference_module_options(calls, config, kwargs):
    kind, devices, group_size, kernels = CONFIGS[config]
    steps = batches((8, C, 3, 2), steps=3)
    fused = run_layer(make_layer(kind, "fused", devices, group_size, **kwargs), steps)
    assert set(calls) == kernels, calls
    reference = run_layer(make_layer(kind, "reference", devices, group_size, **kwargs), steps)
    assert_close_ratios(worst_ratios(fused, reference, 1e-5))


# Half types: both implementations compute in fp32 but round y and dx to the input dtype once,
# so they may differ by one rounding of the output: bf16 (8 bits) ~4e-3, fp16 (11 bits) ~5e-4.
# Weight/bias grads and running statistics are fp32 sums of the same rounded values: 1e-5.
HALF_TOLERANCES = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@needs_ext
@pytest.mark.parametrize("dtype", list(HALF_TOLERANCES))
@pytest.mark.parametrize("config", ["bn-d2", "sync-d1", "sync-d4"])
@pytest.mark.parametrize("shape", ["nchw", "channels_last"])
def test_fused_equals_reference_half_types(calls, dtype, config, shape):
    kind, devices, group_size, kernels = CONFIGS[config]
    dims, memory_format = SHAPES[shape]
    steps = batches(dims, dtype=dtype, memory_format=memory_format)
    fused = run_layer(make_layer(kind, "fused", devices, group_size), steps)
    assert set(calls) == kernels, calls
    reference = run_layer(make_layer(kind, "reference", devices, group_size), steps)
    assert fused[0].dtype == dtype and fused[1].dtype == dtype
    assert_close_ratios(worst_ratios(fused[:2], reference[:2], HALF_TOLERANCES[dtype], NAMES[:2]))
    assert_close_ratios(worst_ratios(fused[2:], reference[2:], 1e-5, NAMES[2:]))


@needs_ext
def test_eval_runs_torchs_batch_norm_without_kernels(calls):
    """Eval is one elementwise pass with the running statistics: torch's batch_norm, equal
    to the reference's formula up to float32 rounding."""
    fused_layer, reference_layer = (
        make_layer("sync", "fused", 2),
        make_layer("sync", "reference", 2),
    )
    steps = batches((8, C, 3, 4))
    run_layer(fused_layer, steps[:1])
    run_layer(reference_layer, steps[:1])
    fused_layer.eval()
    reference_layer.eval()
    calls.clear()
    fused = run_layer(fused_layer, steps[1:])
    assert set(calls) == {"torch eval"}, calls
    assert_close_ratios(worst_ratios(fused, run_layer(reference_layer, steps[1:]), 1e-5))


@needs_ext
def test_fused_local_communicator_once_per_direction(monkeypatch, calls):
    """Emulated devices reduce through the communicator like real ranks; one slice does not."""
    sizes = []
    monkeypatch.setattr(LocalCommunicator, "all_reduce_sum", lambda self, t: sizes.append(t) or t)
    x = torch.randn(4, C, 3, 3, requires_grad=True)
    make_layer("sync", "fused", devices=2)(x).sum().backward()
    assert [(t.numel(), t.dtype) for t in sizes] == [
        (2 * C + 1, torch.float64),
        (2 * C, torch.float32),
    ]
    sizes.clear()
    make_layer("sync", "fused", devices=1)(x).sum().backward()
    assert sizes == [] and calls["batch_norm_train"] == 1


# --- numerics: the large-offset guarantee -----------------------------------------------------


def _float64_batchnorm(x, grad, weight, bias, slices=1):
    """torch BatchNorm in float64 on slice 0 of ``slices``: (y, dx, dw, db, rm, rv)."""
    n = x.shape[0] // slices
    bn = torch_batchnorm_class(x.dim())(x.shape[1], momentum=1.0).double()
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    x64 = x[:n].detach().double().requires_grad_()
    y = bn(x64)
    y.backward(grad[:n].double())
    return [y.detach(), x64.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var]


@needs_ext
@pytest.mark.parametrize("config", ["bn-d1", "bn-d4", "sync-d1", "sync-d4"])
def test_large_offset_stays_within_1e_4_of_float64(calls, config):
    """Mean 1e4, std 0.1 in fp32: the kernels' float32 mean alone puts xhat tens of times
    outside 1e-4, so the guard hands the call to the reference, which matches float64."""
    kind, devices, group_size, _ = CONFIGS[config]
    g = torch.Generator().manual_seed(0)
    x = (1e4 + 0.1 * torch.randn(16, C, 8, 8, generator=g, dtype=torch.float64)).float()
    grad = torch.randn(16, C, 8, 8, generator=g)
    layer = make_layer(kind, "fused", devices, group_size, momentum=1.0)
    ours = run_layer(layer, [(x, grad)])
    assert calls["reference"] == 1, calls
    slices = devices if kind == "bn" else 1
    expected = _float64_batchnorm(x, grad, layer.weight, layer.bias, slices)
    if slices > 1:  # per-device BN: compare slice 0; its parameter grads are a part of the sum
        n = x.shape[0] // slices
        ours = [ours[0][:n], ours[1][:n], *expected[2:4], *ours[4:]]
    assert_close_ratios(worst_ratios(ours, expected, 1e-4))
    # Without the guard: the single op on the same data misses 1e-4 (the guard is needed).
    raw = ops.batch_norm_train(x, layer.weight.detach(), layer.bias.detach(), 1, 1, 1e-5)
    expected_y = _float64_batchnorm(x, grad, layer.weight, layer.bias)[0]
    assert error_ratio(raw.y, expected_y, 1e-4, 1e-4) > 10


@needs_ext
@pytest.mark.parametrize("config", ["bn-d1", "sync-d4"])
def test_moderate_offset_stays_on_the_kernels(calls, config):
    """|mean| / std = 10, below the guard's limit of 16: kernels only, float64 within 1e-5."""
    kind, devices, group_size, kernels = CONFIGS[config]
    g = torch.Generator().manual_seed(1)
    x = (10 + torch.randn(16, C, 6, 6, generator=g, dtype=torch.float64)).float()
    grad = torch.randn(16, C, 6, 6, generator=g)
    layer = make_layer(kind, "fused", devices, group_size, momentum=1.0)
    ours = run_layer(layer, [(x, grad)])
    assert set(calls) == kernels, calls
    expected = _float64_batchnorm(x, grad, layer.weight, layer.bias, devices if kind == "bn" else 1)
    assert_close_ratios(worst_ratios(ours, expected, 1e-5))


@needs_ext
def test_tiny_slices_of_a_synced_group_stay_on_the_kernels(calls):
    """2-value slices: their own |mean| / std is heavy-tailed, but a synced group is checked
    against its slices' average variance, so the kernels keep the call."""
    steps = batches((16, C), steps=3, seed=3)
    slices = [x.view(8, 2, C) for x, _ in steps]  # some slice alone would fail the guard:
    ratios = [s.mean(1).abs() * torch.rsqrt(s.var(1, unbiased=False) + 1e-5) for s in slices]
    assert max(float(r.max()) for r in ratios) > F._FUSED_MEAN_LIMIT
    fused = run_layer(make_layer("sync", "fused", devices=8), steps)
    assert set(calls) == REDUCED, calls
    reference = run_layer(make_layer("sync", "reference", devices=8), steps)
    assert_close_ratios(worst_ratios(fused, reference, 1e-5))


@needs_ext
@pytest.mark.parametrize("config", ["bn-d1", "bn-d2", "sync-d1"])
def test_single_value_per_channel_raises(config):
    kind, devices, group_size, _ = CONFIGS[config]
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        make_layer(kind, "fused", devices, group_size)(torch.zeros(devices, C))


# --- impl="auto" and impl="fused" without the extension ----------------------------------------


@pytest.fixture
def fresh_announcements(monkeypatch):
    monkeypatch.setattr(F, "_announced", set())


def _pretend_not_built(monkeypatch):
    monkeypatch.setattr(ops, "available", lambda warn=True: False)
    monkeypatch.setattr(_ext, "unavailable_reason", lambda: "ImportError: pretend")


def _auto_step(layer):
    x = torch.randn(4, C, 3, 3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(x).sum().backward()
        layer(x).sum().backward()
    return [str(w.message) for w in caught]


@needs_ext
def test_auto_takes_the_fused_kernels_and_says_so_once_in_the_log(
    calls, fresh_announcements, caplog
):
    """Nothing is wrong: an info line of the run log, no warning."""
    caplog.set_level(logging.INFO, logger=F.__name__)
    assert _auto_step(SyncBatchNorm(C)) == []
    assert calls["batch_norm_train"] == 2 and "reference" not in calls
    assert _auto_step(BatchNorm(C)) == []
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [(logging.INFO, "bn impl auto -> fused kernels (syncbn_lab._C)")]  # once


@needs_ext
def test_auto_says_which_as_one_log_line_and_no_warning():
    """In a process whose logging shows INFO (a Hydra run's log does), stderr holds the one
    line of the choice and no warning."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s %(message)s')\n"
        "from syncbn_lab.nn import SyncBatchNorm\n"
        "layer = SyncBatchNorm(3)\n"
        "layer(torch.randn(4, 3, 2, 2)).sum().backward()\n"
        "layer(torch.randn(4, 3, 2, 2)).sum().backward()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "syncbn_lab.nn.functional INFO bn impl auto -> fused kernels (syncbn_lab._C)"
    ]


def test_auto_falls_back_to_the_reference_and_says_why_once(
    monkeypatch, calls, fresh_announcements
):
    _pretend_not_built(monkeypatch)
    messages = _auto_step(SyncBatchNorm(C))  # a build without kernels: a real warning
    assert messages == ["bn impl auto -> reference (extension not built: ImportError: pretend)"]
    assert calls == {"reference": 2}


@needs_ext
def test_auto_refuses_inputs_the_kernels_do_not_take():
    assert F.fused_unavailable_reason(torch.empty(2, C)) is None
    assert "meta tensors" in F.fused_unavailable_reason(torch.empty(2, C, device="meta"))


@needs_ext
def test_cuda_kernels_asked_once_at_import_follow_the_dispatcher():
    """ops.has_cuda_kernels() is the dispatcher's answer at import: in a fresh process where a
    CUDA kernel of local_stats is registered before syncbn_lab.nn.ops is imported (a stand-in
    where the build has none), it is True, and False where it is not (CPU builds)."""
    script = (
        "import sys, torch, syncbn_lab._C\n"
        "register = sys.argv[1] == '1'\n"
        "has = torch._C._dispatch_has_kernel_for_dispatch_key\n"
        "if register and not has('syncbn_lab::local_stats', 'CUDA'):\n"
        "    lib = torch.library.Library('syncbn_lab', 'IMPL')\n"
        "    lib.impl('local_stats', lambda x, devices: None, 'CUDA')\n"
        "from syncbn_lab.nn import ops\n"
        "print(ops.has_cuda_kernels(), has('syncbn_lab::local_stats', 'CUDA'))\n"
    )
    for register in ("1", "0"):
        result = subprocess.run(
            [sys.executable, "-c", script, register], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        cached, dispatcher = result.stdout.split()
        assert cached == dispatcher, (register, result.stdout)
        if register == "1":
            assert cached == "True"
    assert ops.has_cuda_kernels() == _ext.has_cuda_kernels()


def test_fused_without_the_extension_is_one_clear_line(monkeypatch):
    _pretend_not_built(monkeypatch)
    for make in (lambda: SyncBatchNorm(C, impl="fused"), lambda: BatchNorm(C, impl="fused")):
        with pytest.raises(RuntimeError) as error:
            make()
        message = str(error.value)
        assert "\n" not in message and "make build-ext" in message
        assert "impl='reference'" in message and "ImportError: pretend" in message
    with pytest.raises(RuntimeError, match="make build-ext"):
        F.batch_norm(torch.randn(4, C), None, None, None, None, training=True, momentum=0.1,
                     eps=1e-5, impl="fused")  # fmt: skip


# --- real gloo ranks ----------------------------------------------------------------------------

DIST_SPLITS = {
    2: {"uneven": [2, 7], "one_empty": [0, 6]},
    3: {"uneven": [1, 5, 2], "one_empty": [4, 0, 3]},
}
DIST_CASES = Path(__file__).with_name("syncbn_dist_cases.py")


def dist_worker(rank: int, world_size: int) -> dict[str, object]:
    """Every case on this rank; returns error ratios, collectives and kernel calls."""
    match = load_function(f"{DIST_CASES}:_match")
    count_collectives = load_function(f"{DIST_CASES}:_CountCollectives")
    seen = spy_on_kernels(setattr)
    everyone = list(range(world_size))
    out: dict[str, object] = {}
    for split, sizes in DIST_SPLITS[world_size].items():
        # Against float64 torch BatchNorm on the union of the batches (DDP-averaged grads).
        for name, memory_format in (("nchw", torch.contiguous_format), ("cl", torch.channels_last)):
            out[f"{split}-{name}-float64"] = match(
                rank, sizes, lambda: SyncBatchNorm(3, impl="fused"), everyone,
                memory_format=memory_format,
            )  # fmt: skip
        # Against the reference, rank by rank, on this rank's shard.
        g = torch.Generator().manual_seed(rank)
        steps = []
        for _ in range(2):
            x = torch.randn(sizes[rank], C, 5, 4, generator=g) * 2 + 1
            steps.append((x, torch.randn(sizes[rank], C, 5, 4, generator=g)))
        fused = run_layer(make_layer("sync", "fused"), steps)
        reference = run_layer(make_layer("sync", "reference"), steps)
        out[f"{split}-vs-reference"] = worst_ratios(fused, reference, 1e-5)
    out["kernel_calls"] = dict(seen)
    with count_collectives() as c:
        y = make_layer("sync", "fused")(torch.randn(2 + rank, C, 4, requires_grad=True))
    out["forward_collectives"] = c.calls
    with count_collectives() as c:
        y.sum().backward()
    out["backward_collectives"] = c.calls
    try:  # one value per channel over the whole group: every rank raises
        make_layer("sync", "fused")(torch.zeros(1 if rank == 0 else 0, C))
        out["single_value"] = "no error"
    except ValueError as e:
        out["single_value"] = str(e)
    check = torch.ones(1)
    dist.all_reduce(check)
    out["group_still_usable"] = int(check.item())
    return out


@needs_ext
@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_on_gloo_ranks_with_uneven_and_empty_batches(world_size):
    results = run_distributed(dist_worker, world_size, timeout_s=55, pg_timeout_s=20)
    for rank, out in enumerate(results):
        for name, ratios in out.items():
            if name.endswith("float64") or name.endswith("vs-reference"):
                bad = {q: r for q, r in ratios.items() if r > 1}
                assert not bad, f"rank {rank}, {name}: {bad}"
        assert out["kernel_calls"].get("local_stats", 0) > 0, out["kernel_calls"]
        # the reference layers only: the fused ones never fell back
        assert out["kernel_calls"]["reference"] == 2 * len(DIST_SPLITS[world_size])
        assert out["forward_collectives"] == [("all_reduce", 2 * C + 1, "torch.float64")]
        assert out["backward_collectives"] == [("all_reduce", 2 * C, "torch.float32")]
        assert "more than 1 value per channel" in out["single_value"], out["single_value"]
        assert out["group_still_usable"] == world_size


# --- torch.compile ------------------------------------------------------------------------------


@needs_ext
def test_fused_modules_compile_fullgraph_into_one_graph():  # ~14 s on 2 busy cores: not slow
    """SyncBatchNorm and BatchNorm (impl="fused", one process) under fullgraph=True: one graph
    holding one batch_norm_train op per layer; outputs, grads and buffers equal eager."""
    import torch._dynamo.testing

    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            SyncBatchNorm(8, impl="fused"),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False),
            BatchNorm(8, impl="fused", momentum=None),
        ).to(memory_format=torch.channels_last)

    eager, compiled_model = model(), model()
    backend = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    for _ in range(2):  # the second step reuses the graph and updates the buffers again
        y, y_ref = compiled(x), eager(x)
        y.square().sum().backward()
        y_ref.square().sum().backward()
    assert backend.frame_count == 1
    targets = [str(n.target) for g in backend.graphs for n in g.graph.nodes]
    assert sum("syncbn_lab.batch_norm_train" in t for t in targets) == 2, targets
    assert error_ratio(y, y_ref) <= 1
    for (name, p), (_, p_ref) in zip(
        compiled_model.named_parameters(), eager.named_parameters(), strict=True
    ):
        assert error_ratio(p.grad, p_ref.grad, 1e-4, 1e-4) <= 1, name
    for (name, b), (_, b_ref) in zip(
        compiled_model.named_buffers(), eager.named_buffers(), strict=True
    ):
        assert error_ratio(b, b_ref) <= 1, name
