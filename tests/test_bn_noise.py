"""scripts/bn_noise.py (syncbn_lab.bn_noise): the noise of BN's batch statistics against the
sampling formulas of i.i.d. Gaussian values, exactly zero at the whole sample, its reference
against training mode over the whole sample in one batch, the normalisation batches against
hand arithmetic, a checkpoint's test numbers against the training run's own, and the script,
resnet50 on an image folder and a bad input end to end."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY
from helpers import assert_one_line_error
from PIL import Image
from torch import nn

from syncbn_lab import models
from syncbn_lab.bn_noise import (
    compose,
    layer_noise,
    normalization_batches,
    run,
    sample_layers,
)
from syncbn_lab.errors import ConfigError
from syncbn_lab.train import run as train

SCRIPT = str(ROOT / "scripts" / "bn_noise.py")
# the tool on TINY's synthetic data: 256 training images, the sample is all of them
SMALL = [*TINY, "noise.images=256", "trainer.threads=1", "trainer.eval_batch_size=64"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is fastest, and much faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("batch,height,width", [(2, 1, 1), (4, 4, 4), (16, 2, 3)])
def test_iid_gaussian_input_to_one_bn_layer_follows_the_sampling_formulas(batch, height, width):
    torch.manual_seed(0)
    images, mu = 4096, torch.tensor([0.0, 3.0, -1.0, 0.5]).view(1, 4, 1, 1)
    sigma = torch.tensor([1.0, 2.0, 0.5, 3.0]).view(1, 4, 1, 1)
    x = mu + sigma * torch.randn(images, 4, height, width)
    (sample,) = sample_layers(nn.Sequential(nn.BatchNorm2d(4)), lambda: x.split(512), 1)
    noise = layer_noise(sample, batch)
    n, total = batch * height * width, images * height * width  # values per group, per sample
    draws = images // batch * 4  # groups x channels: the estimates' sample size
    # a group's mean against the sample's, in units of sigma: variance 1/n - 1/total
    assert noise.mean_error**2 == pytest.approx(1 / n - 1 / total, rel=5 * math.sqrt(2 / draws))
    assert noise.effective_count == pytest.approx(n, rel=5 * math.sqrt(2 / draws))
    # a group's biased variance / sigma^2: chi-square of n - 1 degrees of freedom over n
    spread = math.sqrt(2 * (n - 1)) / n
    assert noise.var_bias == pytest.approx(-1 / n + 1 / total, abs=5 * spread / math.sqrt(draws))
    assert noise.var_error**2 == pytest.approx(spread**2 + 1 / n**2, rel=0.1)
    assert noise.noise == pytest.approx(math.hypot(noise.mean_error, noise.var_error / 2))


def tiny_resnet8() -> nn.Module:
    torch.manual_seed(1)
    return models.build(compose(["model.width=4"]).model, nn.BatchNorm2d, 3, 1)


def test_b_equal_to_the_whole_sample_gives_exactly_zero():
    model, x = tiny_resnet8(), torch.randn(96, 1, 8, 8)
    samples = sample_layers(model, lambda: x.split(32), 2)
    assert len(samples) == 9  # resnet8: a stem, two blocks of 2 and their shortcuts, a block of 2
    for sample in samples:
        whole, half = layer_noise(sample, 96), layer_noise(sample, 48)
        assert (whole.mean_error, whole.var_error, whole.var_bias) == (0.0, 0.0, 0.0)
        assert half.mean_error > 0 and half.var_error > 0


def test_the_reference_is_training_mode_over_the_whole_sample_in_one_batch():
    """One training-mode forward of all 96 images through torch's BatchNorm2d is the
    reference; a layer with k BN layers before it is exact from pass k + 1 on, and the chunks
    of 32 leave the others close."""
    model, x = tiny_resnet8(), torch.randn(96, 1, 8, 8) * 2 + 1
    inputs = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, args, name=name: inputs.setdefault(name, args[0]))
        for name, m in model.named_modules()
        if isinstance(m, nn.BatchNorm2d)
    ]
    with torch.no_grad():
        model.train()(x)
    for hook in hooks:
        hook.remove()
    expected = {k: (v.mean((0, 2, 3)), v.var((0, 2, 3), unbiased=False)) for k, v in inputs.items()}
    exact_after = {"stem.1": 1, "stages.0.bn1": 2, "stages.0.bn2": 3}
    for passes in (1, 3, 9):
        for sample in sample_layers(model, lambda: x.split(32), passes):
            mean = sample.sums.sum(0) / (96 * sample.positions)
            var = sample.squares.sum(0) / (96 * sample.positions) - mean**2
            want_mean, want_var = expected[sample.name]
            if passes >= exact_after.get(sample.name, 9):
                torch.testing.assert_close(mean.float(), want_mean, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(var.float(), want_var, rtol=1e-4, atol=1e-5)
            else:  # normalised with chunk statistics upstream: near, not equal
                assert not torch.allclose(var.float(), want_var, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(var.float(), want_var, rtol=0.15, atol=0.01)


def test_the_normalisation_batches_of_the_run_s_settings():
    settings = ["trainer.global_batch_size=256", "parallel=emulated", "parallel.devices=128"]
    cfg = compose([*settings, "bn=sync", "bn.group_size=16", "noise.batches=[2,8]"])
    found = [(b.size, b.kinds) for b in normalization_batches(cfg)]
    assert found == [
        (2, ("per-device", "noise.batches")),  # 256 / 128
        (8, ("noise.batches",)),
        (32, ("SyncBN groups of 16", "this run (bn=sync)")),  # 2 x 16
        (256, ("SyncBN over 128",)),  # 2 x 128
    ]
    accumulated = compose([*settings[:2], "parallel.devices=8", "trainer.accumulate=2"])
    assert [(b.size, b.kinds) for b in normalization_batches(accumulated)] == [
        (16, ("per-device", "this run (bn=bn)")),  # 256 / 8 / 2
        (128, ("SyncBN over 8",)),
    ]


def test_a_checkpoint_gives_the_training_run_s_test_numbers(tmp_path):
    settings = [*SMALL, "parallel=emulated", "parallel.devices=4", "trainer.max_steps=3"]
    summary = train(compose([*settings, "trainer.eval_batch_stats=true"]), tmp_path / "run")
    cfg = compose([*settings, f"noise.checkpoint={tmp_path / 'run'}", "noise.shuffle=false"])
    result = run(cfg, tmp_path / "noise")
    assert result["source"].endswith("step 3)")
    running = result["reference"]["running statistics"]
    assert running["test_error"] == pytest.approx(100 - summary["test_acc"], abs=1e-9)
    assert running["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-5)
    (own,) = [row for row in result["summary"] if "this run" in row["kinds"]]
    assert own["batch"] == summary["normalization_batch_size"] == 8
    assert own["test_error"] == pytest.approx(100 - summary["test_acc_batch_stats"], abs=1e-9)
    assert own["test_loss"] == pytest.approx(summary["test_loss_batch_stats"], rel=1e-5)
    wider = compose([*settings, "model.width=8", f"noise.checkpoint={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"trained with model.width=4, this config has model.w"):
        run(wider, tmp_path / "wider")


def test_the_script_writes_one_row_per_layer_and_b_and_their_summary(tmp_path):
    args = [*SMALL, "noise.batches=[2,256]", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"^stages\.2\.shortcut\.1 +16 +4 ", done.stdout, re.M)  # the layer table
    with open(tmp_path / "layers.csv") as f:
        layers = list(csv.DictReader(f))
    with open(tmp_path / "summary.csv") as f:
        summary = {int(row["batch"]): row for row in csv.DictReader(f)}
    assert sorted(summary) == [2, 32, 256]  # per-device = this run: 32; synced on 1 device: 32
    assert summary[32]["kinds"] == "per-device, SyncBN over 1, this run (bn=bn)"
    for batch, row in summary.items():
        noise = [float(r["noise"]) for r in layers if int(r["batch"]) == batch]
        assert len(noise) == 9
        assert float(row["noise"]) == pytest.approx(float(np.sqrt(np.mean(np.square(noise)))))
        assert 0 <= float(row["test_error"]) <= 100
    assert float(summary[256]["noise"]) == 0.0 < float(summary[32]["noise"])
    assert float(summary[32]["noise"]) < float(summary[2]["noise"])
    result = json.loads((tmp_path / "bn_noise.json").read_text())
    assert result["first_layers"] == ["stem.1", "stages.0.bn1", "stages.0.bn2"]  # 8 x 8 inputs


def test_a_normalisation_batch_beyond_the_sample_is_one_line_before_any_work(tmp_path):
    args = [*SMALL, "noise.batches=[512]", f"hydra.run.dir={tmp_path / 'out'}"]
    done = subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120
    )
    assert_one_line_error(done, "b=512 (noise.batches) exceeds the sample of noise.images=256")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override,message",
    [
        ("noise.images=0", "noise.images=0 must be a positive integer"),
        ("noise.batches=4", "noise.batches=4 must be a list"),
        ("noise.checkpoint=/nonexistent", "noise.checkpoint=/nonexistent: no checkpoint at"),
        ("noise.images=300", "noise.images=300 exceeds the 256 training images"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        run(compose([*SMALL, override]), tmp_path)


def write_image_folder(root: Path) -> None:
    """Two classes of random RGB images of various sizes in train, val and test."""
    rng = np.random.default_rng(0)
    for split in ("train", "val", "test"):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for k in range(8):
                shape = (10 + k, 12, 3)
                Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(
                    root / split / label / f"{k}.png"
                )


def test_torchvision_resnet50_on_an_image_folder(tmp_path):
    write_image_folder(tmp_path / "images")
    cfg = compose(
        [
            "data=imagefolder",
            f"data.root={tmp_path / 'images'}",
            "data.image_size=8",
            "model=resnet50",
            "trainer.global_batch_size=8",
            "parallel=emulated",
            "parallel.devices=4",
            "noise.images=16",
            "noise.passes=2",
            "trainer.threads=1",
        ]
    )
    result = run(cfg, tmp_path / "out")
    rows = [r for r in result["layers"] if r["batch"] == 2]
    assert len(rows) == 53  # resnet50's BN layers
    # the small-input stem keeps 8 x 8 up to layer2's first 3x3 (torchvision strides there):
    # the stem's BN, layer1's 9 and its downsample's, layer2.0.bn1
    first = result["first_layers"]
    assert len(first) == 12 and (first[0], first[4], first[-1]) == (
        "bn1",
        "layer1.0.downsample.1",
        "layer2.0.bn1",
    )
    assert all(math.isfinite(r["noise"]) and r["noise"] > 0 for r in rows)
    assert [r["batch"] for r in result["summary"]] == [2, 8]  # per-device, synced x4


def test_every_key_of_its_config_is_documented():
    path = ROOT / "configs" / "bn_noise.yaml"
    keys = [line for line in path.read_text().splitlines() if re.match(r"\s*[\w.]+:", line)]
    assert len(keys) >= 10
    for line in keys:
        if not line.rstrip().endswith(":"):  # a mapping's header needs none
            assert re.search(r"\S  # \S", line), f"undocumented: {line!r}"
    assert set(compose().noise) == {
        "batches", "images", "passes", "test_images", "checkpoint", "seed", "shuffle"
    }  # fmt: skip
