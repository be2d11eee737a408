"""The noise of BatchNorm's batch statistics on a model a config builds:
`python scripts/bn_noise.py experiment=nbs_256 parallel.devices=128 noise.batches=[2,8,32]`.

Thin on purpose: Hydra composes configs/bn_noise.yaml (the training config and the tool's
``noise`` keys, train.py's overrides apply), syncbn_lab.bn_noise.run does the job and writes
bn_noise.json, layers.csv and summary.csv into the output folder (docs/bn_noise.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from syncbn_lab.cli import exit_on_user_error

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
# Hydra flags after which the arguments are not one plain run (nothing to check first)
NOT_A_PLAIN_RUN = ("--multirun", "-m", "--cfg", "-c", "--help", "-h", "--hydra-help", "--info")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="bn_noise")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from syncbn_lab.bn_noise import run

    with exit_on_user_error():
        run(cfg, HydraConfig.get().runtime.output_dir)


def precheck(args: list[str]) -> None:
    """Compose and check the config before Hydra makes the output folder: a bad override or
    value is one line and exit status 2."""
    if any(
        a.split("=")[0] in ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info") for a in args
    ):
        return
    from syncbn_lab.bn_noise import check, compose

    try:
        cfg = compose([a for a in args if not a.startswith("-")])
    except Exception as e:  # Hydra's override, missing-option and interpolation errors
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        sys.exit(2)
    with exit_on_user_error():
        check(cfg)


if __name__ == "__main__":
    precheck(sys.argv[1:])
    main()
