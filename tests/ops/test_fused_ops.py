"""Fused CPU kernels (torch.ops.syncbn_lab) against a float64 plain-torch BatchNorm.

Tolerances: float32 and float64 within 1e-5 (absolute and relative); float16/bfloat16 outputs
and gradients within the input dtype's rounding (bf16: 3e-2, fp16: 5e-3 absolute, relative
alike) while their statistics, accumulated in float32 from the exact half values, stay
within 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference_bn import reference_batch_norm, reference_with_grads

from syncbn_lab.nn import _ext, ops

pytestmark = pytest.mark.skipif(
    not _ext.load(), reason=f"syncbn_lab._C not built: {_ext.unavailable_reason()}"
)

TOL = {torch.float64: 1e-5, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# (name, shape): every loop shape of the kernels (see csrc/syncbn_cpu.cpp).
SHAPES = {
    "2d": (8, 5),
    "3d": (8, 3, 7),
    "4d_small_plane": (8, 3, 2, 3),  # S = 6: rows of C * S virtual channels
    "4d_plane": (8, 3, 6, 6),  # S = 36: planes, 2 lanes blocks + a tail of 4
    "5d": (4, 3, 2, 3, 8),  # S = 48
}


def make_inputs(shape, dtype=torch.float32, layout="contiguous", seed=0, affine=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 2.0 + 0.5
    dy = torch.randn(*shape, generator=g, dtype=torch.float64)
    weight = 1 + 0.5 * torch.randn(shape[1], generator=g, dtype=torch.float64)
    bias = 0.3 * torch.randn(shape[1], generator=g, dtype=torch.float64)
    x, dy = to_layout(x.to(dtype), layout), to_layout(dy.to(dtype), layout)
    if not affine:
        return x, None, None, dy
    return x, weight.float(), bias.float(), dy


def to_layout(t, layout):
    if layout == "contiguous":
        return t.contiguous()
    if layout == "channels_last":
        if t.dim() == 4:
            return t.contiguous(memory_format=torch.channels_last)
        if t.dim() == 5:
            return t.contiguous(memory_format=torch.channels_last_3d)
        # 3-D: (N, L, C) memory seen as (N, C, L)
        return t.transpose(1, -1).contiguous().transpose(1, -1)
    if layout == "strided":  # neither: the kernels work on a contiguous copy
        return torch.cat([t, t], dim=-1)[..., : t.shape[-1]]
    raise ValueError(layout)


def is_channels_last(t):
    return ops._is_channels_last_dense(t) and not t.is_contiguous()


def run_fused(x, weight, bias, dy, devices=1, group_size=1, eps=1e-5):
    x = x.detach().clone().requires_grad_()
    weight = None if weight is None else weight.detach().clone().requires_grad_()
    bias = None if bias is None else bias.detach().clone().requires_grad_()
    out = ops.batch_norm_train(x, weight, bias, devices, group_size, eps)
    out.y.backward(dy)
    return {
        "y": out.y.detach(),
        "mean": out.mean,
        "var": out.var,
        "invstd": out.invstd,
        "dx": x.grad,
        "dweight": None if weight is None else weight.grad,
        "dbias": None if bias is None else bias.grad,
    }


def assert_matches(fused, ref, tol, stats_tol=1e-5):
    for name in ("y", "dx", "dweight", "dbias"):
        if ref[name] is None:
            assert fused[name] is None, name
            continue
        torch.testing.assert_close(
            fused[name].double(), ref[name], atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )
    for name in ("mean", "var"):
        torch.testing.assert_close(fused[name].double(), ref[name], atol=stats_tol, rtol=stats_tol)


# --- outputs and gradients -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_matches_float64_reference_fp32(shape, layout):
    x, w, b, dy = make_inputs(shape, torch.float32, layout)
    fused = run_fused(x, w, b, dy, devices=2)
    ref = reference_with_grads(x, w, b, dy, groups=2)
    assert_matches(fused, ref, TOL[torch.float32])
    if layout == "channels_last" and x.dim() > 2:
        assert is_channels_last(fused["y"]) and is_channels_last(fused["dx"])
    else:
        assert fused["y"].is_contiguous() and fused["dx"].is_contiguous()
    assert fused["y"].dtype == torch.float32 and fused["mean"].dtype == torch.float32


@pytest.mark.parametrize(
    "devices,group_size", [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_device_slices_and_groups(devices, group_size, layout):
    """Statistics per slice (group 1), per group of slices, or over all slices (SyncBN)."""
    x, w, b, dy = make_inputs((8, 4, 6, 7), torch.float32, layout, seed=devices + group_size)
    fused = run_fused(x, w, b, dy, devices=devices, group_size=group_size)
    ref = reference_with_grads(x, w, b, dy, groups=devices // group_size)
    assert fused["mean"].shape == (devices // group_size, 4)
    assert_matches(fused, ref, TOL[torch.float32])


@pytest.mark.parametrize("group_size", [1, 2], ids=["bn", "sync"])
@pytest.mark.parametrize(
    "shape,layout",
    [
        ((4, 24, 80, 80), "channels_last"),
        ((4, 24, 64, 64), "channels_last"),
        ((640, 64, 4, 4), "contiguous"),
        ((16, 96, 8, 8), "contiguous"),
    ],
    ids=["channels_last", "channels_last_3mb", "small_planes", "short_planes"],
)
def test_groups_larger_than_the_single_pass_block(shape, layout, group_size):
    """Loop shapes no other test reaches. Groups of more than kBlockBytes (1 MB) run the
    two-pass composite, whose elementwise passes walk each thread's rows in pieces that cross
    slice boundaries, back to front up to 4 MB of input (the forward passes here; the
    backward of channels_last_3mb) and front to back beyond; the backward of NCHW planes
    shorter than a page (short_planes) runs as rows in column blocks of whole channels, the
    last one narrower."""
    x, w, b, dy = make_inputs(shape, torch.float32, layout, seed=group_size)
    fused = run_fused(x, w, b, dy, devices=2, group_size=group_size)
    ref = reference_with_grads(x, w, b, dy, groups=2 // group_size)
    # dweight and dbias sum m = 10240 or 12800 float32 terms per channel here; their rounding
    # error grows like sqrt(m) (measured up to 9e-5), so they get 1e-5 * sqrt(m / 25).
    m = x.numel() // x.shape[1]
    for name in ("dweight", "dbias"):
        tol = 1e-5 * math.sqrt(m / 25)
        torch.testing.assert_close(fused.pop(name).double(), ref.pop(name), atol=tol, rtol=tol)
        fused[name] = ref[name] = None
    assert_matches(fused, ref, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", [(8, 3, 6, 6), (8, 3, 2, 3)], ids=["plane", "rows"])
def test_half_types_accumulate_in_fp32(shape, layout, dtype):
    x, w, b, dy = make_inputs(shape, dtype, layout, seed=3)
    fused = run_fused(x, w, b, dy, devices=2)
    ref = reference_with_grads(x, w, b, dy, groups=2)
    assert fused["y"].dtype == dtype and fused["dx"].dtype == dtype
    assert fused["mean"].dtype == torch.float32 and fused["dweight"].dtype == torch.float32
    # Sums of dy * xhat over 144 values: their bound scales with the count.
    fused["dweight"] = fused["dweight"] / 144
    fused["dbias"] = fused["dbias"] / 144
    ref["dweight"] = ref["dweight"] / 144
    ref["dbias"] = ref["dbias"] / 144
    assert_matches(fused, ref, TOL[dtype])


def test_float64_and_no_affine():
    x, _, _, dy = make_inputs((6, 3, 5, 7), torch.float64, affine=False)
    fused = run_fused(x, None, None, dy, devices=3)
    ref = reference_with_grads(x, None, None, dy, groups=3)
    assert fused["mean"].dtype == torch.float64
    assert_matches(fused, ref, 1e-10, stats_tol=1e-12)


def test_other_strides_run_on_a_contiguous_copy():
    x, w, b, dy = make_inputs((4, 3, 5, 6), torch.float32, "strided")
    assert not x.is_contiguous() and not ops._is_channels_last_dense(x)
    fused = run_fused(x, w, b, dy, devices=2)
    assert fused["y"].is_contiguous()
    assert_matches(fused, reference_with_grads(x, w, b, dy, groups=2), 1e-5)


def test_dy_in_another_layout_than_x():
    x, w, b, dy = make_inputs((4, 6, 5, 5), torch.float32, "channels_last")
    fused = run_fused(x, w, b, dy.contiguous(), devices=2)
    assert_matches(fused, reference_with_grads(x, w, b, dy, groups=2), 1e-5)


def test_large_offset_statistics_are_stable():
    """Welford/Chan: mean 1e4 and std 0.1 in float32 still match float64 to 1e-4 relative."""
    g = torch.Generator().manual_seed(0)
    x = (1e4 + 0.1 * torch.randn(16, 4, 9, 9, generator=g, dtype=torch.float64)).float()
    for layout in ("contiguous", "channels_last"):  # planes and rows loops
        _, mean, m2 = ops.local_stats(to_layout(x, layout), 4)
        x64 = x.double().reshape(4, 4, 4, -1)
        ref_mean = x64.mean(dim=(1, 3))
        ref_m2 = ((x64 - ref_mean[:, None, :, None]) ** 2).sum(dim=(1, 3))
        torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-6, atol=0)
        torch.testing.assert_close(m2.double(), ref_m2, rtol=1e-4, atol=0)
        for group_size in (1, 2, 4):
            out = ops.batch_norm_train(to_layout(x, layout), None, None, 4, group_size, 0.0)
            _, ref_mean, ref_var = reference_batch_norm(x, None, None, 4 // group_size)
            torch.testing.assert_close(out.mean.double(), ref_mean, rtol=1e-6, atol=0)
            torch.testing.assert_close(out.var.double(), ref_var, rtol=1e-4, atol=0)


# --- primitives ----------------------------------------------------------------------------------


def test_empty_input_gives_zero_statistics():
    x = torch.empty(0, 3, 4, 4)
    count, mean, m2 = ops.local_stats(x, 1)
    assert count.tolist() == [0.0] and mean.abs().sum() == 0 and m2.abs().sum() == 0
    y = ops.forward_elemt(x, mean, torch.ones_like(mean))
    assert y.shape == x.shape


class _NoGradient(torch.autograd.Function):
    """Passes its input on and gives it no gradient (None) in the backward."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_y_given_no_gradient_gives_zero_gradients():
    """Gradients of mean, var and invstd are not materialised as zeros (see the last test):
    when a later op hands y no gradient either, the backward still gives zero d(weight),
    d(bias) and dx."""
    x, w, b, _ = make_inputs((8, 3, 5, 5), torch.float64, seed=8)
    xa = x.clone().requires_grad_()
    wa, ba = w.double().requires_grad_(), b.double().requires_grad_()
    y = ops.batch_norm_train(xa, wa, ba, 2, 1, 1e-5).y
    (_NoGradient.apply(y).sum() + xa.sum()).backward()
    assert torch.equal(xa.grad, torch.ones_like(x))  # xa.sum()'s gradient alone
    assert not wa.grad.any() and not ba.grad.any()


# --- errors --------------------------------------------------------------------------------------


def test_bad_arguments_raise_one_clear_line():
    x = torch.randn(6, 3, 4)
    with pytest.raises(RuntimeError, match="not divisible by the number of device slices 4"):
        ops.local_stats(x, 4)
    with pytest.raises(RuntimeError, match="2-D to 5-D"):
        ops.local_stats(torch.randn(6), 1)
    with pytest.raises(RuntimeError, match="mean must have shape"):
        ops.forward_elemt(x, torch.zeros(4), torch.ones(4))
    with pytest.raises(RuntimeError, match="group_size must divide devices"):
        ops.batch_norm_train(x, None, None, 3, 2, 1e-5)
    with pytest.raises(RuntimeError, match="must be >= 1"):
        ops.batch_norm_train(x, None, None, 0, 1, 1e-5)
    with pytest.raises(RuntimeError, match="float32, float64, float16 or bfloat16"):
        ops.local_stats(torch.ones(4, 3, dtype=torch.int64), 1)


# --- torch.library contracts ---------------------------------------------------------------------


def _opcheck_cases() -> dict[str, tuple]:
    """Every op with the arguments opcheck runs it on, by name."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    dy = torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64)
    w = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(3, generator=g, dtype=torch.float64)
    lib = torch.ops.syncbn_lab
    count, mean, m2 = lib.local_stats(x, 2)
    invstd = torch.rsqrt(m2 / count[:, None] + 1e-5)
    sums = lib.backward_reduce(dy, x, mean, invstd, w, b)
    stats32 = tuple(t.float() for t in (mean, m2, invstd))
    return {
        "local_stats": (lib.local_stats.default, (x, 2)),
        "local_stats_channels_last": (lib.local_stats.default, (x_cl.float(), 1)),
        "forward_elemt": (lib.forward_elemt.default, (x, mean, invstd, w, b)),
        "forward_elemt_shared_row": (
            lib.forward_elemt.default,
            (x_cl, mean[0], invstd[0], None, None),
        ),
        "backward_reduce": (lib.backward_reduce.default, (dy, x, mean, invstd, w, b)),
        "backward_elemt": (lib.backward_elemt.default, (dy, x, mean, invstd, w, b, *sums, count)),
        # The composite is differentiable: opcheck also checks its autograd registration.
        "batch_norm_train": (lib.batch_norm_train.default, (grad(x), grad(w), grad(b), 2, 1, 1e-5)),
        "batch_norm_train_groups": (
            lib.batch_norm_train.default,
            (grad(x_cl.float()), None, None, 4, 2, 1e-3),
        ),
        "batch_norm_train_backward": (
            lib.batch_norm_train_backward.default,
            (dy, x, w, b, mean, invstd, True),
        ),
        "update_running_stats": (
            lib.update_running_stats.default,
            (torch.zeros(3), torch.ones(3), *stats32, 0.1, 50, 16.0),
        ),
        "update_running_stats_untracked": (
            lib.update_running_stats.default,
            (None, None, mean, m2, invstd, 0.0, 50, 0.0),
        ),
    }


def grad(t):
    return t.detach().clone().requires_grad_()


OPCHECK_CASES = _opcheck_cases() if _ext.load() else {}


def test_opcheck_covers_every_op():
    checked = {op.name() for op, _ in OPCHECK_CASES.values()}
    defined = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("syncbn_lab::")}
    assert checked == defined


@pytest.mark.parametrize("case", list(OPCHECK_CASES), ids=str)
def test_opcheck(case):
    op, args = OPCHECK_CASES[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("devices,group_size", [(2, 1), (2, 2), (1, 1)])
def test_gradcheck_float64(devices, group_size):
    g = torch.Generator().manual_seed(devices)
    x = torch.randn(4, 3, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(3, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        return ops.batch_norm_train(x, w, b, devices, group_size, 1e-5).y

    assert torch.autograd.gradcheck(f, (x, w, b))


# --- the eager bookkeeping op ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("factor", [0.1, 1.0, 0.7])
def test_update_running_stats_equals_lerp_bitwise(dtype, factor):
    g = torch.Generator().manual_seed(3)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    mean = torch.randn(2, 37, generator=g, dtype=stat_dtype)
    var = torch.rand(2, 37, generator=g, dtype=stat_dtype) + 0.5
    invstd = torch.rsqrt(var + 1e-5)
    running_mean = torch.randn(37, generator=g).to(dtype)
    running_var = torch.rand(37, generator=g).to(dtype)
    # What the traced path (and the reference) does: torch.lerp towards row 0.
    expected_mean = running_mean.lerp(mean[0].to(dtype), factor)
    expected_var = running_var.lerp((var[0] * (10 / 9)).to(dtype), factor)
    assert not ops.update_running_stats(
        running_mean, running_var, mean, var, invstd, factor, 10, 16.0
    )
    assert torch.equal(running_mean, expected_mean)
    assert torch.equal(running_var, expected_var)


def test_update_running_stats_guards_coarse_means():
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(2, 4, generator=g)
    var = torch.rand(2, 4, generator=g) + 0.1
    running_mean, running_var = torch.randn(4, generator=g), torch.rand(4, generator=g)
    # A mean of 1e4 with std 0.1 is too coarse in float32: reported, and nothing moves.
    coarse = mean.clone()
    coarse[1, 2] = 1e4
    before = running_mean.clone()
    invstd = torch.full_like(mean, 10.0)
    assert ops.update_running_stats(running_mean, running_var, coarse, var, invstd, 0.5, 10, 16)
    torch.testing.assert_close(running_mean, before)
    assert not ops.update_running_stats(None, None, coarse, var, invstd, 0.5, 10, 0.0)


def test_backward_makes_no_zero_gradients_for_the_statistics():
    """mean, var and invstd take no gradient: the backward is the one op (plus the gradient
    accumulation), with no zero-filled gradients materialised for them (three fill kernels
    per layer and step on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, 4, 3, 3, requires_grad=True)
    w, b = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    out = ops.batch_norm_train(x, w, b, 2, 1, 1e-5)
    with Recorder() as recorder:
        out.y.backward(torch.randn_like(x))
    assert recorder.ops.count("syncbn_lab.batch_norm_train_backward") == 1
    assert not [op for op in recorder.ops if "zero" in op or "fill" in op], recorder.ops
    assert x.grad is not None and w.grad is not None and b.grad is not None
