"""The study's training step under each speed lever, side by side (a benchmark, not a test).

The workload of `experiment=bn_vs_syncbn`: resnet8 on 28x28 one-channel images (synthetic
data of Fashion-MNIST's shapes, so no download), global batch 64, one thread, through
scripts/train.py as a user runs it (data loading included; each run in its own process).
For each norm variant
(bn at 1 and 32 emulated devices; sync, brn and gn at 32) and each lever (fp32 eager NCHW as
today, bf16 autocast, channels_last, torch.compile, and their combinations) it trains
warm-up + measured steps and reads images/s over the measured steps from metrics.jsonl, so a
compile's first steps are not counted (its cost is in the `warmup_s` column). Rounds
alternate the levers (syncbn_lab.bench), so machine noise hits every column alike; a figure
is the median over rounds, a ratio the median of the per-round ratios.

It also prints the share of this machine's float32 and bfloat16 GEMM peak (a 2048x2048
matmul, measured in the same run) that the step reaches, from the FLOPs per image that
torch.utils.flop_counter counts (convolutions and the classifier, forward and backward), and
ceilings: the same step with no normalisation at all (every norm layer an identity,
channels_last, in fp32 and in bf16 autocast, in this process, no data loading), timed in the
same rounds. No work on the norm layers, the optimizer or the data can make a variant's step
in that precision faster than that.

The CPU decides which levers pay: the JSON's meta records its vector ISA and whether oneDNN
computes bf16 natively (machine.cpu_isa, machine.cpu_bf16), and ``{isa}`` in --json is
replaced by the ISA, so each machine's figures go to their own file
(reports/bench_cpu/bench_step_avx512.json, bench_step_avx2.json; ``ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2`` make an AVX-512 machine measure as an AVX2 one).

    python scripts/bench_step.py [--rounds 3] [--steps 60] [--json DIR/bench_step_{isa}.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

from syncbn_lab.bench import Rounds, Timing, per_call_ms, write_json
from syncbn_lab.engine.precision import native_bf16

VARIANTS = {  # name -> overrides
    "bn, 1 device": ["bn=bn", "parallel=single"],
    "bn, 32 devices": ["bn=bn", "parallel=emulated", "parallel.devices=32"],
    "sync, 32 devices": ["bn=sync", "parallel=emulated", "parallel.devices=32"],
    "brn, 32 devices": ["bn=brn", "parallel=emulated", "parallel.devices=32"],
    "gn, 32 devices": ["bn=gn", "parallel=emulated", "parallel.devices=32"],
}
LEVERS = {  # name -> (precision, channels_last, compile)
    "fp32 eager NCHW": ("fp32", False, False),
    "bf16": ("bf16", False, False),
    "channels_last": ("fp32", True, False),
    "compile": ("fp32", False, True),
    "bf16 + channels_last": ("bf16", True, False),
    "bf16 + channels_last + compile": ("bf16", True, True),
}
BASELINE = "fp32 eager NCHW"
ROOT = Path(__file__).resolve().parent.parent
BATCH = 64


def workload(variant: str, lever: str, warmup: int, steps: int) -> list[str]:
    precision, channels_last, compiled = LEVERS[lever]
    return [
        f"trainer.precision={precision}",
        f"trainer.channels_last={str(channels_last).lower()}",
        f"trainer.compile={str(compiled).lower()}",
        *shapes(variant, warmup, steps),
    ]


def shapes(variant: str, warmup: int, steps: int) -> list[str]:
    """The study's step (model, image shape, batch, one thread) for ``variant``."""
    return [
        *VARIANTS[variant],
        "model=resnet8",
        "data=synthetic",
        "data.image_size=28",
        "data.num_classes=10",
        f"data.num_train={BATCH * (warmup + steps)}",
        "data.num_val=64",
        "data.num_test=64",
        f"trainer.global_batch_size={BATCH}",
        "trainer.epochs=1",
        f"trainer.max_steps={warmup + steps}",
        f"trainer.log_every={warmup}",
        "trainer.threads=1",
        "logger=none",
    ]


def measure(variant: str, lever: str, warmup: int, steps: int) -> tuple[float, float]:
    """(images/s over the steps after the warm-up, seconds of the warm-up window), from a run
    of scripts/train.py in its own process: a lever measured after a compiled one would
    otherwise run beside Dynamo's hooks and Inductor's workers."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*workload(variant, lever, warmup, steps), f"hydra.run.dir={tmp}/run"]
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts/train.py"), *overrides],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"{variant}, {lever} failed:\n{done.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "run/metrics.jsonl").open()]
    windows = [r["images_per_s"] for r in records if "val/acc" not in r]
    warm, measured = windows[0], windows[1:]
    seconds = [warmup * BATCH / s for s in measured]
    return len(measured) * warmup * BATCH / sum(seconds), warmup * BATCH / warm


def profile(variant: str, warmup: int, steps: int, out: Path) -> dict:
    """The study's own configuration (experiment=bn_vs_syncbn's levers) of ``variant``,
    profiled over the measured steps (engine/profile.py)."""
    from syncbn_lab.config import compose
    from syncbn_lab.engine.profile import StepProfiler
    from syncbn_lab.train import run

    callback = (
        f"trainer.callbacks=[{{_target_:{StepProfiler.__module__}.StepProfiler,"
        f"start:{warmup},steps:{steps},out:'{out}'}}]"
    )
    study = compose(["experiment=bn_vs_syncbn"]).trainer
    levers = [
        f"trainer.{k}={str(study[k]).lower()}" for k in ("precision", "channels_last", "compile")
    ]
    cfg = compose([*levers, *shapes(variant, warmup, steps), callback])
    with tempfile.TemporaryDirectory() as tmp:
        run(cfg, Path(tmp) / "run")
    return json.loads(out.read_text())


def profile_table(profiles: dict[str, dict]) -> str:
    """Markdown: ms per step by category and by phase, one column per variant."""
    variants = list(profiles)
    categories = list(
        dict.fromkeys(c for p in profiles.values() for c in p["categories_ms_per_step"])
    )
    lines = ["| ms per step | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for c in categories:
        lines.append(
            f"| {c} | "
            + " | ".join(f"{p['categories_ms_per_step'].get(c, 0):.2f}" for p in profiles.values())
            + " |"
        )
    lines.append(
        "| **all operators** | "
        + " | ".join(f"**{p['ms_per_step']:.2f}**" for p in profiles.values())
        + " |"
    )
    for phase in ("data", "forward", "backward", "optimizer"):
        lines.append(
            f"| phase: {phase} | "
            + " | ".join(f"{p['phases_ms_per_step'][phase]:.2f}" for p in profiles.values())
            + " |"
        )
    return "\n".join(lines) + "\n"


def gemm_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a size x size matmul in ``dtype`` (fastest of ``repeats``)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    rounds = Timing(repeats).measure({"mm": per_call_ms(lambda: torch.mm(a, b))})
    return 2 * size**3 / (rounds.value("mm") / 1e3)


def resnet8(norm) -> torch.nn.Module:
    from syncbn_lab import models
    from syncbn_lab.config import compose

    return models.build(compose(["model=resnet8"]).model, norm, 10, 1)


CEILINGS = ("fp32", "bf16")  # the precisions of the no-normalisation ceiling (channels_last)


def ceiling(precision: str, warmup: int, steps: int) -> float:
    """images/s of the workload's step with every norm layer an identity (channels_last, in
    ``precision``: fp32, or bf16 autocast; SGD as the study's; synthetic batches already in
    memory)."""
    model = resnet8(lambda channels: torch.nn.Identity()).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    images = torch.randn(BATCH, 1, 28, 28).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (BATCH,))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    per_call_ms(step, warmup)()
    return 1e3 * BATCH / per_call_ms(step, steps)()


def flops_per_image() -> float:
    """Forward + backward FLOPs of one training image of the workload's model."""
    from torch.utils.flop_counter import FlopCounterMode

    from syncbn_lab.config import compose
    from syncbn_lab.nn.registry import norm_layer

    model = resnet8(norm_layer(compose([]).bn))
    images = torch.randn(BATCH, 1, 28, 28)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(
            model(images), torch.zeros(BATCH, dtype=torch.long)
        ).backward()
    return counter.get_total_flops() / BATCH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20, help="steps not measured (compile)")
    parser.add_argument(
        "--steps", type=int, default=60, help="measured steps (a multiple of --warmup)"
    )
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--levers", nargs="*", default=list(LEVERS), choices=list(LEVERS))
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--profile", type=Path, help="also profile the study's configuration: FILE.json and FILE.md"
    )
    args = parser.parse_args()
    if args.steps % args.warmup:
        parser.error("--steps must be a multiple of --warmup (the logging window)")
    levers = [BASELINE] + [lever for lever in args.levers if lever != BASELINE]
    torch.set_num_threads(1)

    # a CPU that emulates bf16 (no bf16 instructions) runs a 2048^3 bf16 matmul for a minute
    bf16_size = 2048 if native_bf16(torch.device("cpu")) else 512
    peaks = {"fp32": gemm_peak(torch.float32), "bf16": gemm_peak(torch.bfloat16, bf16_size)}
    flops = flops_per_image()
    print(
        f"GEMM peak at 1 thread: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 "
        f"{peaks['bf16'] / 1e9:.0f} GFLOP/s; the step: {flops / 1e6:.1f} MFLOP per image"
    )
    # Samplers of images/s: the ceilings in this process, each (variant, lever) as a run of
    # scripts/train.py, whose warm-up window's seconds go to `warmups`. Each run warms up in
    # its own steps, so the rounds need no warm-up call.
    warmups: dict[tuple[str, str], list[float]] = {}

    def run_of(variant: str, lever: str):
        def sample() -> float:
            rate, warm = measure(variant, lever, args.warmup, args.steps)
            warmups.setdefault((variant, lever), []).append(warm)
            return rate

        return sample

    samplers = {("ceiling", p): partial(ceiling, p, args.warmup, args.steps) for p in CEILINGS} | {
        (v, lever): run_of(v, lever) for v in args.variants for lever in levers
    }

    def progress(round_: int, key: tuple[str, str], rate: float) -> None:
        what = f"no normalisation, {key[1]} + channels_last (the ceiling)"
        what = what if key[0] == "ceiling" else f"{key[0]:<17} {key[1]:<31}"
        print(f"  round {round_ + 1}: {what} {rate:7.0f} images/s", flush=True)

    timing = Timing(args.rounds, warmup=0, stat="median")
    rounds = timing.measure(samplers, on_sample=progress)
    warm_s = Rounds(warmups, "median")

    records = []
    columns = ("images/s", "x today", "fp32 peak", "bf16 peak", "warmup_s")
    print(f"{'variant':<17} {'lever':<31} " + " ".join(f"{c:>9}" for c in columns))
    tops = {p: rounds.value(("ceiling", p)) for p in CEILINGS}
    for variant in args.variants:
        ceiling_ratios = {p: rounds.ratio(("ceiling", p), (variant, BASELINE)) for p in CEILINGS}
        for precision, top in tops.items():
            print(
                f"{variant:<17} {f'ceiling: no norm, {precision} + CL':<31} {top:9.0f} "
                f"{ceiling_ratios[precision]:7.2f}x {top * flops / peaks['fp32']:9.0%} "
                f"{top * flops / peaks['bf16']:9.0%}"
            )
        for lever in levers:
            rate = rounds.value((variant, lever))
            achieved = rate * flops
            record = {
                "variant": variant,
                "lever": lever,
                "precision": LEVERS[lever][0],
                "channels_last": LEVERS[lever][1],
                "compile": LEVERS[lever][2],
                "images_per_s": rate,
                "images_per_s_rounds": rounds.samples[variant, lever],
                "ratio_to_today": rounds.ratio((variant, lever), (variant, BASELINE)),
                "share_of_fp32_peak": achieved / peaks["fp32"],
                "share_of_bf16_peak": achieved / peaks["bf16"],
                "warmup_s": warm_s.value((variant, lever)),
                **{f"ceiling_{p}_ratio_to_today": r for p, r in ceiling_ratios.items()},
            }
            records.append(record)
            print(
                f"{variant:<17} {lever:<31} {rate:9.0f} {record['ratio_to_today']:7.2f}x "
                f"{record['share_of_fp32_peak']:9.0%} {record['share_of_bf16_peak']:9.0%} "
                f"{record['warmup_s']:9.1f}"
            )
    if args.profile:
        profiles = {}
        for variant in args.variants:
            out = args.profile.with_name(
                f"{args.profile.stem}.{variant.split(',')[0]}{variant.split()[-2]}.json"
            )
            profiles[variant] = profile(variant, args.warmup, args.steps, out)
            out.unlink()
        table = profile_table(profiles)
        print(table)
        write_json(args.profile.with_suffix(".json"), profiles, None, threads=1, batch=BATCH)
        args.profile.with_suffix(".md").write_text(table)
    if args.json:
        isa = torch.backends.cpu.get_cpu_capability().lower()
        write_json(
            str(args.json).replace("{isa}", isa),
            records,
            timing,
            gemm_peak_flops={k: v for k, v in peaks.items()},
            ceiling_images_per_s=tops,  # no normalisation, channels_last: by precision
            ceiling_images_per_s_rounds={p: rounds.samples["ceiling", p] for p in CEILINGS},
            flops_per_image=flops,
            threads=1,
            batch=BATCH,
            warmup_steps=args.warmup,
            measured_steps=args.steps,
        )


if __name__ == "__main__":
    main()
