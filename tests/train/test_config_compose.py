"""Every option of every config group composes, validates and instantiates."""

from pathlib import Path

import pytest
import torch
from conftest import CONFIG_DIR, compose_config
from omegaconf import OmegaConf

from syncbn_lab import models
from syncbn_lab.config import validate
from syncbn_lab.engine.optim import build_optimizer, lr_factor
from syncbn_lab.errors import ConfigError
from syncbn_lab.nn.registry import norm_layer

GROUPS = ["data", "model", "bn", "parallel", "optim", "sched", "trainer", "logger", "debug"]


def options(group):
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


def test_defaults():
    cfg = compose_config()
    assert (cfg.data.name, cfg.model.name, cfg.bn.name) == ("mnist", "resnet8", "bn")
    assert (cfg.optim.name, cfg.sched.name, cfg.logger.name) == ("sgd", "cosine", "wandb")
    assert cfg.parallel.name == "single"


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in options(g)], ids=lambda v: str(v)
)
def test_option_composes_and_instantiates(group, option):
    cfg = compose_config([f"{group}={option}", "data.root=/nonexistent-data-root"])
    assert group in ("trainer", "debug") or cfg[group].get("name", option) == option
    every_key_is_documented(Path(CONFIG_DIR) / group / f"{option}.yaml")
    try:
        validate(cfg)
    except ConfigError as e:  # options that need CUDA say so in one line
        assert not torch.cuda.is_available()
        assert "CUDA" in str(e) and "\n" not in str(e)
        return
    norm = norm_layer(cfg.bn, device_slices=cfg.parallel.devices, training_batches=100)
    in_channels = 1 if cfg.data.name in ("mnist", "fashion_mnist", "digits") else 3
    model = models.build(cfg.model, norm, num_classes=10, in_channels=in_channels)
    build_optimizer(cfg.optim, model)
    assert 0 <= lr_factor(cfg.sched, 3, 100, 10) <= 1


def every_key_is_documented(path: Path):
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("-"):
            continue
        if stripped.endswith(":"):  # a nested mapping's header
            continue
        assert "#" in line, f"{path.name}: undocumented key: {line}"


def test_cfg_job_prints_composed_config(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            str(Path(CONFIG_DIR).parent / "scripts/train.py"),
            "--cfg",
            "job",
            "bn=gn",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.bn.name == "gn" and cfg.model.name == "resnet8"


@pytest.mark.parametrize(
    "experiment,dataset,variants,seeds,step",
    [
        ("bn_vs_syncbn", "fashion_mnist", "bn", 3, ("auto", True)),  # reports/fast_vs_fp32/
        ("bn_vs_syncbn_1epoch", "fashion_mnist", "bn,sync", 4, ("auto", True)),
        ("bn_vs_syncbn_mnist", "mnist", "bn,sync", 3, ("auto", False)),
    ],
)
def test_study_experiments(experiment, dataset, variants, seeds, step):
    """The CPU studies: the experiment names its dataset and study, emulates devices at a
    fixed global batch, trains in its precision and layout, and its sweep grid is its
    variants x 1 ... 64 devices x the seeds."""
    cfg = compose_config([f"experiment={experiment}"])
    assert (cfg.data.name, cfg.model.name, cfg.parallel.name) == (dataset, "resnet8", "emulated")
    assert cfg.study == experiment and cfg.trainer.global_batch_size == 64
    assert cfg.trainer.precise_bn_batches > 0
    assert (cfg.trainer.precision, cfg.trainer.channels_last) == step
    validate(cfg)
    grid = OmegaConf.load(Path(CONFIG_DIR) / "experiment" / f"{experiment}.yaml").hydra.sweeper
    assert grid.params.bn == variants
    assert grid.params["parallel.devices"] == "1,2,4,8,16,32,64"
    assert len(str(grid.params["trainer.seed"]).split(",")) == seeds
