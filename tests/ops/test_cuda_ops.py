"""CUDA kernels against the float64 reference on the GPU (skipped without a GPU).

Shapes are chosen to reach every launch shape of csrc/cuda/syncbn.cu: planes (S >= 32) and
rows (channels_last, or S < 32), one and many chunks per (slice, channel), fewer channels than
a warp, 16-byte vector loads and the scalar fallback (odd sizes), 32- and 64-bit indices.
Tolerances as in test_fused_ops.py.
"""

from __future__ import annotations

import pytest
import torch
from reference_bn import reference_with_grads
from test_fused_ops import TOL, assert_matches, to_layout

from syncbn_lab.nn import _ext, ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
    pytest.mark.skipif(
        not _ext.has_cuda_kernels(), reason="syncbn_lab._C was built without CUDA kernels"
    ),
]

SHAPES = {
    "2d": (64, 37),
    "3d": (16, 5, 33),
    "small_plane": (32, 40, 3, 5),
    "plane": (16, 24, 16, 16),
    "many_chunks": (256, 3, 32, 32),
    "odd_plane": (6, 7, 9, 11),
    "5d": (4, 8, 4, 6, 8),
}


def make_cuda_inputs(shape, dtype, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + 0.5
    dy = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = 1 + 0.5 * torch.randn(shape[1], generator=g, dtype=torch.float64)
    b = 0.3 * torch.randn(shape[1], generator=g, dtype=torch.float64)
    x = to_layout(x.to(dtype), layout).cuda()
    dy = to_layout(dy.to(dtype), layout).cuda()
    return x, w.float().cuda(), b.float().cuda(), dy


def run_cuda(x, w, b, dy, devices, group_size):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_()
    out = ops.batch_norm_train(x, w, b, devices, group_size, 1e-5)
    out.y.backward(dy)
    assert out.y.is_cuda and out.mean.is_cuda
    return {
        "y": out.y.detach().cpu(),
        "mean": out.mean.cpu(),
        "var": out.var.cpu(),
        "dx": x.grad.cpu(),
        "dweight": w.grad.cpu(),
        "dbias": b.grad.cpu(),
    }


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_cuda_matches_float64_reference(shape, layout):
    x, w, b, dy = make_cuda_inputs(shape, torch.float32, layout)
    fused = run_cuda(x, w, b, dy, devices=2, group_size=1)
    ref = reference_with_grads(x.cpu(), w.cpu(), b.cpu(), dy.cpu(), groups=2)
    # d(weight), d(bias) are sums over up to 2^17 values: compare them per value.
    count = x.numel() // x.shape[1]
    for name in ("dweight", "dbias"):
        fused[name], ref[name] = fused[name] / count, ref[name] / count
    assert_matches(fused, ref, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_cuda_dtypes(dtype, layout):
    x, w, b, dy = make_cuda_inputs((32, 16, 8, 8), dtype, layout, seed=1)
    fused = run_cuda(x, w, b, dy, devices=4, group_size=2)
    ref = reference_with_grads(x.cpu(), w.cpu(), b.cpu(), dy.cpu(), groups=2)
    for name in ("dweight", "dbias"):
        fused[name], ref[name] = fused[name] / 1024, ref[name] / 1024
    assert fused["y"].dtype == dtype
    assert_matches(fused, ref, TOL[dtype], stats_tol=1e-5 if dtype != torch.float64 else 1e-10)


@pytest.mark.parametrize("devices,group_size", [(1, 1), (4, 1), (4, 4), (8, 2)])
def test_cuda_equals_cpu_kernels(devices, group_size):
    x, w, b, dy = make_cuda_inputs((32, 12, 10, 10), torch.float32, "channels_last", seed=2)
    gpu = run_cuda(x, w, b, dy, devices, group_size)
    xc = x.cpu().requires_grad_()
    wc, bc = w.cpu().requires_grad_(), b.cpu().requires_grad_()
    out = ops.batch_norm_train(xc, wc, bc, devices, group_size, 1e-5)
    out.y.backward(dy.cpu())
    torch.testing.assert_close(gpu["y"], out.y.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu["dx"], xc.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu["var"], out.var, atol=1e-6, rtol=1e-5)


def test_cuda_large_offset_is_stable():
    g = torch.Generator().manual_seed(0)
    x64 = 1e4 + 0.1 * torch.randn(64, 4, 16, 16, generator=g, dtype=torch.float64)
    for layout in ("contiguous", "channels_last"):
        x = to_layout(x64.float(), layout).cuda()
        out = ops.batch_norm_train(x, None, None, 4, 4, 0.0)
        ref = x.double().cpu().transpose(0, 1).reshape(4, -1).var(1, unbiased=False)
        torch.testing.assert_close(out.var[0].double().cpu(), ref, rtol=1e-4, atol=0)


def test_cuda_dy_on_another_device_raises():
    x, w, b, dy = make_cuda_inputs((4, 3, 6, 6), torch.float32, "contiguous")
    mean, invstd = torch.zeros(1, 3, device="cuda"), torch.ones(1, 3, device="cuda")
    with pytest.raises(RuntimeError, match="dy must be on"):
        ops.backward_reduce(dy.cpu(), x, mean, invstd)
    sums = torch.zeros(1, 3, device="cuda")
    count = torch.full((1,), 144.0, device="cuda")
    with pytest.raises(RuntimeError, match="dy must be on"):
        ops.backward_elemt(dy.cpu(), x, mean, invstd, None, None, sums, sums, count)


def test_cuda_more_channels_than_a_grid_dimension():
    """C > 65535 with NCHW planes runs the rows shape (gridDim.y holds at most 65535)."""
    x = torch.randn(2, 70000, 32, device="cuda")
    count, mean, m2 = ops.local_stats(x, 1)
    cpu = ops.local_stats(x.cpu(), 1)
    torch.testing.assert_close(mean.cpu(), cpu[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m2.cpu(), cpu[2], atol=1e-4, rtol=1e-5)


def test_cuda_runs_on_the_current_stream():
    """With the default stream held up by a long sleep kernel, the op on a side stream finishes
    and its result is read on that stream: launches on the default stream (or a device-wide
    sync) would still wait behind the sleep, and the read would see no result."""
    x, w, b, dy = make_cuda_inputs((16, 8, 8, 8), torch.float32, "contiguous")
    lib = torch.ops.syncbn_lab

    def step():
        out = ops.batch_norm_train(x, w, b, 1, 1, 1e-5)
        dx = lib.batch_norm_train_backward(dy, x, w, b, out.mean, out.invstd, True)[0]
        return out, dx

    out, dx = step()
    expected, expected_dx = out.y.cpu(), dx.cpu()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm the side stream's cached blocks (no cudaMalloc later)
        out, dx = step()
        for t in (*out, dx):
            t.fill_(float("nan"))  # what a read of an unwritten reused block would see
        del out, dx
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 31)  # on the default stream: about a second on current GPUs
    with torch.cuda.stream(side):
        out, dx = step()
        y, dx = out.y.cpu(), dx.cpu()  # copies on the side stream
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    # The sleep still runs: nothing above waited for the default stream (or the sleep is too
    # short for this GPU's clock).
    assert not torch.cuda.default_stream().query(), "the op waited for the default stream"
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected, atol=0, rtol=0)
    torch.testing.assert_close(dx, expected_dx, atol=0, rtol=0)


def test_cuda_opcheck():
    x, w, b, dy = make_cuda_inputs((8, 4, 6, 6), torch.float64, "channels_last")
    w, b = w.double(), b.double()
    lib = torch.ops.syncbn_lab
    count, mean, m2 = lib.local_stats(x, 2)
    invstd = torch.rsqrt(m2 / count[:, None] + 1e-5)
    sums = lib.backward_reduce(dy, x, mean, invstd, w, b)
    cases = [
        (lib.local_stats.default, (x, 2)),
        (lib.forward_elemt.default, (x, mean, invstd, w, b)),
        (lib.backward_reduce.default, (dy, x, mean, invstd, w, b)),
        (lib.backward_elemt.default, (dy, x, mean, invstd, w, b, *sums, count)),
        (
            lib.batch_norm_train.default,
            (x.clone().requires_grad_(), w.clone().requires_grad_(), b, 2, 2, 1e-5),
        ),
        (lib.batch_norm_train_backward.default, (dy, x, w, b, mean, invstd, True)),
        (
            lib.update_running_stats.default,
            (torch.zeros_like(w), torch.ones_like(w), mean, m2, invstd, 0.1, 50, 16.0),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.slow
def test_cuda_64bit_indices():
    """More than 2^30 elements: the elementwise kernels switch to 64-bit indexing."""
    n = (1 << 30) // (64 * 256) + 1
    x = torch.randn(n, 64, 256, device="cuda", dtype=torch.bfloat16)
    mean = torch.zeros(1, 64, device="cuda")
    invstd = torch.full((1, 64), 2.0, device="cuda")
    y = ops.forward_elemt(x, mean, invstd)
    assert x.numel() > (1 << 30)
    torch.testing.assert_close(y[-1], (x[-1].float() * 2).bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(y[0], (x[0].float() * 2).bfloat16(), atol=0, rtol=0)


def test_cuda_backward_without_input_grad_and_empty_input():
    x, w, b, dy = make_cuda_inputs((8, 6, 5, 7), torch.float32, "contiguous", seed=4)
    out = ops.batch_norm_train(x, w, b, 2, 1, 1e-5)
    lib = torch.ops.syncbn_lab
    full = lib.batch_norm_train_backward(dy, x, w, b, out.mean, out.invstd, True)
    sums = lib.batch_norm_train_backward(dy, x, w, b, out.mean, out.invstd, False)
    assert sums[0].numel() == 0
    torch.testing.assert_close(sums[1:], full[1:], atol=0, rtol=0)
    cpu = lib.batch_norm_train_backward(
        dy.cpu(), x.cpu(), w.cpu(), b.cpu(), out.mean.cpu(), out.invstd.cpu(), True
    )
    for a, c in zip(full, cpu, strict=True):
        torch.testing.assert_close(a.cpu(), c, atol=1e-4, rtol=1e-5)
    # An empty batch: zero statistics, empty outputs, zero gradient sums (as on the CPU).
    empty = torch.empty(0, 6, 4, device="cuda", requires_grad=True)
    res = ops.batch_norm_train(empty, w, b, 1, 1, 1e-5)
    res.y.sum().backward()
    assert res.y.shape == empty.shape and empty.grad.shape == empty.shape
    assert torch.equal(res.var.cpu(), torch.zeros(1, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("factor", [0.1, 0.7])
def test_cuda_update_running_stats_equals_cpu_bitwise(dtype, factor):
    """One launch on the GPU: the same explicit-fma lerp as the CPU kernel, over more
    channels than a block has threads, and the same precision-guard answer."""
    g = torch.Generator().manual_seed(5)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    mean = torch.randn(3, 300, generator=g, dtype=stat_dtype)
    var = torch.rand(3, 300, generator=g, dtype=stat_dtype) + 0.5
    invstd = torch.rsqrt(var + 1e-5)
    running = (torch.randn(300, generator=g).to(dtype), torch.rand(300, generator=g).to(dtype))
    for coarse in (False, True):
        if coarse:
            mean[2, 299] = 1e4  # |mean| * invstd > 16 in a row other than 0
        cpu = [t.clone() for t in running]
        gpu = [t.clone().cuda() for t in running]
        stats = (mean, var, invstd)
        got_cpu = ops.update_running_stats(*cpu, *stats, factor, 10, 16.0)
        got_gpu = ops.update_running_stats(*gpu, *(t.cuda() for t in stats), factor, 10, 16.0)
        assert got_cpu == got_gpu == coarse
        for a, c, before in zip(gpu, cpu, running, strict=True):
            assert torch.equal(a.cpu(), c)
            assert torch.equal(c, before) == coarse  # nothing moves when the guard trips
    # mean_limit 0: no check, and the running statistics are optional.
    assert not ops.update_running_stats(None, None, *(t.cuda() for t in stats), 0.5, 10, 0.0)


@pytest.mark.parametrize("devices", [1, 4], ids=["one_device", "emulated_4"])
def test_cuda_module_fused_equals_reference(devices):
    """The module's eager path on the GPU against the reference module: one device
    (batch_norm_train + update_running_stats) and SyncBN over 4 emulated devices (the
    primitives around the reference's reduction); the guard tripped (mean 1e4, std 0.1:
    the reference runs) and not."""
    from syncbn_lab.nn import SyncBatchNorm

    g = torch.Generator().manual_seed(6)
    for offset in (0.5, 1e4):
        x = (offset + 0.1 * torch.randn(16, 5, 6, 6, generator=g)).cuda()
        dy = torch.randn(16, 5, 6, 6, generator=g).cuda()
        outs = []
        for impl in ("fused", "reference"):
            bn = SyncBatchNorm(5, impl=impl, device_slices=devices).cuda()
            xi = x.clone().requires_grad_()
            for _ in range(2):
                bn(xi).backward(dy)
            outs.append((bn(xi).detach(), xi.grad, bn.weight.grad, bn.running_mean, bn.running_var))
        for a, r in zip(*outs, strict=True):
            torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_cuda_module_compiles_fullgraph():
    """SyncBatchNorm(impl="fused") on the GPU under torch.compile(fullgraph=True): one graph
    (no data-dependent guard, no dispatcher query per step), the eager module's numbers."""
    from syncbn_lab.nn import SyncBatchNorm

    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 4, 6, 6, generator=g).cuda().contiguous(memory_format=torch.channels_last)
    dy = torch.randn(8, 4, 6, 6, generator=g).cuda()
    results = []
    for compile_it in (False, True):
        bn = SyncBatchNorm(4, impl="fused").cuda()
        model = torch.compile(bn, fullgraph=True) if compile_it else bn
        xi = x.clone().requires_grad_()
        for _ in range(2):  # the second call reuses the graph
            y = model(xi)
            y.backward(dy)
        results.append((y.detach(), xi.grad, bn.weight.grad, bn.running_mean, bn.running_var))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cuda_update_running_stats_without_a_check_does_not_sync():
    """mean_limit 0 (float64 input, or the guard switched off): nothing is read back."""
    stats = [torch.rand(2, 16, device="cuda", dtype=torch.float64) + 0.5 for _ in range(3)]
    running = [torch.zeros(16, device="cuda", dtype=torch.float64) for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert not ops.update_running_stats(*running, *stats, 0.1, 10, 0.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert running[0].abs().sum() > 0  # the update itself ran


def test_cuda_training_step_launches_six_kernels():
    """A small layer's step is bound by the host's launches: batch_norm_train and its
    backward run 3 kernels each (statistics, merge, elementwise; sums, merge, dx), with no
    fill kernels for zero gradients (parameters without .grad take theirs as they are)."""
    from torch.profiler import ProfilerActivity, profile

    x, w, b, dy = make_cuda_inputs((16, 8, 6, 6), torch.float32, "channels_last")

    def step():
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
        ops.batch_norm_train(xs, ws, bs, 1, 1, 1e-5).y.backward(dy)

    step()
    inputs = [t.detach().clone() for t in (x, w, b)]  # the clones' copies are not counted
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        xs, ws, bs = (t.requires_grad_() for t in inputs)
        ops.batch_norm_train(xs, ws, bs, 1, 1, 1e-5).y.backward(dy)
        torch.cuda.synchronize()
    kernels = [
        e.name
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
    ]
    assert len(kernels) == 6, kernels
