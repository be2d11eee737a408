"""trainer.precision=fp64: parameters, buffers, data and every norm path in float64, with the
usual run dir; the norm implementations then agree to ~1e-15 where float32 leaves ~1e-6."""

import pytest
import torch
from omegaconf import OmegaConf

from syncbn_lab.data import InMemoryImageDataset
from syncbn_lab.engine import checkpoint
from syncbn_lab.run_compare import run_difference
from syncbn_lab.train import run

FP64 = ("trainer.precision=fp64", "trainer.max_steps=4")


def floating_dtypes(run_dir):
    state = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    tensors = list(state["model"].values())
    tensors += [v for s in state["optimizer"]["state"].values() for v in s.values()]
    return {t.dtype for t in tensors if torch.is_tensor(t) and t.is_floating_point()}


def test_fp64_run_has_the_usual_outputs_in_float64_and_resumes_bitwise(tmp_path, tiny_cfg):
    constant = ("sched=step", "sched.milestones=[]")  # the lr does not depend on the run length
    emulated = ("bn=sync", "parallel=emulated", "parallel.devices=2", *constant)
    full = run(tiny_cfg(*emulated, "trainer.precision=fp64", "trainer.epochs=2"), tmp_path / "a")
    run(tiny_cfg(*emulated, "trainer.precision=fp64", "trainer.epochs=1"), tmp_path / "first")
    resume = f"trainer.resume={tmp_path / 'first'}"
    resumed = run(
        tiny_cfg(*emulated, "trainer.precision=fp64", "trainer.epochs=2", resume), tmp_path / "b"
    )
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints/best.pt"):
        assert (tmp_path / "a" / name).exists(), name
    assert OmegaConf.load(tmp_path / "a" / "config.yaml").trainer.precision == "fp64"
    assert floating_dtypes(tmp_path / "a") == {torch.float64}
    assert floating_dtypes(tmp_path / "b") == {torch.float64}
    assert resumed["steps"] == full["steps"] and resumed["test_loss"] == full["test_loss"]
    a = checkpoint.load(tmp_path / "a" / "checkpoints" / "last.pt")["model"]
    b = checkpoint.load(tmp_path / "b" / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize(
    "overrides",
    [
        ["bn=bn", "parallel=emulated", "parallel.devices=2"],  # this project's BatchNorm
        ["bn=gn", "bn.groups=2"],  # torch's GroupNorm
    ],
)
def test_every_floating_tensor_of_a_fp64_run_is_float64(tmp_path, tiny_cfg, overrides):
    # float32 images into float64 convolutions would raise: the data is float64 too
    run(tiny_cfg(*overrides, *FP64), tmp_path)
    assert floating_dtypes(tmp_path) == {torch.float64}


def test_norm_implementations_agree_in_fp64_and_not_in_fp32(tmp_path, tiny_cfg):
    # torch's BatchNorm2d (bn=bn, one device) against SyncBatchNorm over one emulated device,
    # reference and fused: the same arithmetic in exact terms, 4 training steps
    one_device = ("parallel=emulated", "parallel.devices=1")
    runs = {}
    for precision in ("fp64", "fp32"):
        for name, overrides in {
            "torch": ["bn=bn"],
            "reference": [
                "bn=sync",
                "bn.impl=reference",
                "parallel=emulated",
                "parallel.devices=1",
            ],
            "fused": ["bn=sync", "bn.impl=fused", *one_device],
        }.items():
            run_dir = tmp_path / f"{precision}_{name}"
            run(
                tiny_cfg(*overrides, f"trainer.precision={precision}", "trainer.max_steps=4"),
                run_dir,
            )
            runs[precision, name] = run_dir
    for impl in ("reference", "fused"):
        fp64 = run_difference(runs["fp64", impl], runs["fp64", "torch"])
        fp32 = run_difference(runs["fp32", impl], runs["fp32", "torch"])
        assert fp64["worst"] < 1e-12, (impl, fp64)
        assert fp32["worst"] > 1e-8, (impl, fp32)  # float32 rounding is visible: fp64 is real


def test_a_float64_dataset_normalises_in_float64():
    images = torch.arange(256, dtype=torch.uint8).view(4, 1, 8, 8)
    dataset = InMemoryImageDataset(images, torch.zeros(4), mean=(0.1307,), std=(0.3081,))
    expected = (images.double() / 255.0 - 0.1307) / 0.3081
    assert dataset.batch([0, 1, 2, 3])[0].dtype == torch.float32
    assert (dataset.batch([0, 1, 2, 3])[0].double() - expected).abs().max() > 1e-9
    dataset.set_dtype(torch.float64)
    out, _ = dataset.batch([0, 1, 2, 3])
    assert out.dtype == torch.float64
    assert (out - expected).abs().max() < 1e-14
