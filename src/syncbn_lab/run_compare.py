"""Run the real CLI and measure how far two runs are apart (the per-step training loss and
every tensor of checkpoints/last.pt): what scripts/prove_exactness.py and the exactness
tests compare."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def float64_pair(actual: Any, expected: Any) -> tuple[Any, Any]:
    """Both as float64 tensors of one shape (AssertionError if the shapes differ); Python
    numbers become float64 directly (torch.as_tensor would round them to float32 first)."""
    import torch

    def as_float64(x: Any) -> Any:
        return x.detach().double() if torch.is_tensor(x) else torch.tensor(x, dtype=torch.float64)

    actual, expected = as_float64(actual), as_float64(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    return actual, expected


def train_cli(script: Path, overrides: list[str], run_dir: Path, timeout_s: float = 1800.0) -> Path:
    """Run ``script`` (scripts/train.py, the real CLI) with ``overrides`` into ``run_dir``;
    returns ``run_dir``, or raises RuntimeError with the end of its stderr if the run fails."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(
        [sys.executable, str(script), *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"train.py {' '.join(overrides)} exited with {result.returncode}:\n"
            f"{result.stderr[-3000:]}"
        )
    return Path(run_dir)


def _relative(actual: Any, expected: Any) -> float:
    """max |actual - expected| / max |expected| (the absolute difference where expected is
    all zeros), in float64: a normwise relative difference that zeros cannot blow up."""
    a, b = float64_pair(actual, expected)
    if a.numel() == 0:
        return 0.0
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def checkpoint_tensors(run_dir: Path) -> dict[str, Any]:
    """Every tensor of ``checkpoints/last.pt`` that training produced: the model's state and
    the optimizer's per-parameter state (e.g. SGD momentum buffers)."""
    import torch

    state = torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=True)
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    for index, per_param in state["optimizer"]["state"].items():
        for name, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{index}.{name}"] = value
    return tensors


def _train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss of the per-step records of ``metrics.jsonl``; the end-of-epoch
    records (whose ``epoch`` is an int, not a fraction of epochs) are left out."""
    import json

    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    return {r["step"]: r["train/loss"] for r in records if isinstance(r["epoch"], float)}


def run_difference(run_a: Path, run_b: Path, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """How far two training runs are apart: the worst relative difference of the per-step
    training loss (``loss``, over steps; ``loss_step`` is where), and of the tensors of
    ``checkpoints/last.pt`` (``checkpoint``, normwise per tensor; ``checkpoint_tensor``).

    Tensors whose name ends with one of ``leave_out`` (e.g. ``running_mean``) are not part of
    ``checkpoint``; ``left_out`` holds, for each of those endings, the worst relative
    difference of its tensors. Runs that logged different steps or saved different tensors
    raise AssertionError.
    """
    losses_a, losses_b = _train_losses(run_a), _train_losses(run_b)
    if sorted(losses_a) != sorted(losses_b) or not losses_a:
        raise AssertionError(f"logged steps differ: {sorted(losses_a)} vs {sorted(losses_b)}")
    loss = {step: _relative(losses_a[step], losses_b[step]) for step in losses_a}
    tensors_a, tensors_b = checkpoint_tensors(run_a), checkpoint_tensors(run_b)
    if sorted(tensors_a) != sorted(tensors_b):
        raise AssertionError(f"checkpoint tensors differ: {sorted(tensors_a ^ tensors_b)}")
    tensors = {name: _relative(tensors_a[name], tensors_b[name]) for name in tensors_a}
    left_out = {
        ending: max(d for name, d in tensors.items() if name.endswith(ending))
        for ending in leave_out
    }
    tensors = {name: d for name, d in tensors.items() if not name.endswith(tuple(leave_out))}
    loss_step = max(loss, key=loss.get)
    worst_tensor = max(tensors, key=tensors.get)
    return {
        "loss": loss[loss_step],
        "loss_step": loss_step,
        "loss_by_step": [loss[step] for step in sorted(loss)],
        "checkpoint": tensors[worst_tensor],
        "checkpoint_tensor": worst_tensor,
        "tensors": len(tensors),
        "worst": max(loss[loss_step], tensors[worst_tensor]),
        **({"left_out": left_out} if leave_out else {}),
    }
