"""The exactness proof: the committed figures of scripts/prove_exactness.py (default MNIST
resnet8, 20 steps, real gloo DDP against the emulation, gradient accumulation against more
emulated devices) and, on every run of the suite, one fp64 pair re-proven on a smaller slice
through the real CLI."""

import json
import re

import pytest
from conftest import ROOT

from syncbn_lab.run_compare import run_difference, train_cli

REPORT = ROOT / "reports" / "exactness"
FP64_PAIRS = {
    "fp64 bn: emulated N=2 vs ddp N=2",
    "fp64 sync: emulated N=2 vs ddp N=2",
    "fp64 bn: emulated N=4 vs ddp N=4",
    "fp64 sync: emulated N=4 vs ddp N=4",
    "fp64 sync: emulated N=1 vs emulated N=8",
}


@pytest.fixture(scope="module")
def report():
    return json.loads((REPORT / "results.json").read_text())


def section(report, name):
    return [r for r in report["results"] if r["section"] == name]


def test_the_report_records_what_produced_each_section(report):
    assert set(report["sections"]) == {"ddp", "accumulate"}
    for ran in report["sections"].values():
        assert re.fullmatch(r"[0-9a-f]{40}", ran["meta"]["git_commit"])
        assert ran["meta"]["torch"] and ran["meta"]["machine"]["cpu"]
        assert ran["command"].startswith("python scripts/prove_exactness.py")
    assert report["steps"] == 20 and report["tolerance"] == 1e-9


def test_every_fp64_pair_is_within_1e9_at_every_step_and_in_every_tensor(report):
    exact = {r["name"]: r for r in section(report, "ddp") if r["kind"] == "exact"}
    assert set(exact) == FP64_PAIRS
    for name, r in exact.items():
        assert len(r["loss_by_step"]) == 20, name
        assert max(r["loss_by_step"]) <= 1e-9, name
        assert r["checkpoint"] <= 1e-9, name
        assert r["tensors"] > 50, name  # parameters, BN buffers and momentum buffers


def test_fp32_ddp_against_emulation_stays_inside_the_measured_noise_floor(report):
    floors = [r for r in section(report, "ddp") if r["kind"] == "floor"]
    fp32 = [r for r in section(report, "ddp") if r["kind"] == "fp32"]
    exact = [r for r in section(report, "ddp") if r["kind"] == "exact"]
    floor = report["fp32_noise_floor"]
    assert report["margin"] == 3.0
    for metric in ("loss", "checkpoint"):
        assert floor[metric] == max(r[metric] for r in floors)
        # float32 is chaotic here: 1 vs 2 threads differ far above float64's differences
        assert floor[metric] > 1e6 * max(r[metric] for r in exact)
    assert {r["name"].replace("fp32", "fp64") for r in fp32} == FP64_PAIRS
    for r in fp32:
        for metric in ("loss", "checkpoint"):
            assert r[metric] <= report["margin"] * floor[metric], (r["name"], metric)
    assert report["missed"] == []


def test_accumulation_equals_more_devices_but_for_the_running_statistics(report):
    """One device with trainer.accumulate=4 against emulated N=4: the loss at every step,
    the parameters and momentum buffers within 1e-9; the BN buffers left out differ (K
    updates a step from every slice against device 0's once a step); with cumulative
    averages, the running statistics equal the mean of every device's own."""
    trains, averages = section(report, "accumulate")
    for r in (trains, averages):
        assert r["kind"] == "exact" and r["precision"] == "fp64", r["name"]
        assert len(r["loss_by_step"]) == 20 and max(r["loss_by_step"]) <= 1e-9, r["name"]
        assert r["checkpoint"] <= 1e-9, r["name"]
        assert r["num_batches_tracked"] == [4 * 20, 20], r["name"]
    assert "parallel.devices=4" in trains["b"] and "trainer.accumulate=4" in trains["a"]
    assert set(trains["left_out"]) == {"running_mean", "running_var", "num_batches_tracked"}
    assert min(trains["left_out"]["running_mean"], trains["left_out"]["running_var"]) > 1e-3
    assert set(averages["left_out"]) == {"num_batches_tracked"}
    assert averages["tensors"] == trains["tensors"] + 18  # 9 BN layers' running_mean, _var
    assert "bn.momentum=null" in averages["a"] and "parallel.dist_bn=reduce" in averages["b"]


def test_the_readme_states_the_figures_of_the_json(report):
    text = (REPORT / "README.md").read_text()
    worst = max(r["worst"] for r in section(report, "ddp") if r["kind"] == "exact")
    assert f"**{worst:.1e}**" in text
    assert f"**{report['fp32_noise_floor']['loss']:.1e}**" in text
    assert f"**{section(report, 'accumulate')[0]['worst']:.1e}**" in text
    assert "NOT within" not in text


# The default model (resnet8 width 16, global batch 64, SGD + cosine) on MNIST-shaped
# synthetic images, so no download is needed and evaluation is a few images.
SLICE = [
    "data=synthetic",
    "data.image_size=28",
    "data.num_classes=10",
    "data.num_train=640",
    "data.num_val=64",
    "data.num_test=64",
    "logger=none",
    "trainer.max_steps=5",
    "trainer.log_every=1",
    "trainer.threads=1",
    "trainer.precision=fp64",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["bn=bn"],
        # random crops and flips: each emulated device draws from its own rank's stream
        ["bn=sync", "data.augment=true", "data.crop_padding=2", "data.hflip=true"],
    ],
)
def test_fp64_emulation_equals_real_ddp_through_the_cli(tmp_path, overrides):
    emulated = ["parallel=emulated", "parallel.devices=2"]
    train = ROOT / "scripts" / "train.py"
    emulated = train_cli(train, [*SLICE, *overrides, *emulated], tmp_path / "e")
    ddp = train_cli(
        train, [*SLICE, *overrides, "parallel=ddp", "parallel.devices=2"], tmp_path / "d"
    )
    diff = run_difference(emulated, ddp)
    assert len(diff["loss_by_step"]) == 5
    assert diff["worst"] <= 1e-9, diff


def fake_run(run_dir, losses, weight, momentum):
    import torch

    (run_dir / "checkpoints").mkdir(parents=True)
    lines = [{"step": s, "epoch": s / 10, "train/loss": v} for s, v in enumerate(losses, 1)]
    lines.append({"step": len(losses), "epoch": 1, "train/loss": 9.0, "val/acc": 1.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    state = {"model": {"w": weight}, "optimizer": {"state": {0: {"momentum_buffer": momentum}}}}
    torch.save(state, run_dir / "checkpoints" / "last.pt")
    return run_dir


def test_run_difference_finds_the_worst_step_and_tensor(tmp_path):
    import torch

    w, m = torch.tensor([4.0, -2.0, 0.0]), torch.tensor([1.0, 0.5])
    a = fake_run(tmp_path / "a", [2.0, 1.0, 0.5], w, m)
    b = fake_run(tmp_path / "b", [2.0, 1.0 + 3e-6, 0.5], w + torch.tensor([0, 0, 4e-5]), m)
    diff = run_difference(a, b)
    assert diff["loss_step"] == 2 and diff["loss"] == pytest.approx(3e-6 / (1 + 3e-6))
    assert diff["checkpoint_tensor"] == "model.w"
    assert diff["checkpoint"] == pytest.approx(4e-5 / 4.0)  # normwise: max |a-b| / max |b|
    assert diff["worst"] == diff["checkpoint"] and diff["tensors"] == 2
    assert run_difference(a, a)["worst"] == 0.0
    left = run_difference(a, b, leave_out=("w",))  # names ending in "w": model.w
    assert left["checkpoint_tensor"] == "optimizer.0.momentum_buffer" and left["tensors"] == 1
    assert left["left_out"] == {"w": diff["checkpoint"]} and left["worst"] == diff["loss"]
    short = fake_run(tmp_path / "c", [2.0, 1.0], w, m)
    with pytest.raises(AssertionError, match="logged steps differ"):
        run_difference(a, short)
