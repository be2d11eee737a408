"""Test-only references and measures shared by the test modules (``from helpers import``)."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from syncbn_lab.run_compare import float64_pair

# ONEDNN_MAX_CPU_ISA=AVX2 in a child's environment makes oneDNN take its AVX2 kernels
needs_avx2 = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64")
    or torch.backends.cpu.get_cpu_capability() == "DEFAULT",
    reason="ONEDNN_MAX_CPU_ISA=AVX2 selects oneDNN's AVX2 kernels only on an x86 CPU with AVX2",
)

# the environment of such a child
AVX2_ENV = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def run_avx2(args: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """``python *args`` on oneDNN's AVX2 kernels, its output captured; None where it ran past
    ``timeout`` seconds. A child that reaches the broken strided 1x1 kernel (oneDNN issue 6035)
    writes past its workspace: the heap it corrupts ends it in an abort or, on some machines
    (a 2-core AMD EPYC), in a process that never returns."""
    try:
        return subprocess.run(
            [sys.executable, *args], env=AVX2_ENV, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None


TRAIN = str(Path(__file__).resolve().parents[1] / "scripts" / "train.py")
DATA_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "data"


def data_cfg(name: str, **overrides: Any):
    """configs/data/<name>.yaml with ``overrides`` merged in (no Hydra needed)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(OmegaConf.load(DATA_CONFIGS / f"{name}.yaml"), overrides)


def train_cli(*args: str, cwd: Any = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python scripts/train.py *args`` as a user runs it; its output captured."""
    return subprocess.run(
        [sys.executable, TRAIN, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit status 2 and one line on stderr, ``error: ...``, holding every fragment."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def torch_batchnorm_class(input_dim: int) -> type:
    """The torch.nn BatchNorm class for a 2-D to 5-D input (the independent reference)."""

    classes = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d}
    classes |= {4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
    return classes[input_dim]


def error_ratio(actual: Any, expected: Any, atol: float = 1e-5, rtol: float = 1e-5) -> float:
    """max |actual - expected| / (atol + rtol * |expected|) in float64; <= 1 means close."""
    actual, expected = float64_pair(actual, expected)
    if actual.numel() == 0:
        return 0.0
    ratio = (actual - expected).abs() / (atol + rtol * expected.abs())
    return float(ratio.nan_to_num(nan=float("inf")).max())


def as_in_a_terminal() -> None:
    """``preexec_fn`` of a child the test stops with Ctrl-C (SIGINT): SIGINT at its default,
    as a terminal leaves it. A shell that starts the test suite as a background job without
    job control ignores SIGINT, and the child would inherit that and never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def live_members(group: int) -> list[str]:
    """``ps`` lines (state, command) of the processes of a process group that still run (a
    zombie has ended)."""
    ps = ["ps", "-o", "stat=,args=", "-g", str(group)]
    listed = subprocess.run(ps, capture_output=True, text=True).stdout.splitlines()
    return [line for line in listed if not line.startswith("Z")]


def markdown_table(text: str, head: str) -> list[list[str]]:
    """The body rows of the markdown table in ``text`` whose header line starts with ``head``,
    each as its stripped cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows
