"""Command-line helpers: user errors become one line and a non-zero exit, not a traceback."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

from syncbn_lab.errors import OneLineError, one_line, say

# Hydra flags after which the remaining arguments are not a plain single run.
_NOT_A_PLAIN_RUN = {"--multirun", "-m", "--cfg", "-c", "--help", "-h", "--hydra-help", "--info"}


@contextlib.contextmanager
def exit_on_user_error():
    try:
        yield
    except OneLineError as e:
        say(one_line(e))
        sys.exit(e.exit_status)


def precheck(config_dir: str, args: list[str]) -> None:
    """Compose and validate the config once before Hydra does, so a bad override, a bad
    value or an unwritable run dir is reported as one line (Hydra's own reports span several
    lines) before Hydra creates the run dir."""
    if any(a.split("=")[0] in _NOT_A_PLAIN_RUN for a in args):
        return
    overrides = [a for a in args if not a.startswith("-")]
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            run_dir = Path(str(cfg.hydra.run.dir))
    except Exception as e:  # Hydra's override, missing-option and interpolation errors
        message = " ".join(str(e).split())
        say(message)
        sys.exit(2)
    finally:
        GlobalHydra.instance().clear()
    from syncbn_lab.config import validate
    from syncbn_lab.engine.checkpoint import check_resume
    from syncbn_lab.machine import torchrun_env
    from syncbn_lab.run_dir import decide, follows_the_run_dir

    launched = torchrun_env()
    with exit_on_user_error(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # run() validates again and warns then, once
        shape = validate(cfg)
        if launched is not None and launched["rank"] != 0:  # rank 0 decides about the run dir
            if not follows_the_run_dir(cfg):
                check_resume(cfg)
            return
        try:  # a bad checkpoint or a taken run dir is one line before Hydra makes the run dir
            decide(cfg, run_dir)
        except OneLineError as e:
            if launched is not None:  # the other ranks wait for rank 0: say why, tell them, exit
                from syncbn_lab.parallel.ddp import refuse_torchrun_ranks

                refuse_torchrun_ranks(cfg, shape, e)
            raise


def torchrun_restart_args(args: list[str]) -> list[str]:
    """For a rank 0 that torchrun restarted: ``args`` with the run dir its job started in,
    unless they name one (Hydra would name a new one by the time)."""
    from syncbn_lab.run_dir import remembered_run_dir, restarted, torchrun_restart

    if not restarted() or os.environ.get("RANK") != "0":
        return args
    if any(a.split("=", 1)[0].lstrip("+~") == "hydra.run.dir" for a in args):
        return args
    run_dir = remembered_run_dir(torchrun_restart()[0])
    return args if run_dir is None else [*args, f"hydra.run.dir={run_dir}"]
