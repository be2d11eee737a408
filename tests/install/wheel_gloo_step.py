"""Run by tests/install/test_wheel.py with the python of a virtual environment that holds torch
and the built wheel alone: two gloo ranks on 127.0.0.1 each run syncbn_lab.nn.SyncBatchNorm on
their shard of one batch for two training steps, beside torch.nn.BatchNorm2d on the whole
batch, all in float64. It needs torch and the installed package only.

    python wheel_gloo_step.py RESULT_DIR

writes RESULT_DIR/rank<r>.json per rank: the worst absolute differences from the full-batch
reference (output, input gradient, all-reduced weight and bias gradients, running statistics)
for impl="auto" and, where the kernels load, for impl="fused"; whether syncbn_lab._C loaded;
where syncbn_lab was imported from; and every warning raised from `import syncbn_lab.nn` to
the end of the steps.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
SHARDS = (3, 5)  # images per rank: uneven on purpose
CHANNELS = 3
STEPS = 2


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step`` and the gradient of its output: the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(sum(SHARDS), CHANNELS, 4, 5, generator=generator, dtype=torch.float64)
    x = x * torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64).view(1, -1, 1, 1) + 4.0
    grad_y = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    return x, grad_y


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def compare(rank: int, layer_cls: type, impl: str) -> dict[str, float]:
    """Worst differences of SyncBatchNorm(impl=impl) on this rank's shard from BatchNorm2d on
    the whole batch, over STEPS training steps."""
    start, stop = sum(SHARDS[:rank]), sum(SHARDS[: rank + 1])
    generator = torch.Generator().manual_seed(7)
    weight = torch.rand(CHANNELS, generator=generator, dtype=torch.float64) + 0.5
    bias = torch.randn(CHANNELS, generator=generator, dtype=torch.float64)
    layer = layer_cls(CHANNELS, dtype=torch.float64, impl=impl)
    reference = torch.nn.BatchNorm2d(CHANNELS, dtype=torch.float64)
    with torch.no_grad():
        for module in (layer, reference):
            module.weight.copy_(weight)
            module.bias.copy_(bias)
    errors = dict.fromkeys(("output", "grad_input", "grad_weight", "grad_bias", "running"), 0.0)
    for step in range(STEPS):
        x, grad_y = batch(step)
        layer.zero_grad()
        reference.zero_grad()
        shard = x[start:stop].clone().requires_grad_()
        y = layer(shard)
        y.backward(grad_y[start:stop])
        full = x.clone().requires_grad_()
        y_full = reference(full)
        y_full.backward(grad_y)
        grads = torch.stack([layer.weight.grad, layer.bias.grad])
        dist.all_reduce(grads)  # each rank's are its own images' share, summed as under DDP
        found = {
            "output": worst(y, y_full[start:stop]),
            "grad_input": worst(shard.grad, full.grad[start:stop]),
            "grad_weight": worst(grads[0], reference.weight.grad),
            "grad_bias": worst(grads[1], reference.bias.grad),
            "running": max(
                worst(layer.running_mean, reference.running_mean),
                worst(layer.running_var, reference.running_var),
            ),
        }
        errors = {k: max(errors[k], found[k]) for k in errors}
    return errors


def rank_main(rank: int, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(result_dir) / 'rendezvous'}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import syncbn_lab
            import syncbn_lab.nn
            from syncbn_lab.nn import _ext

            kernels = _ext.load()
            result = {
                "package": syncbn_lab.__file__,
                "kernels": kernels,
                "auto": compare(rank, syncbn_lab.nn.SyncBatchNorm, "auto"),
            }
            if kernels:
                result["fused"] = compare(rank, syncbn_lab.nn.SyncBatchNorm, "fused")
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # End without the interpreter's teardown, as torchrun ranks of the lab do
    # (syncbn_lab.parallel.ddp.exit_rank, which this wheel does not hold): gloo's
    # worker threads outlive destroy_process_group, and one that drops a finished
    # all_reduce's tensor during the teardown aborts the process (SIGABRT), about one run
    # in 50 to 100 on 2 cores.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1],), nprocs=WORLD)
