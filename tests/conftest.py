"""Shared fixtures: configs composed exactly as scripts/train.py composes them."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from syncbn_lab.config import CONFIG_DIR as _CONFIG_DIR
from syncbn_lab.config import compose as compose_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = str(_CONFIG_DIR)

# Hypothesis (tests/train/test_config_fuzz.py): the suite's run is bounded and repeatable (a
# fixed seed, no example database in the checkout); --hypothesis-profile=fuzz, or
# HYPOTHESIS_PROFILE=fuzz, draws 20,000 examples with a new seed each time.
with contextlib.suppress(ImportError):
    from hypothesis import settings

    settings.register_profile(
        "suite", max_examples=300, derandomize=True, database=None, deadline=None
    )
    settings.register_profile("fuzz", max_examples=20_000, database=None, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# A run small enough for a unit test: synthetic data, a narrow resnet8, local files only.
TINY = [
    "data=synthetic",
    "data.num_train=256",
    "data.num_val=64",
    "data.num_test=64",
    "model.width=4",
    "logger=none",
    "trainer.global_batch_size=32",
    "trainer.log_every=1",
]


@pytest.fixture
def tiny_cfg():
    """A function returning the tiny config with extra overrides applied."""
    return lambda *overrides: compose_config([*TINY, *overrides])
