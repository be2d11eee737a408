"""The studies at GPU scale (experiment=bn_vs_syncbn_cifar10 and _imagenet) compose as their
papers set them (8 GPUs, global batch and learning rate from the images per GPU), and their
model trains a step on synthetic data of their shapes here, on the CPU, with the device
count emulated."""

import math

import pytest
from conftest import compose_config

from syncbn_lab.config import validate
from syncbn_lab.train import run

CPU = ["trainer.device=cpu", "parallel=emulated", "trainer.max_steps=1", "logger=none",
       "trainer.precision=fp32", "trainer.precise_bn_batches=1", "trainer.num_workers=0",
       "data=synthetic", "data.num_train=64", "data.num_val=8", "data.num_test=8",
       "data.channels=3"]  # fmt: skip


@pytest.mark.parametrize(
    "experiment, per_gpu, epochs, milestones",
    [("bn_vs_syncbn_cifar10", 32, 160, [0.5, 0.75]),
     ("bn_vs_syncbn_imagenet", 32, 100, [0.3, 0.6, 0.9])],
)  # fmt: skip
def test_the_gpu_studies_follow_their_papers(experiment, per_gpu, epochs, milestones):
    for n in (per_gpu, 4):
        cfg = compose_config([f"experiment={experiment}", f"per_gpu_batch={n}"])
        assert (cfg.parallel.name, cfg.parallel.devices, cfg.trainer.device) == ("ddp", 8, "cuda")
        assert cfg.trainer.global_batch_size == 8 * n
        assert math.isclose(cfg.optim.lr, 0.1 * n / 32)  # Wu & He: 0.1 x N / 32
        assert (cfg.trainer.epochs, list(cfg.sched.milestones)) == (epochs, milestones)


@pytest.mark.parametrize(
    "experiment, shape",
    [("bn_vs_syncbn_cifar10", ["data.image_size=32", "per_gpu_batch=2"]),
     ("bn_vs_syncbn_imagenet", ["data.image_size=224", "per_gpu_batch=1", "parallel.devices=2"])],
)  # fmt: skip
def test_a_step_of_each_gpu_study_on_synthetic_data_of_its_shape(experiment, shape, tmp_path):
    cfg = compose_config([f"experiment={experiment}", *CPU, *shape, "bn=sync"])
    validate(cfg)
    summary = run(cfg, tmp_path / "run")
    devices = cfg.parallel.devices
    assert summary["steps"] == 1 and summary["global_batch_size"] == devices * cfg.per_gpu_batch
    assert summary["per_device_batch_size"] == cfg.per_gpu_batch
