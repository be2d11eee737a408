"""Impossible parallel combinations fail with one line before any process starts; the
possible-but-slow one (more gloo processes than cores) warns."""

import warnings

import pytest
import torch
from conftest import CONFIG_DIR, TINY, compose_config

from syncbn_lab.config import validate
from syncbn_lab.errors import ConfigError
from syncbn_lab.parallel import modes as modes_module


def one_line_error(*overrides) -> str:
    with pytest.raises(ConfigError) as error:
        validate(compose_config([*TINY, *overrides]))
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend this machine has ``n`` CUDA devices (validation only looks, never uses them)."""

    def install(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return install


@pytest.mark.parametrize("mode", ["emulated", "ddp", "dp"])
def test_devices_below_one(mode):
    assert "parallel.devices=0 must be a positive integer" in one_line_error(
        f"parallel={mode}", "parallel.devices=0"
    )


@pytest.mark.parametrize("mode", ["emulated", "ddp"])
def test_global_batch_not_divisible(mode):
    message = one_line_error(
        f"parallel={mode}",
        "parallel.devices=4",
        "trainer.accumulate=3",
        "trainer.global_batch_size=32",
    )
    assert "not divisible by parallel.devices x trainer.accumulate = 4 x 3" in message


def test_per_device_batch_is_derived():
    cfg = compose_config([*TINY, "parallel=ddp", "parallel.devices=4", "trainer.accumulate=2"])
    shape = validate(cfg)
    assert shape.per_device_batch_size == 32 // (4 * 2)
    assert shape.backend == "gloo"
    assert shape.slices_per_process == 1 and shape.device_slices == 1
    assert "derived" not in cfg  # validate reads the config and writes nothing into it


@pytest.mark.parametrize(
    ("mode", "slices_per_process", "device_slices"),
    [("emulated", 4, 4), ("ddp", 1, 1)],
)
def test_device_slices_by_mode(mode, slices_per_process, device_slices):
    """Emulation puts every device's slice through one process and one layer; DDP one each."""
    shape = validate(compose_config([*TINY, f"parallel={mode}", "parallel.devices=4"]))
    assert (shape.devices, shape.slices_per_process, shape.device_slices) == (
        4,
        slices_per_process,
        device_slices,
    )
    assert shape.backend == ("gloo" if mode == "ddp" else None)


def test_run_shape_pickles_for_spawned_ranks():
    import pickle

    shape = compose_config([*TINY, "parallel=ddp", "parallel.devices=2"])

    validate(shape)
    assert pickle.loads(pickle.dumps(shape)) == shape


@pytest.mark.parametrize("mode", ["emulated", "ddp"])
def test_torch_sync_without_cuda(mode, fake_gpus):
    fake_gpus(0)
    assert "use bn=sync" in one_line_error(f"parallel={mode}", "bn=torch_sync")


def test_torch_sync_cannot_be_emulated_even_with_cuda(fake_gpus):
    fake_gpus(1)
    message = one_line_error("parallel=emulated", "bn=torch_sync", "trainer.device=cuda")
    assert "bn=torch_sync cannot emulate devices" in message and "bn=sync" in message


def test_dp_without_enough_gpus_suggests_emulation(fake_gpus):
    fake_gpus(0)
    message = one_line_error("parallel=dp", "parallel.devices=2")
    assert "needs 2 CUDA devices but 0 are visible" in message
    assert "parallel=emulated parallel.devices=2" in message
    fake_gpus(1)
    assert "but 1 are visible" in one_line_error(
        "parallel=dp", "parallel.devices=2", "trainer.device=cuda"
    )


@pytest.mark.parametrize("bn", ["sync", "torch_sync"])
def test_sync_bn_under_dp_fails_instead_of_silently_going_per_replica(bn, fake_gpus):
    fake_gpus(2)
    message = one_line_error("parallel=dp", "parallel.devices=2", f"bn={bn}", "trainer.device=cuda")
    assert f"bn={bn} does not synchronise under DataParallel" in message
    assert "parallel=emulated or parallel=ddp" in message


def test_ddp_needs_one_gpu_per_process_on_cuda(fake_gpus):
    fake_gpus(1)
    message = one_line_error("parallel=ddp", "parallel.devices=2", "trainer.device=cuda")
    assert "needs 2 CUDA devices (one per process)" in message


def test_nccl_needs_cuda(fake_gpus):
    fake_gpus(0)
    assert "parallel.backend=nccl needs CUDA" in one_line_error(
        "parallel=ddp", "parallel.backend=nccl"
    )


def test_unknown_dist_bn():
    assert "parallel.dist_bn=mean is unknown" in one_line_error(
        "parallel=ddp", "parallel.dist_bn=mean"
    )


def test_more_gloo_processes_than_cores_warns(monkeypatch):
    monkeypatch.setattr(modes_module, "available_cores", lambda: 2)
    with pytest.warns(UserWarning, match="starts 4 gloo processes on 2 CPU core") as caught:
        validate(compose_config([*TINY, "parallel=ddp", "parallel.devices=4"]))
    w = caught[0]
    printed = warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
    assert printed.count("\n") == 1, printed  # one line on stderr, no echoed source line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(compose_config([*TINY, "parallel=ddp", "parallel.devices=2"]))


def test_under_torchrun_devices_follow_world_size(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = compose_config([*TINY, "parallel=ddp"])
    assert cfg.parallel.devices == 4 and validate(cfg).per_device_batch_size == 8
    assert "pass parallel.devices=4" in one_line_error("parallel=ddp", "parallel.devices=2")
    assert "use parallel=ddp under torchrun" in one_line_error("parallel=emulated")


def test_slurm_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["hydra/launcher=submitit_slurm", "parallel=ddp", "parallel.devices=4"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    # The project's subclass of the plugin's launcher (tests/cluster/test_launcher_config.py).
    assert launcher._target_ == "hydra_plugins.syncbn_lab_slurm.launcher.SlurmLauncher"
    assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.nodes) == (1, 4, 1)
