"""A real Lightning Trainer (strategy="ddp", 2 CPU processes over gloo) with SyncBatchNormPlugin
trains exactly as full-batch BatchNorm on the union of the ranks' batches (float64)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

from syncbn_lab.integrations.lightning import SyncBatchNormPlugin  # noqa: E402
from syncbn_lab.parallel.gloo_jobs import free_port, run_distributed  # noqa: E402

STEPS, PER_RANK, WORLD = 3, 4, 2
LR = 0.1
TOL = {"rtol": 1e-10, "atol": 1e-10}


class TinyNet(nn.Module):
    """conv -> BatchNorm -> ReLU -> pool -> linear, float64, seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def _shard(rank: int) -> slice:
    return slice(rank * PER_RANK, (rank + 1) * PER_RANK)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """STEPS global batches of WORLD * PER_RANK samples, in step order."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, WORLD * PER_RANK, 3, 8, 8, dtype=torch.float64, generator=g) * 2 + 1
    return x, torch.randn(STEPS, WORLD * PER_RANK, 2, dtype=torch.float64, generator=g)


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = TinyNet()
        self.seen: list[tuple[str, float]] = []  # (norm class, loss) per step

    def training_step(self, batch, batch_idx):
        x, target = batch
        loss = nn.functional.mse_loss(self.net(x), target)
        self.seen.append((type(self.net.bn).__name__, loss.item()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit_on_a_rank(rank: int, world_size: int, port: int, root: str) -> dict:
    """Lightning's DDP on this rank (launched externally, as torchrun does) on its shards."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    x, target = _data()
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    dataset = torch.utils.data.TensorDataset(
        x[:, shard].flatten(0, 1), target[:, shard].flatten(0, 1)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=PER_RANK, shuffle=False)
    module = TinyModule()
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=world_size,
        plugins=[SyncBatchNormPlugin()],
        precision="64-true",
        max_steps=STEPS,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(module, train_dataloaders=loader)
    state = {k: v.clone() for k, v in module.net.state_dict().items()}
    return {"seen": module.seen, "after": type(module.net.bn).__name__, "state": state}


def _reference() -> tuple[list[float], dict]:
    """One process, torch's BatchNorm2d on each step's whole global batch; the loss is the
    mean of the ranks' losses, which is what DDP's averaged gradient descends."""
    net = TinyNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, target = _data()
    losses = []
    for step in range(STEPS):
        out = net(x[step])
        per_rank = [
            nn.functional.mse_loss(
                out[r * PER_RANK : (r + 1) * PER_RANK],
                target[step, r * PER_RANK : (r + 1) * PER_RANK],
            )
            for r in range(WORLD)
        ]
        loss = sum(per_rank) / WORLD
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append([v.item() for v in per_rank])
    return losses, net.state_dict()


def test_lightning_ddp_with_the_plugin_equals_full_batch_batchnorm(tmp_path):
    ranks = run_distributed(
        f"{__file__}:fit_on_a_rank", WORLD, free_port(), str(tmp_path), timeout_s=120
    )
    losses, state = _reference()
    for rank, result in enumerate(ranks):
        assert [norm for norm, _ in result["seen"]] == ["SyncBatchNorm"] * STEPS
        assert result["after"] == "BatchNorm2d"  # the plugin's revert, at the end of fit
        got = [loss for _, loss in result["seen"]]
        torch.testing.assert_close(got, [step[rank] for step in losses], **TOL)
        assert state.keys() == result["state"].keys()
        for name, value in state.items():
            torch.testing.assert_close(
                result["state"][name], value, rtol=1e-10, atol=1e-10, msg=name
            )
    untrained = TinyNet().state_dict()
    assert not torch.allclose(state["bn.weight"], untrained["bn.weight"])  # the steps moved it


def test_plugin_converts_and_reverts_to_the_original_classes():
    net = nn.Sequential(TinyNet(), nn.BatchNorm1d(2))
    plugin = SyncBatchNormPlugin(group_size=2)
    synced = plugin.apply(copy.deepcopy(net))
    assert [type(m).__name__ for m in synced.modules() if "Norm" in type(m).__name__] == [
        "SyncBatchNorm",
        "SyncBatchNorm",
    ]
    assert synced[0].bn.group_size == 2
    reverted = plugin.revert(synced)
    assert type(reverted[0].bn) is nn.BatchNorm2d and type(reverted[1]) is nn.BatchNorm1d
    assert isinstance(plugin, pl.plugins.LayerSync)
    with pytest.raises(ValueError, match="not both"):
        SyncBatchNormPlugin(group_size=2, process_group=object())
