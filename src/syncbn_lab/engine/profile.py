"""Where a training step's time goes: a ``trainer.callbacks`` entry that profiles some steps.

    trainer.callbacks=[{_target_:syncbn_lab.engine.profile.StepProfiler,start:20,steps:40,out:prof.json}]

Runs torch.profiler on rank 0 from the end of optimizer step ``start`` to the end of step
``start + steps`` (so the next steps' data loading is inside) and writes ``out``: the
milliseconds per step of each category of :data:`CATEGORIES` (self CPU time of the operators
in it) and of the loop's phases (``Trainer`` marks data, forward, backward and optimizer
with ``record_function``), plus the operators that take the most time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

PHASES = ("data", "forward", "backward", "optimizer")
"""The loop's record_function ranges (engine/loop.py)."""

CATEGORIES = {  # category -> operator names (self time); the rest is "other"
    "convolution, forward": ("aten::mkldnn_convolution", "aten::_convolution_pointwise"),
    "convolution, backward": ("aten::convolution_backward",),
    "matmul (classifier)": ("aten::addmm", "aten::mm"),
    "norm kernels (syncbn_lab._C)": ("syncbn_lab::",),
    "norm, torch ops": ("aten::native_batch_norm", "aten::native_group_norm",
                        "aten::native_group_norm_backward", "aten::native_batch_norm_backward",
                        "aten::_batch_norm_with_update", "aten::batch_norm_backward"),
    "ReLU and residual add": ("aten::relu", "aten::clamp_min", "aten::threshold_backward",
                              "aten::add", "aten::add_"),
    "dtype and layout copies": ("aten::copy_", "aten::_to_copy", "aten::clone",
                                "aten::contiguous"),
}  # fmt: skip


def categorise(name: str) -> str:
    for category, prefixes in CATEGORIES.items():
        if any(name == p or (p.endswith("::") and name.startswith(p)) for p in prefixes):
            return category
    return "other"


def summarise(events, steps: int, top: int = 12) -> dict[str, Any]:
    """ms per step of each category, each phase and the ``top`` operators, from
    ``profiler.key_averages()``."""
    categories: dict[str, float] = {}
    operators: dict[str, float] = {}
    phases: dict[str, float] = {}
    total = 0.0
    for event in events:
        if event.key in PHASES:
            phases[event.key] = event.cpu_time_total / 1e3 / steps
            continue
        ms = event.self_cpu_time_total / 1e3 / steps
        total += ms
        category = categorise(event.key)
        categories[category] = categories.get(category, 0.0) + ms
        operators[event.key] = ms
    ranked = sorted(operators.items(), key=lambda kv: -kv[1])[:top]
    return {
        "ms_per_step": total,
        "categories_ms_per_step": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "phases_ms_per_step": {p: phases.get(p, 0.0) for p in PHASES},
        "top_operators_ms_per_step": dict(ranked),
        "steps": steps,
    }


class StepProfiler:
    """A training callback: profile steps ``start + 1 .. start + steps`` and write ``out``."""

    def __init__(self, start: int, steps: int, out: str):
        self.start, self.steps, self.out = int(start), int(steps), Path(out)
        self.profiler: torch.profiler.profile | None = None

    def __call__(self, trainer: Any) -> None:
        if trainer.rt.rank != 0:
            return
        step = trainer.state.step
        if step == self.start:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.start()
        elif step == self.start + self.steps and self.profiler is not None:
            self.profiler.stop()
            summary = summarise(self.profiler.key_averages(), self.steps)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(summary, indent=1) + "\n")
            self.profiler = None
