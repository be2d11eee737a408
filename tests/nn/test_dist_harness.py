"""syncbn_lab.parallel.gloo_jobs.run_distributed: results by rank, and failures fail fast,
never hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from syncbn_lab.parallel.gloo_jobs import DistributedJobError, run_distributed

CASES = Path(__file__).with_name("syncbn_dist_cases.py")


def test_results_come_back_ordered_by_rank():
    assert run_distributed(f"{CASES}:echo_rank", 3) == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]


def test_an_exception_on_one_rank_fails_the_job_quickly():
    start = time.monotonic()
    with pytest.raises(DistributedJobError, match="deliberate failure on rank 1"):
        run_distributed(f"{CASES}:fail_on_rank_1", 2, timeout_s=50, pg_timeout_s=40)
    assert time.monotonic() - start < 30  # reported at once, not after the collective timeout
