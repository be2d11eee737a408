"""Train the fast configuration's check: a subset of the study in fp32 eager and fast, by seed.

Runs every cell of ``syncbn_lab.report.fast.CELLS`` for each seed in both arms through
scripts/train.py (``experiment=bn_vs_syncbn``; the fp32 arm adds FP32_OVERRIDES), the two
arms of one cell and seed side by side (one job per core), then writes
reports/fast_vs_fp32/README.md and results.csv. A run dir that already holds summary.json is
kept (rerun the same command with --out to finish an interrupted check).

    python scripts/check_fast.py [--seeds 0 1 2] [--out DIR] [--report reports/fast_vs_fp32]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from syncbn_lab.config import compose
from syncbn_lab.provenance import provenance
from syncbn_lab.report.fast import (
    ARMS,
    CELLS,
    FP32_OVERRIDES,
    describe_levers,
    render,
    study_noise_floor,
)

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("arm", "bn", "devices", "per_device_batch_size", "seed", "test_acc",
           "test_acc_precise_bn", "train_loss", "train_time_s", "wall_time_s", "images_per_s",
           "git_commit")  # fmt: skip


def train(run_dir: Path, bn: str, devices: int, seed: int, arm: str, extra: list[str]) -> dict:
    summary = run_dir / "summary.json"
    if not summary.exists():
        overrides = [
            "experiment=bn_vs_syncbn", f"bn={bn}", f"parallel.devices={devices}",
            f"trainer.seed={seed}", "logger=none", f"hydra.run.dir={run_dir}",
            *(FP32_OVERRIDES if arm == "fp32" else ()), *extra,
        ]  # fmt: skip
        with open(run_dir.parent / f"{run_dir.name}.out", "w") as log:
            subprocess.run(
                [sys.executable, str(ROOT / "scripts/train.py"), *overrides],
                check=True, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
    result = json.loads(summary.read_text())
    error, wall = 100 - result["test_acc"], result["wall_time_s"]
    print(
        f"  {arm:<4} bn={bn} devices={devices} seed={seed}: test error {error:.2f} %, {wall:.0f} s"
    )
    return {**result, "arm": arm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "multirun/fast_vs_fp32" / time.strftime("%Y-%m-%d_%H-%M-%S"),
    )
    parser.add_argument("--report", type=Path, default=ROOT / "reports/fast_vs_fp32")
    parser.add_argument(
        "--study",
        type=Path,
        default=ROOT / "reports/bn_vs_syncbn_1epoch/results.csv",
        help="the committed study whose SyncBN runs give the noise floor",
    )
    parser.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides for every run (smoke tests)"
    )
    args = parser.parse_args()  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    cells = [
        (args.out / f"{bn}{devices}_s{seed}_{arm}", bn, devices, seed, arm)
        for bn, devices in CELLS for seed in args.seeds for arm in ARMS
    ]  # fmt: skip
    jobs = max(1, min(2, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        runs = list(pool.map(lambda job: train(*job, args.overrides), cells))

    args.report.mkdir(parents=True, exist_ok=True)
    with (args.report / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(runs)
    info = provenance()
    machine = info["machine"]
    meta = {
        "command": "python scripts/check_fast.py "
        + shlex.join(sys.argv[1:]).replace(str(ROOT) + "/", ""),
        "commit": ", ".join(sorted({str(r.get("git_commit"))[:7] for r in runs})),
        "machine": f"{machine['cpu']} ({machine['cores']} cores), one thread per run",
        "wall": f"{sum(r['wall_time_s'] for r in runs) / 60:.1f} min of run time in all, "
        f"{jobs} at a time",
    }
    levers = describe_levers(compose(["experiment=bn_vs_syncbn"]).trainer)
    (args.report / "README.md").write_text(
        render(runs, study_noise_floor(args.study), levers, meta)
    )
    print(f"wrote {args.report}/README.md")


if __name__ == "__main__":
    main()
