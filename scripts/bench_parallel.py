"""Benchmark the parallel modes on CPU; prints a table (a script, not a timed test).

1. Emulation overhead: images/s of one process emulating N devices (N = 2, 8, 64) against
   single-device training of the same model at the same global batch (64), bn=bn and
   bn=sync. The target is >= 0.85x at N = 8.
2. Real DDP: the step time of 2 gloo ranks (32 images each, one thread each) against one
   process (64 images, as many threads as the ranks have together).
3. SyncBN's cost under real DDP: step time with bn=sync over bn=bn, 2 gloo ranks.
4. The training loop's per-step exchange under 2 gloo ranks (``Trainer.agree``: one
   all_reduce of 4 numbers that stops every rank at the same step on divergence or a stop
   signal): its time, and its share of the 2-rank DDP step of 2.

Measurements alternate between the configurations being compared (single, emulated, ...,
single, emulated; syncbn_lab.bench); figures are medians over rounds and ratios medians of
per-round ratios, so a machine that gets busier during the run slows both sides of each ratio
alike.

    python scripts/bench_parallel.py            # resnet8 width 16 on 1x28x28 (MNIST-sized)
    python scripts/bench_parallel.py --quick    # fewer steps
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, open_dict

from syncbn_lab import models
from syncbn_lab.bench import Timing, per_call_ms, write_json
from syncbn_lab.config import available_cores, compose, derive, validate
from syncbn_lab.nn.registry import norm_layer
from syncbn_lab.parallel import Runtime, parallelize
from syncbn_lab.shape import RunShape

GLOBAL_BATCH = 64
IMAGE = (1, 28, 28)
CLASSES = 10


def build(cfg: DictConfig, rt: Runtime, our_bn: bool = False):
    """The model for ``cfg``; ``our_bn``: syncbn_lab's BatchNorm even for one device (where
    bn=bn would take torch.nn.BatchNorm2d), to separate emulation from layer cost."""
    torch.manual_seed(0)
    norm = norm_layer(cfg.bn, derive(cfg).device_slices, ours=our_bn)
    model = models.build(cfg.model, norm, CLASSES, IMAGE[0])
    wrapped = parallelize(model, cfg, rt).model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return wrapped, optimizer


def make_step(cfg: DictConfig, rt: Runtime, batch: int, our_bn: bool = False):
    model, optimizer = build(cfg, rt, our_bn)
    g = torch.Generator().manual_seed(rt.rank)
    images = torch.randn(batch, *IMAGE, generator=g)
    labels = torch.randint(0, CLASSES, (batch,), generator=g)

    def step() -> None:
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def config(*overrides: str) -> DictConfig:
    base = [
        "model=resnet8",
        "model.width=16",
        "logger=none",
        f"trainer.global_batch_size={GLOBAL_BATCH}",
    ]
    cfg = compose([*base, *overrides])
    validate(cfg)
    return cfg


# -- 1. emulation overhead ---------------------------------------------------------------------
def emulation_overhead(devices: list[int], timing: Timing, steps: int) -> list[tuple]:
    """Rows (bn, N, per-device batch, img/s of: torch BN on one device, the same syncbn_lab
    layer on one device, N emulated devices; and the median per-round ratios emulated/torch
    and emulated/layer)."""
    rows = []
    for bn in ("bn", "sync"):
        steps_of = {
            "torch": make_step(config("bn=bn"), Runtime(), GLOBAL_BATCH),
            "layer": make_step(config(f"bn={bn}"), Runtime(), GLOBAL_BATCH, our_bn=True),
        }
        for n in devices:
            cfg = config("parallel=emulated", f"parallel.devices={n}", f"bn={bn}")
            steps_of[n] = make_step(cfg, Runtime(slices_per_process=n), GLOBAL_BATCH)
        # interleaved: torch, layer, N=2, N=8, ..., torch, ...
        rounds = timing.measure({key: per_call_ms(step, steps) for key, step in steps_of.items()})
        rate = {key: 1e3 * GLOBAL_BATCH / ms for key, ms in rounds.values().items()}
        for n in devices:
            vs_torch = rounds.ratio("torch", n)
            vs_layer = rounds.ratio("layer", n)
            rows.append(
                (
                    bn,
                    n,
                    GLOBAL_BATCH // n,
                    rate["torch"],
                    rate["layer"],
                    rate[n],
                    vs_torch,
                    vs_layer,
                )
            )
    return rows


# -- 2 and 3. real DDP -----------------------------------------------------------------------
def ddp_worker(rt: Runtime, cfg: DictConfig, shape: RunShape, run_dir: Path) -> dict:
    """Runs in each rank: seconds per step of this rank's per-device batch, after a warm-up."""
    import torch.distributed as dist

    step = per_call_ms(make_step(cfg, rt, shape.per_device_batch_size), cfg.bench.steps)
    step()
    dist.barrier()
    return {"step_s": step() / 1e3}


def ddp_step_ms(bn: str, steps: int) -> float:
    """ms per step of 2-rank gloo DDP (rank 0's), one thread per rank."""
    from syncbn_lab.parallel.ddp import launch_ddp

    cfg = config("parallel=ddp", "parallel.devices=2", f"bn={bn}", "trainer.threads=1")
    with open_dict(cfg):
        cfg.bench = {"steps": steps}
    with tempfile.TemporaryDirectory() as run_dir:
        return 1e3 * launch_ddp(cfg, derive(cfg), ddp_worker, Path(run_dir))["step_s"]


def ddp_against_one_process(timing: Timing, steps: int) -> dict[str, float]:
    """Seconds per step and per-round ratios of one process (64 images) and of 2-rank DDP
    with bn and with sync (32 images per rank); rounds alternate the three. Each DDP job warms
    up in its own ranks, so ``timing`` needs no warm-up; the one process warms up here."""
    one_process = per_call_ms(make_step(config("bn=bn"), Runtime(), GLOBAL_BATCH), steps)
    one_process()
    samplers = {
        "single": one_process,
        "bn": lambda: ddp_step_ms("bn", steps),
        "sync": lambda: ddp_step_ms("sync", steps),
    }
    rounds = timing.measure(samplers)
    result = {key: ms / 1e3 for key, ms in rounds.values().items()}
    result["bn/single"] = rounds.ratio("bn", "single")
    result["sync/single"] = rounds.ratio("sync", "single")
    result["sync/bn"] = rounds.ratio("sync", "bn")
    return result


def exchange_time(rank: int, world_size: int, repeats: int) -> float:
    """Seconds per ``Trainer.agree`` exchange on this rank: an all_reduce of 4 float64 and
    the read of its result."""
    import torch.distributed as dist

    flags = torch.zeros(4, dtype=torch.float64)

    def exchange_once() -> None:
        dist.all_reduce(flags)
        flags.tolist()

    per_call_ms(exchange_once, 200)()  # warm-up
    return per_call_ms(exchange_once, repeats)() / 1e3


def exchange(timing: Timing, repeats: int = 2000) -> float:
    """Rank 0's seconds per exchange, 2 gloo ranks x 1 thread, over ``timing``'s rounds (each
    job warms up in its ranks)."""
    from syncbn_lab.parallel.gloo_jobs import run_distributed

    target = f"{Path(__file__).resolve()}:exchange_time"
    job = {"exchange": lambda: run_distributed(target, 2, repeats)[0]}
    return timing.measure(job).value("exchange")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--json", type=Path, help="write the records to this file")
    args = parser.parse_args()
    steps, rounds = (2, 4) if args.quick else (2, 12)
    timing = Timing(rounds, stat="median")
    ddp_timing = Timing(max(3, rounds // 3), warmup=0, stat="median")
    exchange_timing = Timing(3, warmup=0, stat="median")
    threads = torch.get_num_threads()
    print(
        f"torch {torch.__version__}, {available_cores()} cores, {threads} threads, "
        f"resnet8 width 16, input {IMAGE}, global batch {GLOBAL_BATCH}, "
        f"{rounds} rounds of {steps} steps\n"
    )

    print("1. Emulation overhead: images/s of one process emulating N devices against one device")
    print("   with torch.nn.BatchNorm2d (torch) and with the same syncbn_lab layer (layer)")
    header = ("bn", "N", "per-dev", "torch img/s", "layer img/s", "emul. img/s")
    print(
        "{:>5} {:>4} {:>7} {:>11} {:>11} {:>11} {:>8} {:>8}".format(*header, "vs torch", "vs layer")
    )
    emulation = emulation_overhead([2, 8, 64], timing, steps)
    for bn, n, per_device, torch_rate, layer, emulated, vs_torch, vs_layer in emulation:
        print(
            f"{bn:>5} {n:>4} {per_device:>7} {torch_rate:>11.0f} {layer:>11.0f} {emulated:>11.0f} "
            f"{vs_torch:>8.2f} {vs_layer:>8.2f}"
        )

    print("\n2./3. Real DDP, 2 gloo ranks x 1 thread, 32 images per rank (global 64)")
    ddp = ddp_against_one_process(ddp_timing, steps)
    print(f"{'configuration':<44} {'step ms':>8} {'ratio':>6}")
    one = f"one process, {threads} threads, 64 images, bn"
    print(f"{one:<44} {1e3 * ddp['single']:>8.1f} {1:>6.2f}")
    print(f"{'2-rank gloo DDP, bn':<44} {1e3 * ddp['bn']:>8.1f} {ddp['bn/single']:>6.2f}")
    print(f"{'2-rank gloo DDP, sync':<44} {1e3 * ddp['sync']:>8.1f} {ddp['sync/single']:>6.2f}")
    print(f"\nSyncBN / BN step time under 2-rank DDP: {ddp['sync/bn']:.2f}")

    ddp["exchange"] = exchange(exchange_timing)
    ddp["exchange/bn"] = ddp["exchange"] / ddp["bn"]
    print(
        f"\n4. The loop's per-step exchange, 2 gloo ranks: {1e3 * ddp['exchange']:.2f} ms, "
        f"{100 * ddp['exchange/bn']:.1f} % of the 2-rank DDP bn step"
    )
    if args.json:
        columns = ("bn", "devices", "per_device_batch", "torch_images_per_s")
        columns += ("layer_images_per_s", "emulated_images_per_s", "vs_torch", "vs_layer")
        rows = [dict(zip(columns, row, strict=True)) for row in emulation]
        write_json(
            args.json,
            {"emulation": rows, "ddp": ddp},
            timing,
            steps=steps,
            ddp_timing=ddp_timing.meta(),
            exchange_timing=exchange_timing.meta(),
        )


if __name__ == "__main__":
    main()
