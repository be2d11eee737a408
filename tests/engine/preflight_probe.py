"""Run as a script (in a subprocess, so that a crash is an exit status): a tiny run whose
model has oneDNN's strided 1x1 convolutions put back (plain strided ``nn.Conv2d`` shortcuts,
as torch builds them) in channels_last float32 at two threads, and print, as JSON, whether
its preflight check stopped it and with which line. With ``ONEDNN_MAX_CPU_ISA=AVX2`` those
convolutions take the broken kernel of oneDNN issue 6035. ``test_preflight.py`` runs it.

    python preflight_probe.py RUN_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).parents[1] / "models")]

from conftest import TINY, compose_config  # noqa: E402
from strided_1x1_probe import plain_strided_shortcuts  # noqa: E402

from syncbn_lab import models  # noqa: E402
from syncbn_lab.engine.preflight import PreflightFailed  # noqa: E402
from syncbn_lab.train import run  # noqa: E402

BROKEN = ["bn=bn", "parallel=single", "trainer.precision=fp32", "trainer.channels_last=true"]


def main() -> None:
    build = models.build
    models.build = lambda *args, **kwargs: plain_strided_shortcuts(build(*args, **kwargs))
    cfg = compose_config([*TINY, *BROKEN, "trainer.threads=2", "trainer.max_steps=1"])
    try:
        run(cfg, sys.argv[1])
        outcome = {"failed": False, "message": ""}
    except PreflightFailed as e:
        outcome = {"failed": True, "message": str(e)}
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
