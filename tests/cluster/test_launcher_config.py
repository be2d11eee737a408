"""configs/hydra/launcher/submitit_slurm.yaml against the installed hydra-submitit-launcher
(no cluster needed): every key is a field of the plugin's SlurmQueueConf, documented, and
the launcher it names is the plugin's SlurmLauncher."""

import dataclasses
import shutil

import pytest
from conftest import CONFIG_DIR
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.utils import get_class
from omegaconf import OmegaConf

plugin = pytest.importorskip("hydra_plugins.hydra_submitit_launcher.config")
LAUNCHER = "hydra/launcher/submitit_slurm.yaml"


def launcher_config(config_dir: str):
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose("config", ["hydra/launcher=submitit_slurm"], return_hydra_config=True)
            return OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    finally:
        GlobalHydra.instance().clear()


def test_every_key_is_a_documented_field_of_the_plugin_schema():
    fields = {f.name for f in dataclasses.fields(plugin.SlurmQueueConf)}
    with pytest.warns(UserWarning, match="validated against ConfigStore schema"):
        launcher = launcher_config(CONFIG_DIR)
    assert set(launcher) == fields
    written = [
        line for line in open(f"{CONFIG_DIR}/{LAUNCHER}") if line[:1].isalpha() or line[:1] == "_"
    ]
    assert {line.split(":")[0] for line in written} == fields  # every field set here
    assert all(" # " in line for line in written), [ln for ln in written if " # " not in ln]
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

    assert issubclass(get_class(launcher["_target_"]), SlurmLauncher)


def test_a_key_the_plugin_does_not_know_is_refused(tmp_path):
    shutil.copytree(CONFIG_DIR, tmp_path / "configs")
    with open(tmp_path / "configs" / LAUNCHER, "a") as f:
        f.write("srun_arguments: null  # not a field of SlurmQueueConf\n")
    with pytest.warns(UserWarning), pytest.raises(ConfigCompositionException) as failure:
        launcher_config(str(tmp_path / "configs"))
    assert "srun_arguments" in str(failure.value.__cause__ or failure.value)
