"""syncbn_lab.bench, the benchmarks' timing harness, against a fake clock and hand-computed
figures: the order of the calls, the statistics, the ratios and the JSON it writes."""

from __future__ import annotations

import json

import pytest
import torch

from syncbn_lab.bench import (
    FusedOp,
    Rounds,
    Timing,
    fwd_bwd,
    per_call_ms,
    write_json,
)


class FakeClock:
    """Seconds that move only when a call says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_per_call_ms_is_the_clocks_time_over_the_calls():
    clock = FakeClock()
    durations = iter([0.004, 0.002, 0.003])  # seconds of three calls in a row
    sample = per_call_ms(lambda: clock.advance(next(durations)), inner=3, clock=clock)
    assert sample() == pytest.approx(1e3 * 0.009 / 3)


def test_warm_up_then_rounds_interleaved_with_before_each_call():
    log = []

    def sampler(key):
        return lambda: log.append(key) or float(len(log))

    samplers = {"a": sampler("a"), "b": sampler("b")}
    seen = []
    rounds = Timing(rounds=3, warmup=2).measure(
        samplers, before=lambda: log.append("|"), on_sample=lambda *s: seen.append(s)
    )
    warm = ["|", "a"] * 2 + ["|", "b"] * 2
    assert log == warm + ["|", "a", "|", "b"] * 3
    # Each recorded sample is the log's length when it ran: rounds only, in round order.
    assert rounds.samples == {"a": [10.0, 14.0, 18.0], "b": [12.0, 16.0, 20.0]}
    assert seen == [(r, key, rounds.samples[key][r]) for r in range(3) for key in "ab"]


def test_no_warm_up_records_the_first_call():
    values = iter([5.0, 7.0])
    rounds = Timing(rounds=2, warmup=0).measure({"x": lambda: next(values)})
    assert rounds.samples == {"x": [5.0, 7.0]}


def test_min_and_median_and_the_two_ratios():
    samples = {"a": [1.0, 10.0, 3.0], "b": [2.0, 1.0, 4.0]}
    fastest = Rounds(samples, "min")
    assert fastest.values() == {"a": 1.0, "b": 1.0}
    assert fastest.ratio("a", "b") == 1.0  # the minima's ratio
    typical = Rounds(samples, "median")
    assert typical.values() == {"a": 3.0, "b": 2.0}
    # Per-round ratios 0.5, 10, 0.75: their median, not the medians' ratio 1.5.
    assert typical.ratio("a", "b") == 0.75
    assert typical.ratio("b", "a") == pytest.approx(4 / 3)


@pytest.mark.parametrize(
    "kwargs", [{"rounds": 0}, {"rounds": 1, "warmup": -1}, {"rounds": 1, "stat": "mean"}]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Timing(**kwargs)


def test_json_carries_provenance_and_the_timing(tmp_path):
    path = tmp_path / "bench.json"
    write_json(path, [{"ms": 1.5}], Timing(rounds=7, warmup=2, stat="median"), threads=3)
    document = json.loads(path.read_text())
    assert document["records"] == [{"ms": 1.5}]
    assert document["meta"]["timing"] == {"rounds": 7, "warmup": 2, "stat": "median"}
    assert document["meta"]["threads"] == 3
    assert {"git_commit", "machine", "torch", "command"} <= set(document["meta"])
    write_json(path, [], None)
    assert "timing" not in json.loads(path.read_text())["meta"]


def test_fused_op_is_torch_batchnorm_in_training():
    """The bare op the benchmarks time computes what torch's BatchNorm2d computes: output,
    input gradient and running statistics (float64)."""
    from syncbn_lab.nn import ops

    if not ops.available(warn=False):
        pytest.skip("syncbn_lab._C is not built")
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    fused = FusedOp(bn)
    x = (3 * torch.randn(4, 3, 5, 5, dtype=torch.float64) + 1).requires_grad_()
    dy = torch.randn_like(x)
    fwd_bwd(fused, x, dy)()
    fused_grad = x.grad.clone()
    fwd_bwd(bn, x, dy)()
    torch.testing.assert_close(fused(x), bn(x))
    torch.testing.assert_close(fused_grad, x.grad)
    bn.reset_running_stats()
    bn(x)
    fused = FusedOp(bn)
    fused(x)
    torch.testing.assert_close(fused.running_mean, bn.running_mean)
    torch.testing.assert_close(fused.running_var, bn.running_var)
