"""SyncBatchNorm on real gloo ranks (CPU) against float64 torch BatchNorm on the full batch.

One spawned job per world size runs every case of ``syncbn_dist_cases.py`` in one process
group (process start-up dominates the cost); the tests below assert on its results. The
scaling of the compared gradients is documented at the top of that file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from syncbn_lab.parallel.gloo_jobs import run_distributed

CASES = f"{Path(__file__).with_name('syncbn_dist_cases.py')}:run_all"
WORLD_SIZES = (2, 3, 4)
_results: dict[int, list[dict]] = {}


def results(world_size: int) -> list[dict]:
    """Per-rank results of the job for ``world_size`` (run once, on first use)."""
    if world_size not in _results:
        _results[world_size] = run_distributed(CASES, world_size, timeout_s=55, pg_timeout_s=20)
    return _results[world_size]


def case(world_size: int, name: str) -> list:
    per_rank = [r[name] for r in results(world_size)]
    for rank, value in enumerate(per_rank):
        if isinstance(value, dict) and "exception" in value:
            pytest.fail(f"case {name} raised on rank {rank}:\n{value['exception']}")
    return per_rank


def assert_matches(world_size: int, name: str) -> None:
    for rank, worst in enumerate(case(world_size, name)):
        bad = {q: e for q, e in worst.items() if e > 1.0}
        assert not bad, f"{name}, rank {rank}: error ratios above 1: {bad}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("split", ["equal", "uneven", "one_empty"])
def test_matches_full_batch_float64_batchnorm(world_size, split):
    """Outputs, input grads, DDP-averaged weight/bias grads, running stats within 1e-5."""
    assert_matches(world_size, f"match_{split}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_momentum_none_cumulative_average(world_size):
    assert_matches(world_size, "match_momentum_none")


@pytest.mark.parametrize(
    "name",
    [
        "match_channels_last",
        "match_5d_channels_last_3d",
        "match_3d",
        "match_2d",
        "match_bf16",
        "match_fp16",
    ],
)
def test_layouts_dims_and_half_types_two_ranks(name):
    assert_matches(2, name)


@pytest.mark.parametrize(
    "name",
    [
        "subgroup_group_size_2",
        "subgroup_process_group",
        "devices_2_global",
        "devices_2_group_size_4",
        "devices_2_group_size_2",
    ],
)
def test_subgroups_and_emulated_devices_four_ranks(name):
    """group_size=2 / explicit groups equal BN within each pair; devices compose with ranks."""
    assert_matches(4, name)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_input_raises_on_every_rank(world_size):
    for rank, out in enumerate(case(world_size, "errors")):
        assert "channels" in out["wrong_channels"], (rank, out)
        assert "more than 1 value per channel" in out["single_value"], (rank, out)
        assert out["group_still_usable"] == world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_one_collective_per_direction_and_none_in_eval(world_size):
    channels = 3
    for rank, out in enumerate(case(world_size, "collectives")):
        # Two layers: one all_reduce each per direction, payload independent of world size.
        forward = [("all_reduce", 2 * channels + 1, "torch.float64")] * 2
        backward = [("all_reduce", 2 * channels, "torch.float32")] * 2
        assert out["train_forward"] == forward, rank
        assert out["train_backward"] == backward, rank
        assert out["eval_forward_backward"] == [], rank


def test_subgroup_for_caches_and_checks():
    for rank, out in enumerate(case(4, "subgroup_api")):
        assert out["cached"] is True
        assert out["pair_size"] == 2 and out["pair_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert "does not divide the world size 4" in out["non_divisor"]
        assert "not a member" in out["not_member"]
