"""Behaviour of real gloo DDP ranks that the training runs cannot show directly.

One process group of 2 ranks runs every case (started once, through the same supervisor as
training runs); each test below checks one case's outcome against an independent reference
that every rank computes locally from the data of all ranks.
"""

import traceback

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, compose_config
from omegaconf import OmegaConf
from parallel_helpers import assert_running_stats_are_population_stats
from torch import nn
from torch.utils.data import TensorDataset

from syncbn_lab import models
from syncbn_lab.config import validate
from syncbn_lab.engine.evaluate import evaluate
from syncbn_lab.engine.loop import Loaders, Trainer
from syncbn_lab.engine.optim import build_optimizer
from syncbn_lab.engine.precise_bn import update_bn_stats
from syncbn_lab.logging import NullLogger
from syncbn_lab.nn.registry import norm_layer
from syncbn_lab.parallel import Runtime, parallelize
from syncbn_lab.parallel.bn_buffers import DistributedBNBuffers
from syncbn_lab.parallel.ddp import launch_ddp
from syncbn_lab.parallel.sampling import eval_loader
from syncbn_lab.shape import RunShape
from syncbn_lab.traffic import TRAFFIC

WORLD = 2
RESNET8 = OmegaConf.create({"name": "resnet8", "width": 4, "zero_init_residual": False})
BN = OmegaConf.create({"name": "bn", "eps": 1e-5, "momentum": 0.1})
SYNC = OmegaConf.create({"name": "sync", "eps": 1e-5, "momentum": 0.1, "group_size": None})
GN = OmegaConf.create({"name": "gn", "groups": 2, "eps": 1e-5})


def resnet(bn_cfg, dtype=torch.float32):
    torch.manual_seed(0)
    return models.build(RESNET8, norm_layer(bn_cfg), 4, 1).to(dtype)


def data(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


# -- the cases, run on every rank ----------------------------------------------------------------
def case_evaluation_counts_every_sample_once(rt: Runtime) -> None:
    images, labels = data(37, seed=5)  # 37 = 19 + 18: uneven shards, no padding
    dataset = TensorDataset(images, labels)
    model = resnet(BN).eval()
    result = evaluate(model, eval_loader(dataset, rt, 5, 0), rt, "fp32")
    alone = evaluate(model, eval_loader(dataset, Runtime(), 5, 0), Runtime(), "fp32")
    assert result["count"] == 37
    assert result["acc"] == alone["acc"]
    assert result["loss"] == pytest.approx(alone["loss"], rel=1e-6)


def case_accumulation_syncs_only_the_last_micro_step(rt: Runtime) -> None:
    """K micro-batches under DDP: one gradient all-reduce per step (no_sync before), and the
    update of one batch K x the size in one process (bn=gn, float64)."""
    accumulate, per_device = 4, 4
    cfg = compose_config([*TINY, "bn=gn", "bn.groups=2", "parallel=ddp"])
    validate(cfg)
    steps = []
    for k in (1, accumulate):
        cfg.trainer.accumulate = k
        model = resnet(GN, torch.float64)
        wrapped = parallelize(model, cfg, rt).model  # counts its gradient buckets in TRAFFIC
        TRAFFIC.reset()
        loaders = Loaders(train=[None] * 8, val=[], test=[])
        trainer = Trainer(
            cfg, rt, wrapped, model, build_optimizer(cfg.optim, model), loaders, NullLogger(), None
        )
        # this rank's micro-batches: K of per_device * (accumulate // k) samples
        x, y = data(accumulate * per_device * WORLD, seed=7, dtype=torch.float64)
        mine = slice(rt.rank * accumulate * per_device, (rt.rank + 1) * accumulate * per_device)
        x, y = x[mine], y[mine]
        size = accumulate * per_device // k
        trainer.train_step(
            [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(k)]
        )
        calls = TRAFFIC.calls["gradients"]
        steps.append((torch.cat([p.detach().flatten() for p in model.parameters()]), calls))
    (one, buckets), (acc, calls_accumulated) = steps
    assert buckets >= 1 and calls_accumulated == buckets  # only the last micro-step synced
    # one process, one batch of everything
    cfg.trainer.accumulate = 1
    model = resnet(GN, torch.float64)
    loaders = Loaders(train=[None] * 8, val=[], test=[])
    alone = Trainer(
        cfg, Runtime(), model, model, build_optimizer(cfg.optim, model), loaders, NullLogger(), None
    )
    alone.train_step([data(accumulate * per_device * WORLD, seed=7, dtype=torch.float64)])
    reference = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(acc, reference, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(one, reference, rtol=1e-6, atol=1e-9)


def case_dist_bn(rt: Runtime) -> None:
    """none: evaluate with rank 0's statistics, keep one's own; broadcast: take rank 0's;
    reduce: take the mean over ranks."""
    for mode in ("none", "broadcast", "reduce"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3)).train()
        with torch.no_grad():
            model(data(6, seed=20 + rt.rank)[0])  # each rank its own statistics
        bn = model[1]
        own = bn.running_mean.clone()
        ranks = gathered(own)
        inside = None
        with DistributedBNBuffers(model, mode).evaluation():
            inside = bn.running_mean.clone()
        expected = {
            "none": ranks[0],
            "broadcast": ranks[0],
            "reduce": torch.stack(ranks).mean(0),
        }[mode]
        torch.testing.assert_close(inside, expected, rtol=1e-6, atol=1e-7)
        after = own if mode == "none" else expected
        torch.testing.assert_close(bn.running_mean, after, rtol=1e-6, atol=1e-7)
        if rt.rank == 1:
            assert not torch.allclose(ranks[0], ranks[1])  # the cases above can tell


def case_precise_bn(rt: Runtime, bn_cfg) -> None:
    """Population statistics over all ranks' device batches, as one process computes them
    from the inputs a torch-BN model sees on each device batch (the global batch for sync)."""
    per_device, num_batches = 4, 3
    model = resnet(bn_cfg)
    reference = resnet(BN)
    reference.load_state_dict(model.state_dict())
    batches = {
        r: [data(per_device, seed=100 * r + i) for i in range(num_batches)] for r in range(WORLD)
    }
    update_bn_stats(model, batches[rt.rank], num_batches, rt)

    captured: dict[str, list[torch.Tensor]] = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, a, n=n: captured.setdefault(n, []).append(a[0]))
        for n, m in reference.named_modules()
        if isinstance(m, nn.BatchNorm2d)
    ]
    reference.train()
    with torch.no_grad():
        for i in range(num_batches):
            if bn_cfg.name == "sync":
                reference(torch.cat([batches[r][i][0] for r in range(WORLD)]))
            else:
                for r in range(WORLD):
                    reference(batches[r][i][0])
    for h in hooks:
        h.remove()
    assert_running_stats_are_population_stats(model, captured)


def case_traffic_counts_what_each_collective_sends(rt: Runtime) -> None:
    """Two optimizer steps with bn=sync: the counted bytes per step are the model's
    parameters once (float32 gradients), its buffers once (the broadcast before forward) and,
    per norm layer, the forward payload of 2C+1 float64 and the backward one of 2C float32."""
    cfg = compose_config([*TINY, "bn=sync", "parallel=ddp"])
    validate(cfg)
    model = resnet(SYNC)
    wrapped = parallelize(model, cfg, rt).model
    loaders = Loaders(train=[None] * 8, val=[], test=[])
    trainer = Trainer(
        cfg, rt, wrapped, model, build_optimizer(cfg.optim, model), loaders, NullLogger(), None
    )
    TRAFFIC.reset()
    for seed in (1, 2):
        trainer.train_step([data(8, seed=seed + 10 * rt.rank)])
    channels = [m.num_features for m in model.modules() if hasattr(m, "num_features")]
    expected = {
        "gradients": sum(4 * p.numel() for p in model.parameters()),
        "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
        "norm_statistics": sum(8 * (2 * c + 1) + 4 * 2 * c for c in channels),
    }
    per_step = TRAFFIC.per_step(2)
    for kind, size in expected.items():
        assert per_step[f"comm_{kind}_bytes_per_step"] == size, (kind, per_step)
    assert per_step["comm_bytes_per_step"] == sum(expected.values())
    assert TRAFFIC.calls["norm_statistics"] == 2 * 2 * len(channels)


CASES = {
    "traffic": case_traffic_counts_what_each_collective_sends,
    "evaluation": case_evaluation_counts_every_sample_once,
    "accumulation": case_accumulation_syncs_only_the_last_micro_step,
    "dist_bn": case_dist_bn,
    "precise_bn_bn": lambda rt: case_precise_bn(rt, BN),
    "precise_bn_sync": lambda rt: case_precise_bn(rt, SYNC),
}


def run_cases(rt: Runtime, cfg, shape, run_dir) -> dict[str, str]:
    """Worker: every case on every rank; rank 0 returns {case: "" or the failure}."""
    outcomes = {}
    for name, case in CASES.items():
        try:
            case(rt)
            failure = ""
        except Exception:
            failure = traceback.format_exc()
        failures = [None] * rt.world_size
        dist.all_gather_object(failures, failure)
        outcomes[name] = "\n".join(f"rank {r}:\n{f}" for r, f in enumerate(failures) if f)
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    cfg = OmegaConf.create(
        {
            "parallel": {"devices": WORLD, "start_method": "forkserver", "timeout_s": 60},
            "trainer": {"threads": None},
        }
    )
    shape = RunShape(
        variant="bn", mode="ddp", devices=WORLD, per_device_batch_size=8, slices_per_process=1,
        device_slices=1, normalization_batch_size=8, device="cpu", backend="gloo",
    )  # fmt: skip
    return launch_ddp(cfg, shape, run_cases, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_case(outcomes, case):
    assert outcomes[case] == "", outcomes[case]
