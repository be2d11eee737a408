"""Fused BatchNorm kernels on a GPU against cuDNN's BatchNorm (a script, not a test).

Forward + backward of one BN layer in training mode, timed with CUDA events, interleaved
rounds of 5 steps (syncbn_lab.bench); the figure is the fastest round (--stat median: the
median), shapes (64,64,32,32), (32,256,8,8) and (128,64,56,56) in float32 and bfloat16, NCHW
and channels_last:
  cudnn_bn         = torch.nn.BatchNorm2d,
  fused            = syncbn_lab.nn.ops.batch_norm_train + the running-stat update (the op),
  module           = syncbn_lab's SyncBatchNorm with impl="fused" (what `bn=sync` trains with),
  module_noguard   = the module with its precision guard off: the cost of that guard's one
                     host synchronisation per layer,
  module_emulated8 = SyncBN over 8 emulated devices (parallel=emulated).
Targets: fused and module <= 1.1x cudnn_bn. Also the device operations per step and their
summed time against the step's (torch.profiler), and the effective bandwidth of each kernel
(bytes that must move / time) against a device copy of the same tensor (target >= 80 % on
256 MiB).

The same layer on the CPU (torch's BatchNorm2d, the op, the module, the reference) is
scripts/bench_syncbn.py's. --dry-run runs every path of this script on the CPU at tiny sizes,
one thread, one round: a check of the code that tests/bench runs, not a measurement.

    python scripts/bench_kernels.py [--rounds 21] [--stat min|median] [--json FILE] [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from syncbn_lab.bench import (
    STATS,
    FusedOp,
    Rounds,
    Sampler,
    Timing,
    cuda_per_call_ms,
    fwd_bwd,
    per_call_ms,
    write_json,
)

Shape = tuple[int, int, int, int]
EPS = 1e-5
DTYPES = (torch.float32, torch.bfloat16)
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


@dataclass(frozen=True)
class Sizes:
    """The shapes of one run and the calls per sample."""

    shapes: tuple[Shape, ...]
    bandwidth_shape: Shape
    inner: int  # calls per timed sample
    profile_steps: int


GPU_SIZES = Sizes(
    shapes=((64, 64, 32, 32), (32, 256, 8, 8), (128, 64, 56, 56)),
    bandwidth_shape=(64, 256, 64, 64),  # 256 MiB in float32
    inner=5,
    profile_steps=20,
)
DRY_RUN_SIZES = Sizes(
    shapes=((8, 4, 4, 4), (16, 8, 2, 2)), bandwidth_shape=(8, 4, 4, 4), inner=1, profile_steps=1
)


@dataclass(frozen=True)
class Bench:
    """Where and how this run measures."""

    device: torch.device
    sizes: Sizes
    timing: Timing

    def sampler(self, run: Callable[[], object], inner: int | None = None) -> Sampler:
        """ms per call of ``run``: CUDA events on a GPU, the host clock on the CPU."""
        inner = inner or self.sizes.inner
        if self.device.type == "cuda":
            return cuda_per_call_ms(run, inner)
        return per_call_ms(run, inner)

    def measure(self, runs: dict[str, Callable[[], object]]) -> Rounds[str]:
        """Every run timed side by side (syncbn_lab.bench)."""
        return self.timing.measure({name: self.sampler(run) for name, run in runs.items()})

    def randn(self, shape: Shape, dtype: torch.dtype = torch.float32, layout: str = "contiguous"):
        x = torch.randn(shape, device=self.device, dtype=dtype)
        return x.contiguous(memory_format=LAYOUTS[layout])


def module(channels: int, device: torch.device, device_slices: int = 1) -> torch.nn.Module:
    """syncbn_lab's SyncBatchNorm on the fused kernels; with device_slices > 1, SyncBN over
    that many emulated devices."""
    from syncbn_lab.nn import SyncBatchNorm

    return SyncBatchNorm(channels, impl="fused", device_slices=device_slices).to(device)


def without_precision_guard(layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module with the eager step's precision guard off (for its cost only: on CUDA the
    guard reads max |mean| * invstd back to the host, one synchronisation per layer)."""
    from syncbn_lab.nn import functional

    def run(x: torch.Tensor) -> torch.Tensor:
        saved, functional._FUSED_MEAN_LIMIT = functional._FUSED_MEAN_LIMIT, 0.0
        try:
            return layer(x)
        finally:
            functional._FUSED_MEAN_LIMIT = saved

    return run


def layer_runs(
    bench: Bench, shape: Shape, dtype: torch.dtype, layout: str
) -> dict[str, Callable[[], None]]:
    """One training step of each implementation, on the same input and gradient."""
    torch.manual_seed(0)
    torch_bn = torch.nn.BatchNorm2d(shape[1]).to(bench.device)
    x = bench.randn(shape, dtype, layout).requires_grad_()
    dy = bench.randn(shape, dtype, layout)
    channels = shape[1]
    return {
        "cudnn_bn": fwd_bwd(torch_bn, x, dy),
        "fused": fwd_bwd(FusedOp(torch_bn, EPS), x, dy),
        "module": fwd_bwd(module(channels, bench.device), x, dy),
        "module_noguard": fwd_bwd(without_precision_guard(module(channels, bench.device)), x, dy),
        "module_emulated8": fwd_bwd(module(channels, bench.device, device_slices=8), x, dy),
    }


def launch_profile(bench: Bench, runs: dict[str, Callable[[], None]]) -> dict[str, tuple]:
    """(device operations per step, their summed µs per step, timed µs per step).

    Where the operations' time is far below the step's, the GPU waits for the host to launch
    them: the step is bound by launch overhead, not by the kernels. (On the CPU of a dry run
    the operations are the host's operators.)
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = bench.device.type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    steps = bench.sizes.profile_steps
    result = {}
    for name, run in runs.items():
        wall_us = 1e3 * bench.sampler(run, steps)()
        with profile(activities=[activity]) as prof:
            for _ in range(steps):
                run()
            if cuda:
                torch.cuda.synchronize()
        device_ops = [e for e in prof.events() if e.device_type == kind]
        busy_us = sum(e.time_range.elapsed_us() for e in device_ops)
        result[name] = (len(device_ops) / steps, busy_us / steps, wall_us)
    return result


def bandwidth_case(bench: Bench, layout: str) -> dict[str, tuple[float, int]]:
    """ms and bytes that must move, per kernel and for a device copy of the same tensor."""
    from syncbn_lab.nn import ops

    shape = bench.sizes.bandwidth_shape
    x = bench.randn(shape, layout=layout)
    dy = bench.randn(shape, layout=layout)
    out = torch.empty_like(x)
    w = torch.ones(shape[1], device=bench.device)
    b = torch.zeros(shape[1], device=bench.device)
    count, mean, m2 = ops.local_stats(x, 1)
    invstd = torch.rsqrt(m2 / count[:, None] + EPS)
    sums = ops.backward_reduce(dy, x, mean, invstd, w, b)
    size = x.numel() * x.element_size()
    kernels = {
        "copy": (lambda: out.copy_(x), 2 * size),
        "local_stats": (lambda: ops.local_stats(x, 1), size),
        "forward_elemt": (lambda: ops.forward_elemt(x, mean, invstd, w, b), 2 * size),
        "backward_reduce": (lambda: ops.backward_reduce(dy, x, mean, invstd, w, b), 2 * size),
        "backward_elemt": (
            lambda: ops.backward_elemt(dy, x, mean, invstd, w, b, *sums, count),
            3 * size,
        ),
    }
    ms = bench.measure({k: run for k, (run, _) in kernels.items()}).values()
    return {k: (ms[k], nbytes) for k, (_, nbytes) in kernels.items()}


def record(section: str, impl: str, shape: Shape, dtype: str, layout: str, **figures) -> dict:
    """One JSON record: what was measured, and its figures."""
    what = {"section": section, "impl": impl, "shape": list(shape), "dtype": dtype}
    return {**what, "layout": layout, **figures}


def step_section(bench: Bench, records: list[dict]) -> None:
    """Forward + backward of every implementation against cuDNN, side by side."""
    header = (
        f"{'shape':>18} {'dtype':>9} {'layout':>13} {'cudnn_bn':>9} {'fused':>8} "
        f"{'fused/cudnn':>12} {'module':>8} {'module/cudnn':>13}"
    )
    print(header)
    print("-" * len(header))
    for shape in bench.sizes.shapes:
        for dtype in DTYPES:
            for layout in LAYOUTS:
                rounds = bench.measure(layer_runs(bench, shape, dtype, layout))
                ms = rounds.values()
                print(
                    f"{str(shape):>18} {str(dtype)[6:]:>9} {layout:>13} {ms['cudnn_bn']:9.3f} "
                    f"{ms['fused']:8.3f} {rounds.ratio('fused', 'cudnn_bn'):11.2f}x "
                    f"{ms['module']:8.3f} {rounds.ratio('module', 'cudnn_bn'):12.2f}x"
                )
                records += [
                    record("gpu", impl, shape, str(dtype)[6:], layout, fwd_bwd_ms=round(value, 4))
                    for impl, value in ms.items()
                ]


def launch_section(bench: Bench, records: list[dict]) -> None:
    """Device operations per step of each implementation (torch.profiler), float32."""
    print(f"{'shape':>18} {'layout':>13} {'impl':>16} {'ops':>5} {'busy us':>8} {'step us':>8}")
    for shape in (bench.sizes.shapes[0], bench.sizes.shapes[-1]):
        for layout in LAYOUTS:
            try:
                prof = launch_profile(bench, layer_runs(bench, shape, torch.float32, layout))
            except Exception as error:  # noqa: BLE001 - a profiler problem must not end the run
                print(f"launch profile failed: {type(error).__name__}: {error}")
                return
            for impl, (n_ops, busy, wall) in prof.items():
                print(
                    f"{str(shape):>18} {layout:>13} {impl:>16} {n_ops:5.0f} {busy:8.1f} {wall:8.1f}"
                )
                figures = {
                    "ops_per_step": n_ops,
                    "busy_us": round(busy, 2),
                    "step_us": round(wall, 2),
                }
                records.append(record("gpu_launches", impl, shape, "float32", layout, **figures))


def bandwidth_section(bench: Bench, records: list[dict]) -> None:
    """Effective bandwidth of each kernel against a device-to-device copy of the same tensor."""
    shape = bench.sizes.bandwidth_shape
    for layout in LAYOUTS:
        result = bandwidth_case(bench, layout)
        copy_ms, copy_bytes = result["copy"]
        copy_gbs = copy_bytes / copy_ms / 1e6
        for kernel, (ms, nbytes) in result.items():
            gbs = nbytes / ms / 1e6
            print(
                f"  {layout:>13} {kernel:>16}: {ms:8.3f} ms {gbs:8.0f} GB/s "
                f"({100 * gbs / copy_gbs:5.1f} % of copy)"
            )
            figures = {"ms": round(ms, 4), "gb_per_s": round(gbs, 1)}
            figures["fraction_of_copy"] = round(gbs / copy_gbs, 4)
            records.append(record("gpu_bandwidth", kernel, shape, "float32", layout, **figures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds per case")
    parser.add_argument("--stat", choices=STATS, default="min", help="per-case statistic")
    parser.add_argument("--json", default=None, help="write the records to this file")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="every path on the CPU, tiny sizes, one round (a check of the code, no figure)",
    )
    args = parser.parse_args(argv)

    from syncbn_lab.nn import _ext

    if not _ext.available():
        print("syncbn_lab._C is not built: nothing to benchmark (run `make build-ext`)")
        return 1
    if args.dry_run:  # one thread: tiny tensors gain nothing from more, on a busy host they lose
        torch.set_num_threads(1)
        bench = Bench(torch.device("cpu"), DRY_RUN_SIZES, Timing(rounds=1, stat=args.stat))
        name = "CPU, dry run"
    elif torch.cuda.is_available() and _ext.has_cuda_kernels():
        bench = Bench(torch.device("cuda"), GPU_SIZES, Timing(rounds=args.rounds, stat=args.stat))
        name = torch.cuda.get_device_name()
    else:
        print(
            "no CUDA GPU, or syncbn_lab._C has no CUDA kernels: nothing to measure (the CPU "
            "figures are scripts/bench_syncbn.py's; --dry-run checks this script on the CPU)"
        )
        return 1

    records: list[dict] = []
    print(f"\n{name}, forward+backward, {args.stat} ms per call")
    step_section(bench, records)
    print("\nDevice operations per forward+backward step (torch.profiler), float32")
    launch_section(bench, records)
    shape = bench.sizes.bandwidth_shape
    print(f"\nBandwidth, {shape} float32 ({4 * torch.Size(shape).numel() / 2**20:g} MiB)")
    bandwidth_section(bench, records)
    if args.json:
        write_json(
            args.json, records, bench.timing, inner=bench.sizes.inner, device=str(bench.device)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
