"""Training-speed and quality benchmark (a script, not a test).

Part 1 (always): the engine's images/s against a minimal hand-written PyTorch loop on the
same model, data and batch size, measured side by side in one process, alternating rounds
(syncbn_lab.bench); prints both medians and the median of the per-round ratios (target:
>= 0.9).

Part 2 (--full): `make train` (resnet8, MNIST, 2 epochs, bf16 + channels_last) as a
subprocess, without W&B; prints wall time and test accuracy (targets: <= 240 s, >= 99.0 %).

    python scripts/bench_train.py [--steps 100] [--rounds 3] [--full] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from syncbn_lab.bench import Timing, per_call_ms, write_json

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
    batches = iter(loader)

    def step() -> None:
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return 1e3 * batch / per_call_ms(step, steps)()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="also time the default make train")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both loops")
    args = parser.parse_args()

    # Each loop is built afresh in every round and times its own steps: no warm-up call.
    timing = Timing(args.rounds, warmup=0, stat="median")
    rounds = timing.measure(
        {
            "hand": lambda: hand_written_images_per_s(args.steps, args.overrides),
            "engine": lambda: engine_images_per_s(args.steps, args.overrides),
        }
    )
    result = {
        "engine_images_per_s": rounds.value("engine"),
        "hand_written_images_per_s": rounds.value("hand"),
        "threads": torch.get_num_threads(),
        "ratio": rounds.ratio("engine", "hand"),
    }
    print(f"{'loop':<14}{'images/s (median of ' + str(args.rounds) + ')':>28}")
    print(f"{'hand-written':<14}{result['hand_written_images_per_s']:>28.1f}")
    print(f"{'engine':<14}{result['engine_images_per_s']:>28.1f}")
    print(f"engine / hand-written = {result['ratio']:.3f}  (target >= 0.90)")

    if args.full:
        with tempfile.TemporaryDirectory() as tmp:
            overrides = ["logger=none", f"hydra.run.dir={tmp}/run", *args.overrides]
            command = ["make", "-s", "train", f"ARGS={' '.join(overrides)}"]
            wall = per_call_ms(lambda: subprocess.run(command, cwd=ROOT, check=True))() / 1e3
            summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        result.update(full_wall_time_s=wall, full_test_acc=summary["test_acc"])
        print(
            f"default make train: {wall:.1f} s wall (target <= 240), "
            f"test accuracy {summary['test_acc']:.2f} % (target >= 99.0)"
        )
    if args.json:
        write_json(args.json, result, timing, steps=args.steps)


if __name__ == "__main__":
    main()
