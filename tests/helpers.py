"""Test-only references and measures shared by the test modules (``from helpers import``)."""

from __future__ import annotations

from typing import Any

from syncbn_lab.run_compare import float64_pair


def torch_batchnorm_class(input_dim: int) -> type:
    """The torch.nn BatchNorm class for a 2-D to 5-D input (the independent reference)."""
    import torch

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
