"""Run the bn_vs_syncbn sweep (or its smoke version) and write its report.

    python scripts/sweep.py                       # the full sweep: 42 runs + 3 GroupNorm runs
    python scripts/sweep.py --parallel ddp        # the same with real DDP (GPUs or gloo)
    python scripts/sweep.py --smoke               # tiny: synthetic data, few steps, 2 device counts
    python scripts/sweep.py --launcher slurm ...  # one SLURM job per run (submitit)
    python scripts/sweep.py --resume SWEEP_DIR    # finish an interrupted or failed sweep

Two Hydra multiruns share one sweep dir: bn x sync x devices x seeds, then GroupNorm once
per seed (it does not depend on the device count). A run that fails does not stop the
others: it leaves <run dir>/error.json with its one-line reason and the report shows its
cell as missing with that reason. --resume runs the same sweep again in its dir (the
settings recorded in <sweep dir>/sweep.json): runs whose summary.json is complete are
skipped, the rest run afresh. The wall time of all attempts is written to
<sweep dir>/wall_time_s and stated in the report.
"""

from __future__ import annotations

import argparse
import json
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
LAUNCHERS = {"joblib": "hydra/launcher=joblib", "slurm": "hydra/launcher=submitit_slurm"}
RECORD = "sweep.json"  # what --resume reads: the settings the sweep was started with


def merge(defaults: list[str], overrides: list[str]) -> list[str]:
    """``defaults`` with every key that ``overrides`` sets replaced by its value there."""
    given = {o.split("=", 1)[0] for o in overrides}
    return [d for d in defaults if d.split("=", 1)[0] not in given] + overrides


def multirun(sweep_dir: Path, overrides: list[str]) -> int:
    """One Hydra multirun into ``sweep_dir``; its exit status (1: some jobs failed)."""
    command = [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        "-m",
        "experiment=bn_vs_syncbn",
        f"hydra.sweep.dir={sweep_dir}",
        "skip_finished=true",  # a run already finished in this sweep dir is not run again
        *overrides,
    ]
    print("+", " ".join(command[1:]), flush=True)
    return subprocess.run(command, cwd=ROOT).returncode


def settings(args: argparse.Namespace) -> tuple[Path, dict]:
    """The sweep dir and its settings: new ones, or those recorded for --resume."""
    if args.resume is not None:
        record = args.resume / RECORD
        if not record.exists():
            sys.exit(
                f"error: {args.resume} holds no {RECORD}; pass a sweep dir scripts/sweep.py wrote"
            )
        if args.smoke or args.parallel or args.launcher or args.overrides or args.sweep_dir:
            sys.exit(
                "error: --resume runs the sweep with the settings it was started with; pass "
                "no --smoke, --parallel, --launcher, --sweep-dir or overrides with it"
            )
        return args.resume, json.loads(record.read_text())
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    name = "bn_vs_syncbn_smoke" if args.smoke else "bn_vs_syncbn"
    sweep_dir = args.sweep_dir or ROOT / "multirun" / name / stamp
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        sys.exit(
            f"error: {sweep_dir} already holds a sweep; pass a new --sweep-dir, or "
            f"--resume {sweep_dir} to finish it"
        )
    launcher = args.launcher or "joblib"
    if launcher not in LAUNCHERS:
        sys.exit(f"error: --launcher {launcher} is unknown; choose joblib or slurm")
    base = [f"parallel={args.parallel or 'emulated'}", LAUNCHERS[launcher]]
    if launcher == "joblib":
        base.append("hydra.launcher.n_jobs=2")  # one job per core of a 2-core machine
    base = merge([*base, *(SMOKE if args.smoke else [])], args.overrides)
    if not args.smoke and not any(o.startswith(("logger=", "logger.group=")) for o in base):
        base.append(f"logger.group={name}-{stamp}")  # one W&B group per sweep
    gn = ["bn=gn", "parallel.devices=1", "trainer.seed=0" if args.smoke else "trainer.seed=0,1,2"]
    record = {"name": name, "base": base, "gn": merge(base, gn)}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return sweep_dir, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny version for a quick check")
    parser.add_argument("--parallel", default=None, help="emulated (default) or ddp")
    parser.add_argument("--launcher", default=None, help="joblib (default, local) or slurm")
    parser.add_argument("--sweep-dir", type=Path, default=None)
    parser.add_argument("--resume", type=Path, default=None, metavar="SWEEP_DIR")
    parser.add_argument("--report-dir", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    sweep_dir, record = settings(args)
    report_dir = args.report_dir or ROOT / "reports" / record["name"]

    wall_file = sweep_dir / "wall_time_s"
    earlier = float(wall_file.read_text()) if wall_file.exists() else 0.0
    start = time.perf_counter()
    statuses = [multirun(sweep_dir, record["base"]), multirun(sweep_dir, record["gn"])]
    wall = earlier + time.perf_counter() - start
    wall_file.write_text(f"{wall:.1f}\n")
    print(f"sweep finished in {wall / 60:.1f} min -> {sweep_dir}", flush=True)
    report = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "report.py"),
            str(sweep_dir),
            "--out",
            str(report_dir),
            "--wall-time-s",
            f"{wall:.1f}",
        ],
    )
    if any(statuses) or report.returncode:
        sys.exit(
            f"error: some runs failed (listed above; the report marks them missing); "
            f"python scripts/sweep.py --resume {sweep_dir} runs them again"
        )


if __name__ == "__main__":
    main()
