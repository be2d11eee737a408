"""Join with uneven inputs: 2 gloo ranks with 3 and 5 batches train a DDP model with our
SyncBatchNorm under ``Join([JoinableStep(...)])`` without hanging, and every step equals a
float64 full-batch BatchNorm2d step over the batches that exist in it (the union while both
ranks have data, rank 1's batch after rank 0 has joined), the gradient divided by the world
size as DDP divides it. Both ranks end with the same parameters and running statistics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from syncbn_lab.parallel.gloo_jobs import run_distributed

BATCHES = (3, 5)  # batches on rank 0 and rank 1
PER_RANK, WORLD, LR = 4, 2, 0.1
TOL = {"rtol": 1e-10, "atol": 1e-10}


def tiny_net(norm: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        norm(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    ).double()
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """(batches, ranks, per-rank samples, ...) inputs and targets; rank r uses BATCHES[r]."""
    g = torch.Generator().manual_seed(1)
    shape = (max(BATCHES), WORLD, PER_RANK)
    x = torch.randn(*shape, 3, 6, 6, dtype=torch.float64, generator=g) * 2 + 1
    return x, torch.randn(*shape, 2, dtype=torch.float64, generator=g)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over this rank's samples, 0 for none (an empty batch adds nothing)."""
    return F.mse_loss(output, target, reduction="sum") / max(target.numel(), 1)


def train_with_join(rank: int, world_size: int) -> dict:
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    from syncbn_lab.nn import JoinableStep, SyncBatchNorm

    model = DDP(tiny_net(SyncBatchNorm))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, target = data()
    losses = []

    def step(images, targets):
        optimizer.zero_grad()
        loss = mse(model(images), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    joinable = JoinableStep(step, empty=(x[0, rank, :0], target[0, rank, :0]))
    with Join([joinable]):
        for b in range(BATCHES[rank]):
            joinable(x[b, rank], target[b, rank])
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    return {"losses": losses, "state": state}


def reference() -> tuple[list[list[float]], dict]:
    """Full-batch BatchNorm2d over the batches of each step; the loss of a step is the sum
    over ranks with data of their mean, over the world size (DDP's average)."""
    net = tiny_net(nn.BatchNorm2d)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, target = data()
    losses = [[], []]
    for b in range(max(BATCHES)):
        ranks = [r for r in range(WORLD) if b < BATCHES[r]]
        images = torch.cat([x[b, r] for r in ranks])
        outputs = net(images).split(PER_RANK)
        per_rank = [mse(out, target[b, r]) for out, r in zip(outputs, ranks, strict=True)]
        optimizer.zero_grad()
        (sum(per_rank) / WORLD).backward()
        optimizer.step()
        for r in range(WORLD):
            losses[r].append(per_rank[ranks.index(r)].item() if r in ranks else 0.0)
    return losses, net.state_dict()


def test_uneven_ranks_under_join_train_as_full_batch_bn_over_the_batches_that_exist():
    results = run_distributed(f"{__file__}:train_with_join", WORLD, timeout_s=120, pg_timeout_s=60)
    losses, state = reference()
    for rank, result in enumerate(results):
        assert len(result["losses"]) == max(BATCHES)  # joined: empty steps, loss 0
        torch.testing.assert_close(result["losses"], losses[rank], **TOL)
        for key, value in state.items():
            torch.testing.assert_close(result["state"][key], value, **TOL, msg=key)
