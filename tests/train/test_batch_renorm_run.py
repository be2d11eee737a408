"""bn=brn end to end: the schedule's batch counter survives a resume bit for bit, and every
summary names its normalisation batch."""

from __future__ import annotations

import json

import torch

from syncbn_lab.engine import checkpoint
from syncbn_lab.train import run


def test_brn_resume_is_bitwise_identical(tmp_path, tiny_cfg):
    # 8 steps per epoch. The limits jump from (1, 0) to their final values after batch 4 in
    # both the 2-epoch runs (warmup 0.25 of 16) and the 1-epoch run (0.5 of 8), so the first
    # run is the first half of the full one; the resumed run is past the warm-up only if the
    # batch counter comes back from the checkpoint.
    constant = ("sched=step", "sched.milestones=[]", "bn=brn", "bn.ramp=0", "bn.rmax=1.5")
    full = run(tiny_cfg("trainer.epochs=2", "bn.warmup=0.25", *constant), tmp_path / "full")
    run(tiny_cfg("trainer.epochs=1", "bn.warmup=0.5", *constant), tmp_path / "first")
    resumed = run(
        tiny_cfg("trainer.epochs=2", "bn.warmup=0.25", *constant,
                 f"trainer.resume={tmp_path / 'first'}"),
        tmp_path / "second",
    )  # fmt: skip
    assert resumed["steps"] == full["steps"] == 16
    a = checkpoint.load(tmp_path / "full" / "checkpoints" / "last.pt")["model"]
    b = checkpoint.load(tmp_path / "second" / "checkpoints" / "last.pt")["model"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    counters = [v for k, v in a.items() if k.endswith("num_batches_tracked")]
    assert counters and all(int(c) == 16 for c in counters)
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["normalization_batch_size"] == 32 and summary["bn"] == "brn"


def test_summary_normalization_batch_size(tmp_path, tiny_cfg):
    summary = run(
        tiny_cfg("parallel=emulated", "parallel.devices=4", "trainer.max_steps=1"), tmp_path
    )
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert summary["normalization_batch_size"] == saved["normalization_batch_size"] == 8
