"""Run the bn_vs_syncbn sweep (or its smoke version) and write its report.

    python scripts/sweep.py                       # the full sweep: 42 runs + 3 GroupNorm runs
    python scripts/sweep.py --parallel ddp        # the same with real DDP (GPUs or gloo)
    python scripts/sweep.py --smoke               # tiny: synthetic data, few steps, 2 device counts

Two Hydra multiruns share one sweep dir: bn x sync x devices x seeds, then GroupNorm once
per seed (it does not depend on the device count). The wall time of both is written to
<sweep dir>/wall_time_s and stated in the report.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOKE = [
    "data=synthetic",
    "data.num_train=512",
    "data.num_val=64",
    "data.num_test=64",
    "model.width=4",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.precise_bn_batches=2",
    "parallel.devices=1,4",
    "trainer.seed=0",
    "logger=none",
]


def multirun(sweep_dir: Path, overrides: list[str]) -> None:
    command = [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        "-m",
        "experiment=bn_vs_syncbn",
        f"hydra.sweep.dir={sweep_dir}",
        *overrides,
    ]
    print("+", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny version for a quick check")
    parser.add_argument("--parallel", default="emulated", help="emulated (default) or ddp")
    parser.add_argument("--sweep-dir", type=Path, default=None)
    parser.add_argument("--report-dir", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()

    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    name = "bn_vs_syncbn_smoke" if args.smoke else "bn_vs_syncbn"
    sweep_dir = args.sweep_dir or ROOT / "multirun" / name / stamp
    report_dir = args.report_dir or ROOT / "reports" / name
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        sys.exit(f"error: {sweep_dir} already holds a sweep; pass a new --sweep-dir")
    base = [f"parallel={args.parallel}", *(SMOKE if args.smoke else []), *args.overrides]
    if not args.smoke and not any(o.startswith(("logger=", "logger.group=")) for o in base):
        base.append(f"logger.group={name}-{stamp}")  # one W&B group per sweep
    gn_seeds = "trainer.seed=0" if args.smoke else "trainer.seed=0,1,2"

    start = time.perf_counter()
    multirun(sweep_dir, base)
    multirun(sweep_dir, [*base, "bn=gn", "parallel.devices=1", gn_seeds])
    wall = time.perf_counter() - start
    (sweep_dir / "wall_time_s").write_text(f"{wall:.1f}\n")
    print(f"sweep finished in {wall / 60:.1f} min -> {sweep_dir}", flush=True)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "report.py"),
            str(sweep_dir),
            "--out",
            str(report_dir),
            "--wall-time-s",
            f"{wall:.1f}",
        ],
        check=True,
    )


if __name__ == "__main__":
    main()
