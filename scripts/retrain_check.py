"""Retrain one finished run of a study's archive with this checkout's code, and say whether it
trains as before: every metrics.jsonl record (the throughput left out) and every number of
summary.json that training decides, to the bit.

What a study needs when its training code changes while it runs (a new ``training_code``): the
proof that the new code trains the study's runs as the old one did. Run it on the kind of CPU
that trained the run: float32 results differ between CPUs, not between codes.

    python scripts/retrain_check.py reports/nbs_capacity/runs.tar.gz 2_bn_emulated128_s0

Where the archived run trained on another kind of CPU, train it with both codes on this one and
compare the two run dirs:

    python scripts/retrain_check.py --compare <run dir of the old code> <run dir of the new>

Exit status 0 when identical, 1 when not (the first differences are listed), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from syncbn_lab import archive
from syncbn_lab.cli import exit_on_user_error
from syncbn_lab.config import CONFIG_DIR
from syncbn_lab.errors import UserError
from syncbn_lab.multirun import finished_summary

# summary.json numbers that training decides (the rest are times, machines and code names)
DECIDED = ("test_", "val_", "best_val_acc", "train_loss", "steps", "epochs")


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the throughput (a matter of the machine's load, not the code)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "images_per_s"} for row in rows]


def decided(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k.startswith(DECIDED)}


def differences(before: Path, after: Path) -> list[str]:
    """What differs between two runs' records and decided summary numbers (empty: none)."""
    found = []
    old, new = records(before), records(after)
    if len(old) != len(new):
        found.append(f"metrics.jsonl: {len(old)} records before, {len(new)} now")
    found += [f"metrics.jsonl step {a.get('step')}: {a} before, {b} now"
              for a, b in zip(old, new, strict=False) if a != b]  # fmt: skip
    a, b = decided(finished_summary(before) or {}), decided(finished_summary(after) or {})
    found += [f"summary.json {k}: {a.get(k)} before, {b.get(k)} now"
              for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]  # fmt: skip
    return found


def retrain(run_dir: Path, out: Path) -> dict:
    """Train ``run_dir``'s config.yaml again into ``out``, without W&B."""
    from syncbn_lab.train import LOADED_CODE, run

    cfg = OmegaConf.load(run_dir / "config.yaml")
    cfg.logger = OmegaConf.load(CONFIG_DIR / "logger" / "none.yaml")
    print(
        f"retraining {run_dir.name} with training code {LOADED_CODE['training_code']}", flush=True
    )
    return run(cfg, out)


def verdict(before: Path, after: Path) -> int:
    """Print whether ``after`` trained as ``before`` did; 0 when identical, 1 when not."""
    found = differences(before, after)
    old, new = finished_summary(before), finished_summary(after)
    codes = f"training code {old.get('training_code')} -> {new.get('training_code')}"
    if found:
        print(f"differs ({codes}): {len(found)} differences; first ones:", flush=True)
        print("\n".join(f"  {line}" for line in found[:5]), flush=True)
        return 1
    print(f"identical ({codes}): {len(records(before))} metrics records and "
          f"{len(decided(old))} summary numbers, to the bit, on {new.get('cpu_model')}",
          flush=True)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archive", type=Path, nargs="?", help="a runs.tar.gz sweep.py packed")
    parser.add_argument("run", nargs="?", help="the run's folder in it, e.g. 2_bn_emulated128_s0")
    parser.add_argument(
        "--compare", nargs=2, type=Path, metavar="RUN_DIR",
        help="compare two finished run dirs instead: the old code's, then the new code's",
    )  # fmt: skip
    args = parser.parse_args(argv)
    with exit_on_user_error():
        if args.compare:
            if args.archive is not None:
                raise UserError("pass --compare RUN_DIR RUN_DIR alone, or an archive and a run")
            for run_dir in args.compare:
                if finished_summary(run_dir) is None:
                    raise UserError(f"{run_dir} is no finished run (no complete summary.json)")
            return verdict(*args.compare)
        if args.archive is None or args.run is None:
            raise UserError("pass a runs.tar.gz and a run's folder name, or --compare A B")
    with tempfile.TemporaryDirectory(prefix="retrain-check-") as tmp, exit_on_user_error():
        if not args.archive.is_file():
            raise UserError(f"{args.archive} is not a file; pass a runs.tar.gz")
        sweep_dir = archive.unpack(args.archive, Path(tmp))
        run_dir = sweep_dir / args.run
        if finished_summary(run_dir) is None:
            names = ", ".join(p.name for p in archive.finished_runs(sweep_dir))
            raise UserError(f"{args.archive} holds no finished run {args.run}; it holds {names}")
        retrain(run_dir, Path(tmp) / "again")
        return verdict(run_dir, Path(tmp) / "again")


if __name__ == "__main__":
    sys.exit(main())
