"""Train one configuration: `python scripts/train.py bn=sync parallel=ddp parallel.devices=4`.

Thin on purpose: Hydra composes the config, syncbn_lab.train.run does the job.
`python scripts/train.py --cfg job` prints the composed config.

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) every rank runs this script; only rank 0
gets a Hydra run dir. Ranks > 0 run Hydra in a temporary folder with no outputs and learn
rank 0's run dir over the process group (they write nothing into it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import hydra
from omegaconf import DictConfig

from syncbn_lab.cli import exit_on_user_error, precheck, torchrun_restart_args
from syncbn_lab.logging.console import LOG_FILE, log_terminal
from syncbn_lab.machine import torchrun_env

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from syncbn_lab.errors import say
    from syncbn_lab.parallel.ddp import PeerFailed, RankFailed
    from syncbn_lab.train import run

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # the terminal's lines in train.log, and the traceback of an error that Hydra prints
    # (torchrun ranks > 0 keep no log: their run dir is a throwaway)
    log = nullcontext() if torchrun_follower() else log_terminal(run_dir / LOG_FILE, True)
    with log:
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # a failed job must not stop the others
            from syncbn_lab.multirun import run_job

            summary = run_job(cfg, run_dir, run)
            return summary.get("test_acc") if summary else None
        with exit_on_user_error():
            try:
                summary = run(cfg, run_dir)
            except RankFailed as e:  # the failing rank's traceback once, then one line
                if e.remote_traceback:
                    print(e.remote_traceback.rstrip(), file=sys.stderr)
                say(str(e))
                sys.exit(1)
            except PeerFailed as e:  # torchrun: another rank failed and torchrun reports it
                say(str(e))
                sys.exit(1)
        return summary.get("test_acc") if summary else None


def torchrun_follower() -> bool:
    """This process is a torchrun rank > 0."""
    rank = os.environ.get("RANK")
    return rank is not None and "WORLD_SIZE" in os.environ and int(rank) != 0


def torchrun_follower_args(args: list[str]) -> list[str]:
    """For torchrun ranks > 0: ``args`` with a throwaway Hydra run dir, no .hydra folder and
    no log file (rank 0's run dir is the run's one)."""
    if not torchrun_follower():
        return args
    rank = os.environ["RANK"]
    scratch = tempfile.mkdtemp(prefix=f"syncbn-lab-rank{rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    replaced = {
        "hydra.run.dir": scratch,
        "hydra.output_subdir": "null",
        "hydra/job_logging": "disabled",
        "hydra/hydra_logging": "disabled",
    }
    kept = [a for a in args if a.split("=", 1)[0].lstrip("+~") not in replaced]
    return kept + [f"{key}={value}" for key, value in replaced.items()]


if __name__ == "__main__":
    sys.argv[1:] = torchrun_follower_args(torchrun_restart_args(sys.argv[1:]))
    precheck(CONFIG_DIR, sys.argv[1:])
    if torchrun_env() is None:
        main()
    else:  # a torchrun rank ends without the interpreter's teardown (gloo's threads abort it)
        from syncbn_lab.parallel.ddp import run_torchrun_rank

        run_torchrun_rank(main)
