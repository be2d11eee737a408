"""scripts/sweep.py runs what the experiment declares (its grid, then sweep.parts from its
YAML) and defines no grid itself; the number of parallel jobs follows the machine."""

from __future__ import annotations

import ast

import pytest
import yaml
from conftest import CONFIG_DIR, ROOT

from syncbn_lab import sweep
from syncbn_lab.errors import UserError


def experiment_parts(name: str) -> dict[str, list[str]]:
    """sweep.parts as written in configs/experiment/<name>.yaml (read without Hydra)."""
    text = (ROOT / "configs" / "experiment" / f"{name}.yaml").read_text()
    return yaml.safe_load(text)["sweep"]["parts"]


@pytest.mark.parametrize(
    "experiment", ["bn_vs_syncbn", "bn_vs_syncbn_1epoch", "bn_vs_syncbn_mnist"]
)
def test_the_plan_is_the_grid_then_the_yaml_parts(experiment, monkeypatch):
    monkeypatch.setattr(sweep, "available_cores", lambda: 5)
    parts = sweep.plan(experiment, False, "emulated", "joblib", [])
    declared = experiment_parts(experiment)
    assert [p["part"] for p in parts] == ["grid", *declared]
    assert "hydra.launcher.n_jobs=5" in parts[0]["overrides"]
    for part in parts[1:]:
        assert part["overrides"][-len(declared[part["part"]]) :] == declared[part["part"]] or (
            part["overrides"][-1] == "hydra.launcher.n_jobs=1"
        )
        real_ddp = "parallel=ddp" in declared[part["part"]]
        assert ("hydra.launcher.n_jobs=1" in part["overrides"]) == real_ddp, part


def test_ddp_parts_are_left_out_when_the_grid_is_ddp():
    parts = sweep.plan("bn_vs_syncbn", False, "ddp", "slurm", [])
    assert [p["part"] for p in parts] == ["grid", "sync", "brn", "brn_tuned", "gn", "accumulate"]
    assert not any("n_jobs" in o for p in parts for o in p["overrides"])  # not joblib


def test_the_smoke_sweep_takes_its_overrides_and_parts_from_the_config():
    config = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())["sweep"]["smoke"]
    parts = sweep.plan("bn_vs_syncbn_mnist", True, "emulated", "slurm", ["trainer.seed=1"])
    assert [p["part"] for p in parts] == ["grid", *config["parts"]]
    grid = parts[0]["overrides"]
    assert grid[-1] == "trainer.seed=1" and "trainer.seed=0" not in grid  # the user's wins
    assert set(config["overrides"]) - {"trainer.seed=0"} <= set(grid)


def test_unknown_experiment_or_launcher_is_one_line():
    for args in (
        ("nope", False, "emulated", "joblib", []),
        ("bn_vs_syncbn", False, "emulated", "x", []),
    ):
        with pytest.raises(UserError) as e:
            sweep.plan(*args)
        assert "\n" not in str(e.value)


def test_scripts_sweep_defines_no_grid():
    """No override (``key=value``) is written in scripts/sweep.py: the study is in YAML."""
    tree = ast.parse((ROOT / "scripts" / "sweep.py").read_text())
    overrides = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and any(node.value.startswith(f"{group}=") or node.value.startswith(f"{group}.")
                for group in ("bn", "parallel", "trainer", "data", "model"))
    ]  # fmt: skip
    assert overrides == []
    assert CONFIG_DIR  # the experiments are composed from configs/, as train.py does


def test_a_part_set_to_null_is_not_run():
    """fast_vs_fp32 inherits the one-epoch study's parts and drops them (null), then adds its
    own: its plan is the grid and its own parts."""
    parts = sweep.plan("fast_vs_fp32", False, "emulated", "joblib", [])
    assert [p["part"] for p in parts] == ["grid", "sync", "fp32", "fp32_sync"]
    assert parts[2]["overrides"][-2:] == ["trainer.precision=fp32", "trainer.channels_last=false"]


def test_every_planned_job_has_its_own_run_dir():
    """A part numbers its jobs from 0 as the grid does: calibration_animal_mnist's widths part
    (bn on 1 device, seeds 0 and 1) would reuse the grid's first run dirs but for its name."""
    from omegaconf import OmegaConf

    from syncbn_lab.config import compose
    from syncbn_lab.multirun import jobs

    names = []
    for part in sweep.plan("calibration_animal_mnist", False, "emulated", "joblib", []):
        overrides = ["experiment=calibration_animal_mnist", *part["overrides"]]
        given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweep.subdir=")]
        subdir = given[-1] if given else sweep.run_dir_pattern()
        assert subdir.startswith("" if part["part"] == "grid" else f"{part['part']}_")
        for number, job in enumerate(jobs(overrides)):
            cfg = compose([o for o in job if not o.startswith("hydra.")])
            keys = {k: OmegaConf.select(cfg, k) for k in ("bn", "parallel", "trainer")}
            named = OmegaConf.create({**keys, "hydra": {"job": {"num": number}}, "name": subdir})
            names.append(str(named.name))
    assert len(names) == 26 and len(set(names)) == 26, sorted(names)
    assert "0_bn_emulated1_s0" in names and "widths_0_bn_emulated1_s0" in names
