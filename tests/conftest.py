"""Shared fixtures: configs composed exactly as scripts/train.py composes them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from syncbn_lab.config import CONFIG_DIR as _CONFIG_DIR
from syncbn_lab.config import compose as compose_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = str(_CONFIG_DIR)

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
