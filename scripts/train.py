"""Train one configuration: `python scripts/train.py bn=sync parallel=ddp parallel.devices=4`.

Thin on purpose: Hydra composes the config, syncbn_lab.train.run does the job.
`python scripts/train.py --cfg job` prints the composed config.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from syncbn_lab.cli import exit_on_user_error, precheck

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    from syncbn_lab.train import run

    with exit_on_user_error():
        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    return summary.get("test_acc") if summary else None


if __name__ == "__main__":
    precheck(CONFIG_DIR, sys.argv[1:])
    main()
