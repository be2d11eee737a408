"""fused_batch_norm_train over real gloo ranks with uneven and empty local batches.

The reducers are the test's own (all_gather + merge_stats forward, all_reduce backward): the
point is the kernels' contract on ranks that hold 4, 1 and 0 samples. Every rank's output,
input gradient, and the rank-summed weight/bias gradients must equal float64 BatchNorm over
the union of the batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from reference_bn import reference_with_grads

from syncbn_lab.nn import _ext

pytestmark = pytest.mark.skipif(
    not _ext.load(), reason=f"syncbn_lab._C not built: {_ext.unavailable_reason()}"
)

SIZES = (4, 1, 0)  # samples per rank
SHAPE = (3, 5, 6)  # C, H, W


def global_batch():
    g = torch.Generator().manual_seed(0)
    n = sum(SIZES)
    x = (torch.randn(n, *SHAPE, generator=g, dtype=torch.float64) * 2 + 1).float()
    dy = torch.randn(n, *SHAPE, generator=g, dtype=torch.float64).float()
    w = torch.linspace(0.5, 1.5, SHAPE[0])
    b = torch.linspace(-0.3, 0.3, SHAPE[0])
    return x, dy, w, b


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from syncbn_lab.nn import ops

    def reduce_stats(count, mean, m2):
        gathered = [torch.empty(0)] * world
        dist.all_gather_object(gathered, (count, mean, m2))
        counts, means, m2s = (torch.cat(part) for part in zip(*gathered, strict=True))
        return ops.merge_stats(counts, means, m2s)

    def reduce_grads(sum_dy, sum_dy_xhat):
        both = torch.stack([sum_dy, sum_dy_xhat])
        dist.all_reduce(both)
        return both[0], both[1]

    x, dy, w, b = global_batch()
    start = sum(SIZES[:rank])
    x = x[start : start + SIZES[rank]].contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    dy = dy[start : start + SIZES[rank]]
    w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
    out = ops.fused_batch_norm_train(
        x, w, b, relu=True, reduce_stats=reduce_stats, reduce_grads=reduce_grads
    )
    out.y.backward(dy)
    torch.save(
        {"y": out.y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad, "mean": out.mean},
        f"{out_dir}/rank{rank}.pt",
    )
    dist.destroy_process_group()


@pytest.mark.slow
def test_uneven_and_empty_ranks_match_full_batch_reference(tmp_path):
    world = len(SIZES)
    mp.spawn(worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    x, dy, w, b = global_batch()
    ref = reference_with_grads(x, w, b, dy, groups=1, relu=True)
    y = torch.cat([r["y"] for r in results])
    dx = torch.cat([r["dx"] for r in results])
    assert results[2]["y"].shape == (0, *SHAPE)
    torch.testing.assert_close(y.double(), ref["y"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx.double(), ref["dx"], atol=1e-5, rtol=1e-5)
    dw = sum(r["dw"] for r in results)  # DDP would average: the sum is its world-size multiple
    db = sum(r["db"] for r in results)
    torch.testing.assert_close(dw.double(), ref["dweight"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(db.double(), ref["dbias"], atol=1e-5, rtol=1e-5)
    for r in results:
        torch.testing.assert_close(r["mean"].double(), ref["mean"][0], atol=1e-6, rtol=1e-5)
