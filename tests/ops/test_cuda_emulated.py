"""The CUDA kernels and their host code, run on the CPU through an emulation of the device
(tests/ops/cuda_emulation/emu.h), against the CPU kernels.

csrc/cuda/syncbn.cu is rewritten as C++ (every ``kernel<<<grid, block, 0, stream>>>(...)``
becomes a call that runs one host thread per CUDA thread) and registered as the
``syncbn_emu`` library. This checks what can go wrong without a GPU at hand: indexing,
launch plans, reductions, the merges, which launch writes which output, the argument checks.
It does not check timing, the memory model or the compiler's floating-point contraction
(the emulation is built with -ffp-contract=off, like the CPU kernels, so the explicit-fma
update_running_stats is compared bitwise). test_cuda_ops.py runs the same ops on a GPU.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from test_fused_ops import to_layout
from torch.utils import cpp_extension

from syncbn_lab.nn import _ext

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
HERE = Path(__file__).resolve().parent / "cuda_emulation"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _ext.available(warn=False), reason="syncbn_lab._C is not built"),
    pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja (to build the emulation)"),
]


def emulated_sources(out: Path) -> list[Path]:
    """syncbn.cu with the launches rewritten, and the composites of syncbn.cpp (the CUDA ops
    fall back to them for empty input) without the library's registrations."""
    cu = (CSRC / "cuda" / "syncbn.cu").read_text()
    cu = re.sub(r"#include <c10/cuda/[^>]*>\n", "", cu)
    cu = cu.replace("#include <cuda_runtime.h>\n", '#include "emu.h"\n')
    cu = cu.replace('#include "../syncbn.h"', f'#include "{CSRC / "syncbn.h"}"')
    launches = cu.count("<<<")
    cu, rewritten = re.subn(
        r"(\w+_kernel(?:<[^;]*?>)?)\s*<<<(.*?)>>>\(", r"emu_launch(\1, \2, ", cu, flags=re.S
    )
    assert launches > 0 and rewritten == launches, (rewritten, launches)
    cu = cu.replace("TORCH_CHECK(x_in.is_cuda(),", "TORCH_CHECK(true,")
    cu = cu.replace("TORCH_LIBRARY_IMPL(syncbn_lab, CUDA, m) {", "TORCH_LIBRARY(syncbn_emu, m) {")
    cu = cu.replace("m.impl(", "m.def(")
    cpp = (CSRC / "syncbn.cpp").read_text()
    cpp = cpp.replace('#include "syncbn.h"', f'#include "{CSRC / "syncbn.h"}"')
    cpp = re.sub(r'extern "C" \{.*?\n\}\n\}\n', "", cpp, flags=re.S)  # PyInit__C
    cpp = cpp[: cpp.index("TORCH_LIBRARY(syncbn_lab, m)")] + "}  // namespace syncbn_lab\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "emu_syncbn.cpp").write_text(cu)
    (out / "emu_composite.cpp").write_text(cpp)
    return [out / "emu_syncbn.cpp", out / "emu_composite.cpp"]


@pytest.fixture(scope="module")
def emu():
    """torch.ops.syncbn_emu; built under build/ (rebuilt only when the sources change)."""
    build = ROOT / "build" / "cuda_emulation"
    sources = emulated_sources(build / "src")
    cpp_extension.load(
        name="syncbn_emu",
        sources=[str(s) for s in sources],
        extra_cflags=["-O1", "-std=c++20", "-g0", f"-I{HERE}", "-ffp-contract=off"],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.syncbn_emu


CPU = torch.ops.syncbn_lab
TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.float16: 2e-2, torch.bfloat16: 5e-2}

# Every launch shape: rows (2-D, channels_last, NCHW with S < 32), planes (S >= 32), one and
# several chunks per channel (the emulation has 2 SMs: 8 blocks wanted), 5-D input; 16-byte
# loads (planes and rows whose length is a multiple of 4 floats) and single values (odd);
# reductions whose threads take groups of load_group() rows or planes, then single ones
# (more than 4 per thread: the emulation's grid covers at most 1024 rows at a time).
SHAPES = {
    "2d_chunks": (512, 3),
    "3d_plane": (4, 6, 33),
    "short_rows": (4, 6, 2, 3),
    "plane_chunks": (64, 2, 32),
    "vec_rows_chunks": (128, 8, 2, 2),
    "4d": (8, 4, 6, 6),
    "5d": (2, 4, 2, 3, 4),
    "grouped_rows": (72, 8, 8, 8),
    "grouped_short_rows": (4608, 2, 2, 2),
    "grouped_planes": (40, 3, 33),
}


def inputs(shape, dtype, layout, seed=0, offset=0.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + offset
    dy = torch.randn(*shape, generator=g, dtype=torch.float64)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    w = (1 + 0.5 * torch.randn(shape[1], generator=g, dtype=torch.float64)).to(stat)
    b = (0.3 * torch.randn(shape[1], generator=g, dtype=torch.float64)).to(stat)
    return to_layout(x.to(dtype), layout), to_layout(dy.to(dtype), layout), w, b


def assert_same(emulated, cpu, tol):
    emulated = emulated if isinstance(emulated, (tuple, list)) else [emulated]
    cpu = cpu if isinstance(cpu, (tuple, list)) else [cpu]
    assert len(emulated) == len(cpu)
    for i, (e, c) in enumerate(zip(emulated, cpu, strict=True)):
        assert e.shape == c.shape and e.dtype == c.dtype, (i, e.shape, c.shape, e.dtype, c.dtype)
        assert e.stride() == c.stride() or e.numel() <= 1, (i, e.stride(), c.stride())
        torch.testing.assert_close(e, c, atol=tol, rtol=tol, msg=f"output {i}")


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_primitives_and_composites_match_the_cpu_kernels(emu, shape, layout, devices):
    x, dy, w, b = inputs(shape, torch.float32, layout)
    tol = TOL[torch.float32]
    count, mean, m2 = CPU.local_stats(x, devices)
    assert_same(emu.local_stats(x, devices), (count, mean, m2), tol)
    invstd = torch.rsqrt(m2 / count[:, None] + 1e-5)
    args = (x, mean, invstd, w, b)
    assert_same(emu.forward_elemt(*args), CPU.forward_elemt(*args), tol)
    sums = CPU.backward_reduce(dy, *args)
    assert_same(emu.backward_reduce(dy, *args), sums, 10 * tol)
    for cnt in (count, count[:1] * devices):  # per-slice counts, one shared count
        full = (dy, x, mean, invstd, w, b, *sums, cnt)
        assert_same(emu.backward_elemt(*full), CPU.backward_elemt(*full), 10 * tol)
    for group in {1, devices}:
        train = (x, w, b, devices, group, 1e-5)
        out = CPU.batch_norm_train(*train)
        assert_same(emu.batch_norm_train(*train), out, tol)
        for input_grad in (True, False):
            back = (dy, x, w, b, out[1], out[3], input_grad)
            assert_same(
                emu.batch_norm_train_backward(*back), CPU.batch_norm_train_backward(*back), 10 * tol
            )


def test_merges_take_several_rounds_of_lane_groups(emu, monkeypatch):
    """One SM (EMU_SMS=1: 8 blocks of 256 threads): 256 outputs of 12 entries need two rounds
    of 16-lane groups in merge_kernel (statistics) and sum_partials_kernel."""
    monkeypatch.setenv("EMU_SMS", "1")
    x, dy, w, b = inputs((4, 128, 3, 4), torch.float32, "contiguous", seed=9)
    count, mean, m2 = CPU.local_stats(x, 2)
    assert_same(emu.local_stats(x, 2), (count, mean, m2), 2e-5)
    invstd = torch.rsqrt(m2 / count[:, None] + 1e-5)
    args = (dy, x, mean, invstd, w, b)
    assert_same(emu.backward_reduce(*args), CPU.backward_reduce(*args), 2e-4)


@pytest.mark.parametrize("shape", [(8, 8, 6, 6), SHAPES["grouped_rows"]], ids=["4d", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_other_dtypes_match_the_cpu_kernels(emu, dtype, layout, shape):
    x, dy, w, b = inputs(shape, dtype, layout, seed=1)  # C = 8: half vectors too
    train = (x, w, b, 2, 1, 1e-5)
    out = CPU.batch_norm_train(*train)
    assert_same(emu.batch_norm_train(*train), out, TOL[dtype])
    back = (dy, x, w, b, out[1], out[3], True)
    assert_same(
        emu.batch_norm_train_backward(*back), CPU.batch_norm_train_backward(*back), TOL[dtype]
    )


@pytest.mark.parametrize("shape", [(8, 4, 6, 6), (16, 8, 2, 2)], ids=["planes", "rows"])
def test_misaligned_input_takes_single_value_loads(emu, shape):
    """x one float past a 16-byte boundary: the reductions and elementwise passes fall back
    to single-value loads (dy stays aligned)."""
    x, dy, w, b = inputs(shape, torch.float32, "contiguous", seed=5)
    storage = torch.empty(x.numel() + 1)
    shifted = storage[1:].view(shape).copy_(x)
    assert shifted.data_ptr() % 16 != 0
    train = (shifted, w, b, 2, 1, 1e-5)
    out = CPU.batch_norm_train(*train)
    assert_same(emu.batch_norm_train(*train), out, 2e-5)
    back = (dy, shifted, w, b, out[1], out[3], True)
    assert_same(emu.batch_norm_train_backward(*back), CPU.batch_norm_train_backward(*back), 2e-4)


def test_large_offset_and_empty_input(emu):
    x, dy, w, b = inputs((4, 6, 2, 3), torch.float32, "contiguous", seed=2, offset=1e4)
    train = (x, w, b, 2, 2, 1e-5)
    assert_same(emu.batch_norm_train(*train), CPU.batch_norm_train(*train), 2e-5)
    for shape, devices in (((0, 3, 4), 1), ((4, 3, 0), 2)):
        x, dy, w, b = inputs(shape, torch.float32, "contiguous")
        train = (x, w, b, devices, 1, 1e-5)
        out = CPU.batch_norm_train(*train)
        assert_same(emu.batch_norm_train(*train), out, 0)
        back = (dy, x, w, b, out[1], out[3], True)
        assert_same(emu.batch_norm_train_backward(*back), CPU.batch_norm_train_backward(*back), 0)


@pytest.mark.parametrize("running_dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("factor", [0.1, 0.5, 1 / 3, 1.0])
def test_update_running_stats_is_bitwise_the_cpu_kernel(emu, running_dtype, factor):
    """One block over more channels than it has threads; the guard tripped by a row other
    than 0, or not, or not asked for (mean_limit 0)."""
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(3, 300, generator=g)
    var = torch.rand(3, 300, generator=g) + 0.5
    invstd = torch.rsqrt(var + 1e-5)
    running = (torch.randn(300, generator=g), torch.rand(300, generator=g) + 0.5)
    running = tuple(t.to(running_dtype) for t in running)
    coarse = mean.clone()
    coarse[2, 299] = 1e4
    for stats_mean, limit in ((mean, 16.0), (coarse, 16.0), (coarse, 0.0)):
        results = []
        for lib in (emu, CPU):
            buffers = [t.clone() for t in running]
            flag = lib.update_running_stats(*buffers, stats_mean, var, invstd, factor, 10, limit)
            results.append((flag, *buffers))
        for e, c in zip(*results, strict=True):
            assert torch.equal(e, c)
        assert bool(results[1][0]) == (stats_mean is coarse and limit > 0)
    flag = emu.update_running_stats(None, None, coarse, var, invstd, 0.1, 10, 16.0)
    assert bool(flag)


def test_bad_arguments_raise_the_cpu_kernels_error(emu):
    x = torch.randn(4, 3, 2)
    cases = [
        lambda lib: lib.batch_norm_train(x, None, None, 3, 2, 1e-5),
        lambda lib: lib.batch_norm_train(x, torch.ones(4), None, 2, 1, 1e-5),
        lambda lib: lib.batch_norm_train_backward(
            x[:, :, 0], x, None, None, torch.zeros(1, 3), torch.ones(1, 3), True
        ),
        lambda lib: lib.update_running_stats(
            torch.zeros(2), torch.zeros(2), *torch.ones(3, 1, 3), 0.1, 5, 16.0
        ),
    ]
    for case in cases:
        messages = []
        for lib in (emu, CPU):
            with pytest.raises(RuntimeError) as err:
                case(lib)
            messages.append(str(err.value).splitlines()[0])
        assert messages[0] == messages[1]
