"""Fused BatchNorm kernels against torch's BatchNorm and the reference (a script, not a test).

CPU (always): forward + backward of one BN layer in training mode, float32, shapes
(64,64,32,32) and (32,256,8,8), NCHW and channels_last, measured side by side in alternating
rounds; the figure is the fastest round (other jobs on a shared machine only ever add time,
so the minimum estimates the uncontended cost; --stat median reports medians instead):
  fused     = syncbn_lab.nn.ops.batch_norm_train + the running-stat update,
  torch_bn  = torch.nn.BatchNorm2d,
  reference = syncbn_lab.nn.functional.batch_norm(impl="reference"), the formulas in plain
              torch ops with a hand-written backward (the specification of the kernels),
  formula   = the same formulas with autograd through plain torch ops (for scale).
Targets: fused <= 1.0x torch_bn, reference >= 3x fused.

GPU (when a GPU and the CUDA kernels are present), timed with CUDA events: fused (the op plus
the running-stat update, as above) and module (syncbn_lab's SyncBatchNorm with impl="fused")
vs cuDNN BatchNorm2d (target <= 1.1x), the effective bandwidth of each kernel (bytes that must
move / time) against a device copy of the same tensor (target >= 80 % on >= 256 MB). Also
the device operations per step and
their summed time against the step's (torch.profiler), with module_noguard: the module with
its precision guard off, the cost of that guard's one host synchronisation per layer, and
module_emulated8: SyncBN over 8 emulated devices (the primitives around the reference's
reduction; its times are in the JSON).

    python scripts/bench_kernels.py [--rounds 21] [--threads N] [--stat min|median]
                                    [--no-cpu] [--no-gpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from syncbn_lab.provenance import write_json

CPU_SHAPES = [(64, 64, 32, 32), (32, 256, 8, 8)]
GPU_SHAPES = [(64, 64, 32, 32), (32, 256, 8, 8), (128, 64, 56, 56)]
BANDWIDTH_SHAPE = (64, 256, 64, 64)  # 256 MiB in float32
EPS = 1e-5
GPU = "cuda"  # the device of the GPU section


def layout_of(x: torch.Tensor, layout: str) -> torch.Tensor:
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    return x.contiguous(memory_format=fmt)


class Layer:
    """One BN layer (params + running stats) behind three implementations."""

    def __init__(self, channels: int, device: str):
        self.torch_bn = torch.nn.BatchNorm2d(channels).to(device)
        self.weight = self.torch_bn.weight
        self.bias = self.torch_bn.bias
        self.running_mean = torch.zeros(channels, device=device)
        self.running_var = torch.ones(channels, device=device)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        from syncbn_lab.nn import ops

        out = ops.batch_norm_train(x, self.weight, self.bias, 1, 1, EPS)
        count = x.numel() // x.shape[1]
        with torch.no_grad():
            self.running_mean.lerp_(out.mean[0], 0.1)
            self.running_var.lerp_(out.var[0] * (count / (count - 1)), 0.1)
        return out.y

    def module(self, devices: int = 1) -> torch.nn.Module:
        """syncbn_lab's SyncBatchNorm on the fused kernels (what `bn=sync` trains with); with
        devices > 1, SyncBN over that many emulated devices (parallel=emulated)."""
        from syncbn_lab.nn import SyncBatchNorm

        return SyncBatchNorm(self.weight.numel(), impl="fused", devices=devices).to(
            self.weight.device
        )

    def torch(self, x: torch.Tensor) -> torch.Tensor:
        return self.torch_bn(x)

    def formula(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0, keepdim=True)
        y = (x - mean) * torch.rsqrt(var + EPS)
        return y * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        from syncbn_lab.nn.functional import batch_norm

        return batch_norm(
            x,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            training=True,
            momentum=0.1,
            eps=EPS,
            impl="reference",
        )


def without_precision_guard(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module with the eager step's precision guard off (for its cost only: on CUDA the
    guard reads max |mean| * invstd back to the host, one synchronisation per layer)."""
    from syncbn_lab.nn import functional

    def run(x: torch.Tensor) -> torch.Tensor:
        saved, functional._FUSED_MEAN_LIMIT = functional._FUSED_MEAN_LIMIT, 0.0
        try:
            return module(x)
        finally:
            functional._FUSED_MEAN_LIMIT = saved

    return run


def fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor):
    def run():
        x.grad = None
        fn(x).backward(dy)

    return run


STAT = {"min": min, "median": statistics.median}
stat = min


def host_timer(run: Callable[[], None], inner: int) -> float:
    """ms per call by the host clock (CPU work)."""
    start = time.perf_counter()
    for _ in range(inner):
        run()
    return (time.perf_counter() - start) * 1e3 / inner


def cuda_timer(run: Callable[[], None], inner: int) -> float:
    """ms per call by CUDA events on the current stream, after the GPU has drained."""
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / inner


def time_side_by_side(
    runs: dict[str, Callable[[], None]],
    rounds: int,
    timer: Callable[[Callable[[], None], int], float] = host_timer,
    inner: int = 1,
) -> dict[str, float]:
    """ms per call of each run (min or median over rounds), interleaved round by round."""
    for run in runs.values():  # warm-up
        timer(run, 2)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            samples[name].append(timer(run, inner))
    return {name: stat(v) for name, v in samples.items()}


def cpu_section(rounds: int, records: list[dict]) -> None:
    threads = torch.get_num_threads()
    print(f"\nCPU, float32, forward+backward, {threads} threads, {stat.__name__} ms per call")
    header = (
        f"{'shape':>18} {'layout':>13} {'torch_bn':>9} {'fused':>8} {'reference':>10} "
        f"{'formula':>8} {'fused/torch':>12} {'ref/fused':>10} {'formula/fused':>14}"
    )
    print(header)
    print("-" * len(header))
    for shape in CPU_SHAPES:
        for layout in ("contiguous", "channels_last"):
            torch.manual_seed(0)
            layer = Layer(shape[1], "cpu")
            x = layout_of(torch.randn(shape), layout).requires_grad_()
            dy = layout_of(torch.randn(shape), layout)
            runs = {
                "torch_bn": fwd_bwd(layer.torch, x, dy),
                "fused": fwd_bwd(layer.fused, x, dy),
                "reference": fwd_bwd(layer.reference, x, dy),
                "formula": fwd_bwd(layer.formula, x, dy),
            }
            ms = time_side_by_side(runs, rounds)
            print(
                f"{str(shape):>18} {layout:>13} {ms['torch_bn']:9.2f} {ms['fused']:8.2f} "
                f"{ms['reference']:10.2f} {ms['formula']:8.2f} "
                f"{ms['fused'] / ms['torch_bn']:11.2f}x {ms['reference'] / ms['fused']:9.2f}x "
                f"{ms['formula'] / ms['fused']:13.2f}x"
            )
            for impl, value in ms.items():
                records.append(
                    {
                        "section": "cpu",
                        "impl": impl,
                        "shape": list(shape),
                        "dtype": "float32",
                        "layout": layout,
                        "fwd_bwd_ms": round(value, 4),
                    }
                )


def gpu_runs(shape, dtype, layout: str) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    layer = Layer(shape[1], GPU)
    x = layout_of(torch.randn(shape, device=GPU, dtype=dtype), layout).requires_grad_()
    dy = layout_of(torch.randn(shape, device=GPU, dtype=dtype), layout)
    return {
        "cudnn_bn": fwd_bwd(layer.torch, x, dy),
        "fused": fwd_bwd(layer.fused, x, dy),
        "module": fwd_bwd(layer.module(), x, dy),
        "module_noguard": fwd_bwd(without_precision_guard(layer.module()), x, dy),
        "module_emulated8": fwd_bwd(layer.module(devices=8), x, dy),
    }


def gpu_case(shape, dtype, layout: str, rounds: int) -> dict[str, float]:
    return time_side_by_side(gpu_runs(shape, dtype, layout), rounds, cuda_timer, inner=5)


def launch_profile(runs: dict[str, Callable[[], None]], steps: int = 20) -> dict[str, tuple]:
    """(device operations per step, their summed µs per step, event-timed µs per step).

    Where the operations' time is far below the step's, the GPU waits for the host to launch
    them: the step is bound by launch overhead, not by the kernels.
    """
    from torch.profiler import ProfilerActivity, profile

    result = {}
    for name, run in runs.items():
        wall_us = 1e3 * cuda_timer(run, steps)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run()
            torch.cuda.synchronize()
        ops_ = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.time_range.elapsed_us() for e in ops_)
        result[name] = (len(ops_) / steps, busy_us / steps, wall_us)
    return result


def bandwidth_case(shape, layout: str, rounds: int) -> dict[str, tuple[float, int]]:
    """ms and bytes that must move, per kernel and for a device copy of the same tensor."""
    from syncbn_lab.nn import ops

    x = layout_of(torch.randn(shape, device=GPU), layout)
    dy = layout_of(torch.randn(shape, device=GPU), layout)
    out = torch.empty_like(x)
    w = torch.ones(shape[1], device=GPU)
    b = torch.zeros(shape[1], device=GPU)
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
    ms = time_side_by_side({k: v[0] for k, v in kernels.items()}, rounds, cuda_timer, inner=5)
    return {k: (ms[k], nbytes) for k, (_, nbytes) in kernels.items()}


def gpu_section(rounds: int, records: list[dict]) -> None:
    name = torch.cuda.get_device_name()
    print(f"\nGPU ({name}), forward+backward, {stat.__name__} ms per call")
    header = (
        f"{'shape':>18} {'dtype':>9} {'layout':>13} {'cudnn_bn':>9} {'fused':>8} "
        f"{'fused/cudnn':>12} {'module':>8} {'module/cudnn':>13}"
    )
    print(header)
    print("-" * len(header))
    for shape in GPU_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for layout in ("contiguous", "channels_last"):
                ms = gpu_case(shape, dtype, layout, rounds)
                print(
                    f"{str(shape):>18} {str(dtype)[6:]:>9} {layout:>13} {ms['cudnn_bn']:9.3f} "
                    f"{ms['fused']:8.3f} {ms['fused'] / ms['cudnn_bn']:11.2f}x "
                    f"{ms['module']:8.3f} {ms['module'] / ms['cudnn_bn']:12.2f}x"
                )
                for impl, value in ms.items():
                    records.append(
                        {
                            "section": "gpu",
                            "impl": impl,
                            "shape": list(shape),
                            "dtype": str(dtype)[6:],
                            "layout": layout,
                            "fwd_bwd_ms": round(value, 4),
                        }
                    )

    print("\nGPU operations per forward+backward step (torch.profiler), float32")
    print(f"{'shape':>18} {'layout':>13} {'impl':>13} {'ops':>5} {'busy us':>8} {'step us':>8}")
    for shape in (GPU_SHAPES[0], GPU_SHAPES[-1]):
        for layout in ("contiguous", "channels_last"):
            try:
                prof = launch_profile(gpu_runs(shape, torch.float32, layout))
            except Exception as error:  # noqa: BLE001 - a profiler problem must not end the run
                print(f"launch profile failed: {type(error).__name__}: {error}")
                break
            for impl, (n_ops, busy, wall) in prof.items():
                row = f"{str(shape):>18} {layout:>13} {impl:>13}"
                print(f"{row} {n_ops:5.0f} {busy:8.1f} {wall:8.1f}")
                records.append(
                    {
                        "section": "gpu_launches",
                        "impl": impl,
                        "shape": list(shape),
                        "dtype": "float32",
                        "layout": layout,
                        "ops_per_step": n_ops,
                        "busy_us": round(busy, 2),
                        "step_us": round(wall, 2),
                    }
                )

    # Effective bandwidth of each kernel against a device-to-device copy of the same tensor.
    shape = BANDWIDTH_SHAPE
    print(f"\nGPU bandwidth, {shape} float32 ({4 * torch.Size(shape).numel() / 2**20:.0f} MiB)")
    for layout in ("contiguous", "channels_last"):
        result = bandwidth_case(shape, layout, rounds)
        copy_ms, copy_bytes = result["copy"]
        copy_gbs = copy_bytes / copy_ms / 1e6
        for kernel, (ms, nbytes) in result.items():
            gbs = nbytes / ms / 1e6
            print(
                f"  {layout:>13} {kernel:>16}: {ms:8.3f} ms {gbs:8.0f} GB/s "
                f"({100 * gbs / copy_gbs:5.1f} % of copy)"
            )
            records.append(
                {
                    "section": "gpu_bandwidth",
                    "impl": kernel,
                    "shape": list(shape),
                    "dtype": "float32",
                    "layout": layout,
                    "ms": round(ms, 4),
                    "gb_per_s": round(gbs, 1),
                    "fraction_of_copy": round(gbs / copy_gbs, 4),
                }
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds per case")
    parser.add_argument("--stat", choices=sorted(STAT), default="min", help="per-case statistic")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU section")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU section")
    parser.add_argument("--json", default=None, help="write the records to this file")
    args = parser.parse_args(argv)
    global stat
    stat = STAT[args.stat]
    if args.threads:
        torch.set_num_threads(args.threads)

    from syncbn_lab.nn import _ext

    if not _ext.available():
        print("syncbn_lab._C is not built: nothing to benchmark (run `make build-ext`)")
        return 1
    records: list[dict] = []
    if not args.no_cpu:
        cpu_section(args.rounds, records)
    gpu = torch.cuda.is_available() and _ext.has_cuda_kernels()
    if gpu and not args.no_gpu:
        gpu_section(args.rounds, records)
    elif not args.no_gpu:
        print("\nGPU section skipped: no GPU or the extension was built without CUDA")
    if args.json:
        write_json(args.json, records, stat=args.stat, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
