"""The timing harness of every benchmark in scripts/bench_*.py.

A benchmark compares things side by side in one run. Each thing is a *sampler*: a function
that runs it and returns one sample (a time, or a rate such as images/s). :meth:`Timing.measure`
calls every sampler ``warmup`` times unrecorded, then ``rounds`` times interleaved (a, b, c,
a, b, c, ...), so load that comes and goes on a shared machine hits every column alike.

Per column the figure is the ``min`` over rounds (other jobs only ever add time, so the
fastest round estimates the uncontended cost) or the ``median``; a ratio of two columns is
the ratio of their minima, or the median of the per-round ratios (each round's pair ran back
to back). :func:`write_json` writes the records with the commit, machine and software
(:mod:`syncbn_lab.provenance`) and these timing settings.

Also here: the two forms of a BatchNorm layer that the CPU and GPU benchmarks both time
(:func:`fwd_bwd`, a training step; :class:`FusedOp`, the bare fused op).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from syncbn_lab import provenance

Sampler = Callable[[], float]
Key = TypeVar("Key", bound=Hashable)
STATS = ("min", "median")


def per_call_ms(
    run: Callable[[], object], inner: int = 1, clock: Callable[[], float] = time.perf_counter
) -> Sampler:
    """A sampler: milliseconds per call of ``run`` over ``inner`` calls in a row, by ``clock``
    (seconds; ``time.thread_time`` counts only this thread's CPU time)."""

    def sample() -> float:
        start = clock()
        for _ in range(inner):
            run()
        return (clock() - start) * 1e3 / inner

    return sample


def cuda_per_call_ms(run: Callable[[], object], inner: int = 1) -> Sampler:
    """A sampler: milliseconds per call of ``run`` by CUDA events on the current stream,
    started after the GPU has drained."""

    def sample() -> float:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner

    return sample


@dataclass(frozen=True)
class Rounds(Generic[Key]):
    """The samples of each column, one per round in the order measured."""

    samples: dict[Key, list[float]]
    stat: str

    def value(self, key: Key) -> float:
        """The column's figure: its min or median over rounds."""
        pick = min if self.stat == "min" else statistics.median
        return pick(self.samples[key])

    def values(self) -> dict[Key, float]:
        """Every column's figure."""
        return {key: self.value(key) for key in self.samples}

    def ratio(self, key: Key, baseline: Key) -> float:
        """``key`` over ``baseline``: the ratio of the minima, or the median of the per-round
        ratios (the two ran back to back in each round, so a busier machine slows both)."""
        if self.stat == "min":
            return self.value(key) / self.value(baseline)
        pairs = zip(self.samples[key], self.samples[baseline], strict=True)
        return statistics.median(a / b for a, b in pairs)


@dataclass(frozen=True)
class Timing:
    """How a benchmark measures: recorded rounds, unrecorded warm-up calls of each sampler
    before them, and the statistic of a column ("min" for times; rates take "median")."""

    rounds: int
    warmup: int = 1
    stat: str = "min"

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.warmup < 0:
            raise ValueError(f"need rounds >= 1 and warmup >= 0, got {self.rounds}, {self.warmup}")
        if self.stat not in STATS:
            raise ValueError(f"stat must be one of {STATS}, got {self.stat!r}")

    def measure(
        self,
        samplers: Mapping[Key, Sampler],
        before: Callable[[], object] | None = None,
        on_sample: Callable[[int, Key, float], object] | None = None,
    ) -> Rounds[Key]:
        """Warm up every sampler, then sample them interleaved, round by round, in the
        mapping's order. ``before`` runs before every call (a barrier between ranks);
        ``on_sample(round, key, value)`` sees each recorded sample (progress lines)."""
        for sampler in samplers.values():
            for _ in range(self.warmup):
                if before:
                    before()
                sampler()
        samples: dict[Key, list[float]] = {key: [] for key in samplers}
        for round_ in range(self.rounds):
            for key, sampler in samplers.items():
                if before:
                    before()
                samples[key].append(sampler())
                if on_sample:
                    on_sample(round_, key, samples[key][-1])
        return Rounds(samples, self.stat)

    def meta(self) -> dict[str, Any]:
        """The settings, for a JSON file's ``meta``."""
        return {"rounds": self.rounds, "warmup": self.warmup, "stat": self.stat}


def write_json(path: str | Path, records: Any, timing: Timing | None, **meta: Any) -> None:
    """Write ``records`` with the provenance of this run and ``timing``'s settings (None: the
    records were not timed here, a profile for one)."""
    if timing is not None:
        meta = {"timing": timing.meta(), **meta}
    provenance.write_json(path, records, **meta)


def fwd_bwd(layer: Callable[[Tensor], Tensor], x: Tensor, dy: Tensor) -> Callable[[], None]:
    """One training step of ``layer``: forward of ``x`` (requires grad), backward of ``dy``."""

    def run() -> None:
        x.grad = None
        layer(x).backward(dy)

    return run


class FusedOp:
    """The bare fused op as a layer, with ``bn``'s weight and bias: ``ops.batch_norm_train``
    and the running-statistics update (momentum 0.1), without the module's dispatch and
    precision guard. The CPU and GPU benchmarks time it beside the module."""

    def __init__(self, bn: torch.nn.BatchNorm2d, eps: float = 1e-5) -> None:
        self.weight, self.bias, self.eps = bn.weight, bn.bias, eps
        self.running_mean = torch.zeros_like(bn.weight, requires_grad=False)
        self.running_var = torch.ones_like(bn.weight, requires_grad=False)

    def __call__(self, x: Tensor) -> Tensor:
        from syncbn_lab.nn import ops

        out = ops.batch_norm_train(x, self.weight, self.bias, 1, 1, self.eps)
        count = x.numel() // x.shape[1]
        with torch.no_grad():
            self.running_mean.lerp_(out.mean[0], 0.1)
            self.running_var.lerp_(out.var[0] * (count / (count - 1)), 0.1)
        return out.y
