"""docs/library.md's recipe for plain DDP and for torchvision's references/classification/train.py
(`--sync-bn` with our converter in place of torch's): a torchvision resnet18 converted by
convert_sync_batchnorm and wrapped in DDP on 2 CPU gloo ranks trains two SGD steps exactly
as full-batch BatchNorm2d on the union of the ranks' batches (float64), where torch's own
conversion is refused by DDP on a CPU module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torchvision = pytest.importorskip("torchvision")

from syncbn_lab.parallel.gloo_jobs import run_distributed  # noqa: E402

STEPS, PER_RANK, WORLD, LR = 2, 2, 2, 0.05
TOL = {"rtol": 1e-9, "atol": 1e-10}


def resnet18() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(STEPS, WORLD * PER_RANK, 3, 32, 32, dtype=torch.float64, generator=g)
    return x, torch.randint(0, 10, (STEPS, WORLD * PER_RANK), generator=g)


def train_on_a_rank(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from syncbn_lab.nn import convert_sync_batchnorm, is_sync_batchnorm

    with pytest.raises(ValueError, match="only work with GPU modules"):
        DDP(torch.nn.SyncBatchNorm.convert_sync_batchnorm(resnet18()))  # the reference's line
    model = DDP(convert_sync_batchnorm(resnet18()))  # the recipe
    synced = sum(map(is_sync_batchnorm, model.modules()))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = data()
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[step, shard]), y[step, shard])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"synced": synced, "losses": losses, "state": model.module.state_dict()}


def test_a_torchvision_resnet_under_ddp_trains_as_full_batch_bn():
    results = run_distributed(f"{__file__}:train_on_a_rank", WORLD, timeout_s=180)
    model = resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = data()
    for step in range(STEPS):
        optimizer.zero_grad()
        outputs = model(x[step])  # the union: BatchNorm2d over both ranks' images
        per_rank = [F.cross_entropy(o, t) for o, t in zip(outputs.split(PER_RANK),
                    y[step].split(PER_RANK), strict=True)]  # fmt: skip
        (sum(per_rank) / WORLD).backward()  # DDP's average of the ranks' mean losses
        optimizer.step()
        for rank, result in enumerate(results):
            assert result["losses"][step] == pytest.approx(per_rank[rank].item(), rel=1e-9)
    for result in results:
        assert result["synced"] == 20  # every BatchNorm2d of resnet18
        for key, value in model.state_dict().items():
            torch.testing.assert_close(result["state"][key], value, **TOL, msg=key)
