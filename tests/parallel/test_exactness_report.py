"""The exactness proof: the committed figures of scripts/prove_exactness.py (default MNIST
resnet8, 20 steps, real gloo DDP against the emulation) and, on every run of the suite, one
fp64 pair re-proven on a smaller slice through the real CLI."""

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


def test_the_report_records_what_produced_it(report):
    assert re.fullmatch(r"[0-9a-f]{40}", report["meta"]["git_commit"])
    assert report["meta"]["torch"] and report["meta"]["machine"]["cpu"]
    assert report["steps"] == 20 and report["tolerance"] == 1e-9
    assert report["command"].startswith("python scripts/prove_exactness.py")


def test_every_fp64_pair_is_within_1e9_at_every_step_and_in_every_tensor(report):
    exact = {r["name"]: r for r in report["results"] if r["kind"] == "exact"}
    assert set(exact) == FP64_PAIRS
    for name, r in exact.items():
        assert len(r["loss_by_step"]) == 20, name
        assert max(r["loss_by_step"]) <= 1e-9, name
        assert r["checkpoint"] <= 1e-9, name
        assert r["tensors"] > 50, name  # parameters, BN buffers and momentum buffers


def test_fp32_ddp_against_emulation_stays_inside_the_measured_noise_floor(report):
    floors = [r for r in report["results"] if r["kind"] == "floor"]
    fp32 = [r for r in report["results"] if r["kind"] == "fp32"]
    exact = [r for r in report["results"] if r["kind"] == "exact"]
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


def test_the_readme_states_the_figures_of_the_json(report):
    text = (REPORT / "README.md").read_text()
    worst = max(r["worst"] for r in report["results"] if r["kind"] == "exact")
    assert f"**{worst:.1e}**" in text
    assert f"**{report['fp32_noise_floor']['loss']:.1e}**" in text
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
    short = fake_run(tmp_path / "c", [2.0, 1.0], w, m)
    with pytest.raises(AssertionError, match="logged steps differ"):
        run_difference(a, short)
