"""Shared by the tests of tests/parallel: run comparisons and process checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from syncbn_lab.engine import checkpoint


def step_losses(run_dir: Path) -> list[float]:
    """train/loss of every logged step record (trainer.log_every=1), in order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "val/acc" not in r]


def max_relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the scale of b (max |b|): 0 for equal tensors."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def assert_same_run(a: Path, b: Path, steps: int, rtol: float = 1e-5, ckpt: str = "last.pt"):
    """Losses at every step and every tensor of the final checkpoint agree within rtol."""
    la, lb = step_losses(a), step_losses(b)
    assert len(la) == len(lb) == steps, (len(la), len(lb))
    for step, (x, y) in enumerate(zip(la, lb, strict=True), start=1):
        assert abs(x - y) <= rtol * abs(y), f"step {step}: loss {x} vs {y}"
    sa = checkpoint.load(a / "checkpoints" / ckpt)["model"]
    sb = checkpoint.load(b / "checkpoints" / ckpt)["model"]
    assert sa.keys() == sb.keys()
    for key in sa:
        if sa[key].is_floating_point():
            diff = max_relative_difference(sa[key], sb[key])
            assert diff <= rtol, f"{ckpt}:{key} differs by {diff:.2e} (relative)"
        else:
            assert torch.equal(sa[key], sb[key]), key


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def processes_with_env(marker: str) -> list[int]:
    """Live processes (other than this one) whose environment holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in environ and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def assert_running_stats_are_population_stats(model, captured) -> None:
    """Every BN layer's running statistics equal the (unbiased) variance and the mean of all
    inputs captured for it: what PreciseBN must recompute."""
    import torch

    layers = dict(model.named_modules())
    for name, inputs in captured.items():
        values = torch.cat(inputs).double().transpose(0, 1).reshape(inputs[0].shape[1], -1)
        var, mean = torch.var_mean(values, dim=1)
        torch.testing.assert_close(layers[name].running_mean.double(), mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layers[name].running_var.double(), var, rtol=1e-5, atol=1e-6)
