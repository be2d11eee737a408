"""The norm variants and parallel modes are specs found by config name: nobody else spells a
variant's name, and a new variant is one spec and one YAML file."""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import CONFIG_DIR, ROOT, TINY, compose_config
from hydra import compose, initialize_config_dir

from syncbn_lab import train
from syncbn_lab.config import validate
from syncbn_lab.errors import ConfigError
from syncbn_lab.nn.registry import norm_layer
from syncbn_lab.parallel.modes import MODES
from syncbn_lab.variants import VARIANTS, NormVariant

SRC = ROOT / "src" / "syncbn_lab"


def files_spelling(names: set[str]) -> dict[str, set[str]]:
    """Python file under src/syncbn_lab -> the ``names`` it holds as whole string literals."""
    found: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        literals = {
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and node.value in names
        }
        if literals:
            found[str(path.relative_to(SRC))] = literals
    return found


def test_variant_names_are_spelled_in_at_most_two_files():
    found = files_spelling(set(VARIANTS))
    assert "variants.py" in found  # the specs themselves: the test does see literals
    assert len(found) <= 2, found


def test_mode_names_are_spelled_only_by_the_modes():
    assert set(files_spelling(set(MODES))) == {"parallel/modes.py"}


def test_the_literal_scan_sees_a_name_compared(tmp_path):
    """The scan is what fails when a module compares a variant's name again."""
    module = SRC / "_scan_probe.py"
    module.write_text('def f(cfg):\n    return cfg.bn.name == "gn"\n')
    try:
        assert files_spelling({"gn"})["_scan_probe.py"] == {"gn"}
    finally:
        module.unlink()


def test_every_variant_and_mode_has_its_yaml_and_back():
    """configs/bn/ and configs/parallel/ hold one file per spec, named as the spec."""
    for group, specs in (("bn", VARIANTS), ("parallel", MODES)):
        yamls = {p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml")}
        assert yamls == set(specs), group


@dataclass(frozen=True)
class _HalfBatchNorm(NormVariant):
    """A throwaway variant: per-device BN whose statistics span half of each device slice
    (ghost batches of half the per-device batch), built from our BatchNorm over twice the
    slices."""

    def layer(self, cfg, device_slices, training_batches, ours):
        from syncbn_lab.nn import BatchNorm

        return lambda c: BatchNorm(c, device_slices=2 * device_slices, eps=cfg.eps)

    def normalization_batch_size(self, cfg, per_device_batch_size, devices):
        return per_device_batch_size // 2

    def check(self, cfg, mode, device):
        if cfg.trainer.global_batch_size % (2 * cfg.parallel.devices):
            raise ConfigError("bn=halfbn needs an even per-device batch")


@pytest.fixture
def halfbn(tmp_path, monkeypatch):
    """The throwaway spec registered, and a config dir with its one YAML file added."""
    monkeypatch.setitem(VARIANTS, "halfbn", _HalfBatchNorm("halfbn", "half-batch BN"))
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    (configs / "bn" / "halfbn.yaml").write_text(
        "name: halfbn  # per-device BN over half of each device slice\n"
        "eps: 1.0e-5  # added to the variance before the square root\n"
    )
    return configs


def test_a_new_variant_is_one_spec_and_one_yaml(halfbn, tmp_path):
    overrides = [*TINY, "bn=halfbn", "parallel=emulated", "parallel.devices=2"]
    with initialize_config_dir(config_dir=str(halfbn), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "trainer.max_steps=2"])
        odd = compose("config", overrides=[*overrides, "trainer.global_batch_size=34"])
    shape = validate(cfg)
    assert (shape.per_device_batch_size, shape.normalization_batch_size) == (16, 8)
    with pytest.raises(ConfigError, match="even per-device batch"):
        validate(odd)
    # the layer sees four slices: each half of each emulated device normalised alone
    layer = norm_layer(cfg.bn, shape.device_slices)(3).double().train()
    x = torch.randn(32, 3, 2, 2, dtype=torch.float64)
    y = layer(x)
    for i, quarter in enumerate(x.split(8)):
        alone = torch.nn.functional.batch_norm(quarter, None, None, training=True, eps=1e-5)
        torch.testing.assert_close(y[8 * i : 8 * (i + 1)], alone)
    summary = train.run(cfg, tmp_path / "run")
    assert summary["bn"] == "halfbn" and summary["normalization_batch_size"] == 8


def test_an_unknown_variant_is_one_line_naming_every_variant():
    with pytest.raises(ConfigError, match="bn.name=nope is unknown") as e:
        validate(compose_config([*TINY, "bn.name=nope"]))
    assert "\n" not in str(e.value)
    assert str(e.value).endswith(", ".join(VARIANTS))
