"""The proof: one process emulating N devices computes what N real gloo DDP ranks compute.

Same seed, same data order, float64 (in float32 the trajectory is chaotic, so only float64
can separate semantics from summation order; reports/exactness/ states the float32 noise
floor): the loss at every one of 20 steps and every tensor of the final checkpoint (weights
and BN running statistics) agree to 1e-9 relative, for per-device BN and for SyncBN, at
N = 2 and 4, and for Batch Renormalization at N = 2, each with its preflight check. The
N = 4 per-device BN
case also runs gradient accumulation (DDP's no_sync), dist_bn=reduce and PreciseBN on both
sides; the Batch Renormalization case dist_bn=reduce and PreciseBN.
"""

import json

import pytest
from conftest import TINY, compose_config
from parallel_helpers import assert_same_run

from syncbn_lab.train import run

STEPS = 20
COMMON = [*TINY, f"trainer.max_steps={STEPS}", "trainer.epochs=3", "trainer.precision=fp64"]
RTOL = 1e-9

CASES = {
    "n2-bn": ["bn=bn", "parallel.devices=2"],
    "n2-sync": ["bn=sync", "parallel.devices=2"],
    "n4-bn-accumulate-reduce-precise": [
        "bn=bn",
        "parallel.devices=4",
        "trainer.accumulate=2",
        "trainer.global_batch_size=64",
        "data.num_train=512",
        "parallel.dist_bn=reduce",
        "trainer.precise_bn_batches=3",
    ],
    "n4-sync": ["bn=sync", "parallel.devices=4"],
    # Batch Renormalization with r and d free from step 6 on (warm-up 2 batches, ramp 4)
    "n2-brn-reduce-precise": [
        "bn=brn",
        "parallel.devices=2",
        "bn.warmup=0.1",
        "bn.ramp=0.2",
        "bn.rmax=1.5",
        "bn.dmax=0.5",
        "parallel.dist_bn=reduce",
        "trainer.precise_bn_batches=3",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_equals_gloo_ddp(tmp_path, case):
    overrides = [*COMMON, *CASES[case]]
    ddp = run(compose_config(["parallel=ddp", *overrides]), tmp_path / "ddp")
    emulated = run(compose_config(["parallel=emulated", *overrides]), tmp_path / "emulated")
    assert ddp["steps"] == emulated["steps"] == STEPS
    for checked in (ddp, emulated):  # the preflight check ran (each rank its own replica)
        assert checked["preflight_error"] <= checked["preflight_tolerance"] == 1e-6
    assert_same_run(tmp_path / "emulated", tmp_path / "ddp", STEPS, rtol=RTOL)
    for key in ("test_acc", "val_acc"):
        assert emulated[key] == pytest.approx(ddp[key], abs=1e-9), key
    assert emulated["test_loss"] == pytest.approx(ddp["test_loss"], rel=RTOL)
    if "trainer.precise_bn_batches=3" in overrides:
        assert_same_run(
            tmp_path / "emulated", tmp_path / "ddp", STEPS, rtol=RTOL, ckpt="last_precise_bn.pt"
        )
        saved = json.loads((tmp_path / "ddp" / "summary.json").read_text())
        assert "test_acc_precise_bn" in saved
        assert emulated["test_loss_precise_bn"] == pytest.approx(
            ddp["test_loss_precise_bn"], rel=RTOL
        )
    # rank 0 alone wrote, into the one run dir
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == sorted(
        p.name for p in (tmp_path / "emulated").iterdir()
    )
