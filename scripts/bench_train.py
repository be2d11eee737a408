"""Training-speed and quality benchmark (a script, not a test).

Part 1 (always): the engine's images/s against a minimal hand-written PyTorch loop on the
same model, data and batch size, measured side by side in one process, alternating rounds;
prints both figures and the ratio (target: >= 0.9).

Part 2 (--full): the default `make train` job (resnet8, MNIST, 1 epoch) as a subprocess;
prints wall time and test accuracy (targets: <= 240 s, >= 99.0 %).

Part 3 (--streaming-stores): what the fused CPU kernels' streaming stores (outputs of 8 MiB
and more, csrc/syncbn_cpu.cpp) do to whole training steps, where the next layer reads the
output at once: resnet20 steps on CIFAR-shaped random batches of 128 and 256 (the first stage's
activations are 8 and 16 MiB), NCHW and channels_last, with the stores on and off
(SYNCBN_LAB_STREAM_MIN_BYTES) alternating in one process; prints the best and the median
step time of each and their ratios (< 1: the stores help).

    python scripts/bench_train.py [--steps 100] [--rounds 3] [--full] [--streaming-stores]
                                  [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def engine_images_per_s(steps: int, overrides: list[str]) -> float:
    from syncbn_lab.config import compose as compose_config
    from syncbn_lab.train import run

    cfg = compose_config(
        [*overrides, "logger=none", f"trainer.max_steps={steps}", f"trainer.log_every={steps}"]
    )
    with tempfile.TemporaryDirectory() as tmp:
        return run(cfg, tmp)["images_per_s"]


def hand_written_images_per_s(steps: int, overrides: list[str]) -> float:
    """The loop a person would write: a DataLoader, forward, loss, backward, step."""
    from syncbn_lab import models
    from syncbn_lab.config import compose as compose_config
    from syncbn_lab.data import build_datasets
    from syncbn_lab.nn.registry import norm_layer

    cfg = compose_config(overrides)
    torch.manual_seed(0)
    splits = build_datasets(cfg.data)
    model = models.build(cfg.model, norm_layer(cfg.bn), splits.num_classes, splits.in_channels)
    opt = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    batch = cfg.trainer.global_batch_size
    loader = torch.utils.data.DataLoader(
        splits.train, batch_size=batch, shuffle=True, drop_last=True
    )
    model.train()
    start = time.perf_counter()
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return steps * batch / (time.perf_counter() - start)


def streaming_store_steps(batch: int, layout: str, rounds: int, steps: int = 4) -> dict:
    """Step times (ms) of resnet20 with SyncBatchNorm(impl="fused"), streaming stores on
    (the threshold in effect: 8 MiB unless SYNCBN_LAB_STREAM_MIN_BYTES says otherwise) and
    off, alternating rounds of ``steps`` steps."""
    from syncbn_lab.models.resnet import CifarResNet
    from syncbn_lab.nn import SyncBatchNorm, ops

    torch.manual_seed(0)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = CifarResNet(20, 10, lambda c: SyncBatchNorm(c, impl="fused")).to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (batch,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(2):
        step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for mode in times:
            with ops.streaming_stores(mode == "on"):
                start = time.perf_counter()
                for _ in range(steps):
                    step()
            times[mode].append((time.perf_counter() - start) / steps * 1e3)
    row = {"batch": batch, "layout": layout}
    for mode, ms in times.items():
        row[f"best_ms_{mode}"] = round(min(ms), 2)
        row[f"median_ms_{mode}"] = round(statistics.median(ms), 2)
    row["best_ratio"] = round(row["best_ms_on"] / row["best_ms_off"], 3)
    row["median_ratio"] = round(row["median_ms_on"] / row["median_ms_off"], 3)
    return row


def print_streaming_store_rows(rows: list[dict]) -> None:
    print("\nresnet20 training step, fused SyncBN, streaming stores on vs off (ms)")
    print(
        f"{'batch':>5} {'layout':14} {'best on/off':>15} {'ratio':>6} {'median on/off':>15} "
        f"{'ratio':>6}"
    )
    for r in rows:
        best = f"{r['best_ms_on']:.1f}/{r['best_ms_off']:.1f}"
        median = f"{r['median_ms_on']:.1f}/{r['median_ms_off']:.1f}"
        print(
            f"{r['batch']:>5} {r['layout']:14} {best:>15} {r['best_ratio']:>6.3f} "
            f"{median:>15} {r['median_ratio']:>6.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="also time the default make train")
    parser.add_argument(
        "--streaming-stores",
        action="store_true",
        help="also time resnet20 steps with the kernels' streaming stores on and off",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both loops")
    args = parser.parse_args()

    engine, hand = [], []
    for _ in range(args.rounds):
        hand.append(hand_written_images_per_s(args.steps, args.overrides))
        engine.append(engine_images_per_s(args.steps, args.overrides))
    result = {
        "engine_images_per_s": statistics.median(engine),
        "hand_written_images_per_s": statistics.median(hand),
        "threads": torch.get_num_threads(),
    }
    result["ratio"] = result["engine_images_per_s"] / result["hand_written_images_per_s"]
    print(f"{'loop':<14}{'images/s (median of ' + str(args.rounds) + ')':>28}")
    print(f"{'hand-written':<14}{result['hand_written_images_per_s']:>28.1f}")
    print(f"{'engine':<14}{result['engine_images_per_s']:>28.1f}")
    print(f"engine / hand-written = {result['ratio']:.3f}  (target >= 0.90)")

    if args.full:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts/train.py"),
                    "logger=none",
                    f"hydra.run.dir={tmp}/run",
                    *args.overrides,
                ],
                check=True,
            )
            wall = time.perf_counter() - start
            summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        result.update(full_wall_time_s=wall, full_test_acc=summary["test_acc"])
        print(
            f"default make train: {wall:.1f} s wall (target <= 240), "
            f"test accuracy {summary['test_acc']:.2f} % (target >= 99.0)"
        )
    if args.streaming_stores:
        from syncbn_lab.nn import ops

        if not ops.available(warn=False):
            sys.exit("--streaming-stores needs the fused kernels: run make build-ext")
        rows = [
            streaming_store_steps(batch, layout, rounds=4 * args.rounds)
            for batch in (128, 256)
            for layout in ("NCHW", "channels_last")
        ]
        result["streaming_stores"] = rows
        print_streaming_store_rows(rows)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
