"""Command-line helpers: user errors become one line and a non-zero exit, not a traceback."""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

from syncbn_lab.errors import OneLineError, one_line

# Hydra flags after which the remaining arguments are not a plain single run.
_NOT_A_PLAIN_RUN = {"--multirun", "-m", "--cfg", "-c", "--help", "-h", "--hydra-help", "--info"}


@contextlib.contextmanager
def exit_on_user_error():
    try:
        yield
    except OneLineError as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
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
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        GlobalHydra.instance().clear()
    from syncbn_lab.config import validate
    from syncbn_lab.engine.checkpoint import check_resume
    from syncbn_lab.train import check_run_dir

    with exit_on_user_error(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # run() validates again and warns then, once
        validate(cfg)
        check_resume(cfg)  # a bad checkpoint is one line before Hydra makes the run dir
        check_run_dir(run_dir)
