"""Forward+backward time of one BatchNorm layer on CPU, and bytes each SyncBN design sends.

Not a test: it prints ratios measured side by side in one run (syncbn_lab.bench: the
implementations are interleaved and the fastest of several rounds is kept, so background load
hits all alike). Every CPU figure of one layer is this script's; scripts/bench_kernels.py
measures the same layer on a GPU.

    python scripts/bench_syncbn.py [--quick] [--json FILE] [--no-dist] [--system-malloc]
                                   [--threads N] [--clock wall|thread]

Allocator: every step allocates fresh outputs of 2-8 MB. With glibc's default tunables its
dynamic mmap threshold makes such blocks come back from the kernel (zeroed page by page) in
some rounds and not in others, depending on the order of earlier allocations, which moved
single rows by up to 2x between runs. The script therefore re-runs itself with the threshold
fixed (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, what jemalloc or tcmalloc users get
anyway), the same for every row; --system-malloc keeps the defaults.

Rows: torch.nn.BatchNorm2d (world size 1), this repository's SyncBatchNorm with
impl="reference" and impl="fused" (the C++ kernels of syncbn_lab._C; skipped when not built)
in one process (world size 1) and on 2 gloo ranks, each rank holding the full shape. At 2
ranks the per-device BatchNorm of each impl (same math, no collective) runs interleaved in the
same job, so the difference between the two is the cost of synchronising, and their
difference from the world-size-1 row is the two processes competing for the CPU. These rows
are the module path (forward + backward through BatchNorm/SyncBatchNorm); in one process two
more rows give scale: fused_op, the bare op (ops.batch_norm_train and the running-statistics
update, without the module's dispatch and precision guard), and formula, the reference's
formulas with autograd through plain torch ops. The byte table is the payload per layer per
training step that each rank hands to its collectives: ours is one all_reduce of 2C+1 float64
values forward and one of 2C float32 values backward, whatever the world size W; torch's
SyncBatchNorm (torch/nn/modules/_functions.py) all_gathers W*(2C+1) float32 values (mean,
invstd, count of every rank) forward and all_reduces 2C float32 values backward.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from syncbn_lab.bench import FusedOp, Timing, fwd_bwd, per_call_ms, write_json
from syncbn_lab.nn import BatchNorm, SyncBatchNorm, ops
from syncbn_lab.parallel.gloo_jobs import run_distributed

SHAPES = [(64, 64, 32, 32), (32, 256, 8, 8)]
LAYOUTS = {"NCHW": torch.contiguous_format, "channels_last": torch.channels_last}
WORLD_SIZES = [2, 4, 8, 16, 32, 64]
TORCH = "torch.nn.BatchNorm2d"
REFERENCE = "reference"
PER_DEVICE = "reference_per_device"  # same math without synchronisation: isolates its cost
FUSED = "fused"
FUSED_PER_DEVICE = "fused_per_device"
FUSED_OP = "fused_op"  # the bare op, no module
FORMULA = "formula"  # the reference's formulas, autograd through plain torch ops
EPS = 1e-5
MAX_STEPS = 200  # per sample of a local row


def formula(bn: torch.nn.BatchNorm2d):
    """Training-mode BatchNorm written in torch ops, differentiated by autograd."""

    def run(x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0, keepdim=True)
        y = (x - mean) * torch.rsqrt(var + EPS)
        return y * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)

    return run


def _layer(impl: str, channels: int):
    if impl == TORCH:
        return torch.nn.BatchNorm2d(channels)
    if impl == FUSED_OP:
        return FusedOp(torch.nn.BatchNorm2d(channels), EPS)
    if impl == FORMULA:
        return formula(torch.nn.BatchNorm2d(channels))
    kind = "fused" if impl.startswith(FUSED) else "reference"
    if impl.endswith("_per_device"):
        return BatchNorm(channels, impl=kind)
    return SyncBatchNorm(channels, impl=kind)


def _fused_impls(*impls: str) -> tuple[str, ...]:
    """The fused rows when the extension is built, none otherwise."""
    return impls if ops.available(warn=False) else ()


def _inputs(shape, layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).contiguous(memory_format=LAYOUTS[layout])
    grad = torch.randn(*shape, generator=g).contiguous(memory_format=LAYOUTS[layout])
    return x.requires_grad_(), grad


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def _record(impl, shape, layout, world_size, ms, clock):
    return {
        "impl": impl,
        "shape": list(shape),
        "dtype": "float32",
        "layout": layout,
        "world_size": world_size,
        "fwd_bwd_ms": round(ms, 3),
        "clock": clock,
    }


def local_records(timing: Timing, steps: int, sample_ms: float, clock: str) -> list[dict]:
    """Every implementation in one process, interleaved, fastest of the rounds."""
    records = []
    for shape in SHAPES:
        for layout in LAYOUTS:
            x, grad = _inputs(shape, layout)
            impls = (TORCH, REFERENCE, *_fused_impls(FUSED, FUSED_OP), FORMULA)
            runs = {impl: fwd_bwd(_layer(impl, shape[1]), x, grad) for impl in impls}
            # Each sample lasts >= sample_ms (small shapes take more steps per sample, so that
            # one slow step moves a sample less), sized by the fastest first call.
            first_ms = min(per_call_ms(run, 2, CLOCKS[clock])() for run in runs.values())
            inner = max(steps, min(MAX_STEPS, math.ceil(sample_ms / first_ms)))
            rounds = timing.measure(
                {impl: per_call_ms(run, inner, CLOCKS[clock]) for impl, run in runs.items()}
            )
            records += [
                _record(impl, shape, layout, 1, ms, clock) for impl, ms in rounds.values().items()
            ]
    return records


def _distributed_worker(rank: int, world_size: int, timing: Timing, steps: int) -> list[dict]:
    import torch.distributed as dist

    records = []
    for shape in SHAPES:
        for layout in LAYOUTS:
            x, grad = _inputs(shape, layout)
            impls = (PER_DEVICE, REFERENCE, *_fused_impls(FUSED_PER_DEVICE, FUSED))
            samplers = {
                impl: per_call_ms(fwd_bwd(_layer(impl, shape[1]), x, grad), steps) for impl in impls
            }
            rounds = timing.measure(samplers, before=dist.barrier)
            records += [
                _record(impl, shape, layout, world_size, ms, "wall")
                for impl, ms in rounds.values().items()
            ]
    return records


def distributed_records(timing: Timing, steps: int, world_size: int = 2) -> list[dict]:
    """Every implementation on ``world_size`` gloo ranks; the slowest rank's time per row."""
    per_rank = run_distributed(
        _distributed_worker, world_size, timing, steps, timeout_s=1800, pg_timeout_s=300
    )
    rows = per_rank[0]
    for other in per_rank[1:]:
        for row, theirs in zip(rows, other, strict=True):
            row["fwd_bwd_ms"] = max(row["fwd_bwd_ms"], theirs["fwd_bwd_ms"])
    return rows


def bytes_per_step(channels: int, world_size: int) -> dict[str, int]:
    """Payload bytes per layer per training step handed to the collectives, per rank."""
    ours = (2 * channels + 1) * 8 + 2 * channels * 4
    torch_sync = world_size * (2 * channels + 1) * 4 + 2 * channels * 4
    return {"ours": ours, "torch": torch_sync}


def print_time_table(records: list[dict]) -> None:
    """One row per record; "vs torch": against torch.nn.BatchNorm2d at world size 1, "vs ref":
    against the reference row of the same shape, layout and world size (per-device rows
    against the per-device reference)."""

    def key(r, impl):
        return (impl, tuple(r["shape"]), r["layout"], r["world_size"])

    ms = {key(r, r["impl"]): r["fwd_bwd_ms"] for r in records}
    print(
        f"{'impl':22} {'shape':18} {'layout':14} {'W':>2} {'fwd+bwd ms':>11} {'vs torch':>9} "
        f"{'vs ref':>7}"
    )
    for r in records:
        torch_ms = ms[(TORCH, tuple(r["shape"]), r["layout"], 1)]
        reference = PER_DEVICE if r["impl"].endswith("_per_device") else REFERENCE
        reference_ms = ms.get(key(r, reference))
        vs_ref = f"{r['fwd_bwd_ms'] / reference_ms:>6.2f}x" if reference_ms else f"{'':>7}"
        shape = "x".join(map(str, r["shape"]))
        print(
            f"{r['impl']:22} {shape:18} {r['layout']:14} {r['world_size']:>2} "
            f"{r['fwd_bwd_ms']:>11.2f} {r['fwd_bwd_ms'] / torch_ms:>8.2f}x {vs_ref}"
        )


def print_bytes_table(channels_list=(64, 256)) -> None:
    print("\nbytes per layer per training step handed to collectives (per rank)")
    header = " ".join(f"{'W=' + str(w):>9}" for w in WORLD_SIZES)
    print(f"{'design':32} {header}")
    for channels in channels_list:
        for key, name in (
            ("ours", "ours: all_reduce fp64 + fp32"),
            ("torch", "torch: all_gather + all_reduce"),
        ):
            cells = " ".join(f"{bytes_per_step(channels, w)[key]:>9}" for w in WORLD_SIZES)
            print(f"{name + f' C={channels}':32} {cells}")
    print(
        "ours = (2C+1)*8 + 2C*4 for every W; torch = W*(2C+1)*4 + 2C*4. On the wire a ring "
        "all_reduce sends ~2*(W-1)/W of its payload per rank, a ring all_gather (W-1)/W."
    )


MALLOC_TUNABLES = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def _fixed_allocator(args: argparse.Namespace) -> None:
    """Re-executes this script with glibc's mmap threshold fixed (see the module docstring)."""
    if args.system_malloc or all(os.environ.get(k) == v for k, v in MALLOC_TUNABLES.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_TUNABLES})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (noisier)")
    parser.add_argument("--json", type=Path, help="write the timing records to this file")
    parser.add_argument("--no-dist", action="store_true", help="skip the 2-rank gloo rows")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--system-malloc", action="store_true", help="keep glibc's default allocator tunables"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or the CPU time of the timing thread (one thread, no gloo rows: "
        "less disturbed by a busy host, blind to waits)",
    )
    args = parser.parse_args()
    if args.clock == "thread" and (args.threads != 1 or not args.no_dist):
        parser.error(
            "--clock thread counts only the calling thread's CPU time: use it with "
            "--threads 1 --no-dist"
        )
    _fixed_allocator(args)
    allocator = "glibc defaults" if args.system_malloc else "glibc, mmap threshold fixed"
    print(f"threads {args.threads}, allocator: {allocator}, clock: {args.clock}")
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    steps, rounds, sample_ms = (3, 3, 0.0) if args.quick else (10, 9, 40.0)
    timing = Timing(rounds=rounds)

    records = local_records(timing, steps, sample_ms, args.clock)
    if not args.no_dist:
        records += distributed_records(timing, steps)
    print_time_table(records)
    print_bytes_table()
    if args.json:
        bytes_table = {c: {w: bytes_per_step(c, w) for w in WORLD_SIZES} for c in (64, 256)}
        write_json(
            args.json,
            records,
            timing,
            steps_per_sample_min=steps,
            sample_ms=sample_ms,
            threads=args.threads,
            clock=args.clock,
            allocator=allocator,
            bytes_per_layer_step=bytes_table,
        )


if __name__ == "__main__":
    main()
