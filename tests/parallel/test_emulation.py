"""The emulation of N devices in one process, checked against independent references:
torch's own BatchNorm run on each device slice, full-batch BatchNorm for SyncBN, a batch
K times larger for gradient accumulation, and population statistics computed by hand."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, compose_config
from omegaconf import OmegaConf
from parallel_helpers import assert_running_stats_are_population_stats, assert_same_run
from torch import nn

from syncbn_lab import models
from syncbn_lab.engine.loop import Loaders, Trainer
from syncbn_lab.engine.optim import build_optimizer
from syncbn_lab.engine.precise_bn import update_bn_stats
from syncbn_lab.logging import NullLogger
from syncbn_lab.nn.registry import norm_layer
from syncbn_lab.parallel import Runtime, parallelize
from syncbn_lab.parallel.dp import LossInModule, loss_and_counts
from syncbn_lab.parallel.emulated import EmulatedDevices
from syncbn_lab.parallel.modes import MODES
from syncbn_lab.train import run

BN = OmegaConf.create({"name": "bn", "eps": 1e-5, "momentum": 0.1})
SYNC = OmegaConf.create({"name": "sync", "eps": 1e-5, "momentum": 0.1, "group_size": None})
GN = OmegaConf.create({"name": "gn", "groups": 2, "eps": 1e-5})
RESNET8 = OmegaConf.create({"name": "resnet8", "width": 4, "zero_init_residual": False})


def resnet(bn_cfg, devices=1, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = models.build(RESNET8, norm_layer(bn_cfg, device_slices=devices), 4, 1)
    return model.to(dtype)


def torch_bn_copy(model):
    """The same weights and buffers in a model built with torch.nn.BatchNorm2d."""
    reference = resnet(BN)
    reference.load_state_dict(model.state_dict())
    return reference


def data(n, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def trainer_for(cfg, model, wrapped=None, tmp_path=None, model_loss=None):
    """A Trainer around ``model`` (train_step only: no loaders, no logger)."""
    loaders = Loaders(train=[None] * 8, val=[], test=[])
    optimizer = build_optimizer(cfg.optim, model)
    return Trainer(
        cfg, Runtime(), wrapped or model, model, optimizer, loaders, NullLogger(), tmp_path,
        model_loss=model_loss,
    )  # fmt: skip


# -- emulated SyncBN is BatchNorm over the global batch, for every N --------------------------
STEPS = 20
PROOF = [*TINY, f"trainer.max_steps={STEPS}", "trainer.epochs=3"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("single")
    run(compose_config([*PROOF, "bn=bn"]), path)  # torch.nn.BatchNorm2d, one device
    return path


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_emulated_sync_equals_one_device(tmp_path, single_run, devices):
    run(
        compose_config([*PROOF, "parallel=emulated", f"parallel.devices={devices}", "bn=sync"]),
        tmp_path,
    )
    assert_same_run(tmp_path, single_run, STEPS)


def test_emulated_bn_differs_from_one_device(tmp_path, single_run):
    """The comparison above can fail: per-device BN at N=8 is a different computation."""
    run(compose_config([*PROOF, "parallel=emulated", "parallel.devices=8", "bn=bn"]), tmp_path)
    with pytest.raises(AssertionError):
        assert_same_run(tmp_path, single_run, STEPS)


# -- per-device statistics --------------------------------------------------------------------
def test_per_device_batch_of_one_normalises_each_image_over_its_pixels():
    model = resnet(BN, devices=4)
    images, labels = data(4)
    loss = F.cross_entropy(model.train()(images), labels)
    reference = torch_bn_copy(resnet(BN, devices=4)).train()
    per_image = [F.cross_entropy(reference(images[i : i + 1]), labels[i : i + 1]) for i in range(4)]
    torch.testing.assert_close(loss, torch.stack(per_image).mean(), rtol=1e-5, atol=1e-6)


def test_per_device_batch_of_one_trains(tmp_path):
    cfg = compose_config([*TINY, "parallel=emulated", "parallel.devices=32", "trainer.max_steps=3"])
    summary = run(cfg, tmp_path)
    assert summary["per_device_batch_size"] == 1 and summary["steps"] == 3
    assert summary["train_loss"] == summary["train_loss"]  # finite, not NaN


def test_running_stats_follow_device_zero():
    model = resnet(BN, devices=2).train()
    reference = torch_bn_copy(model).train()
    images, _ = data(16)
    model(images)
    reference(images[:8])  # device 0's slice
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_every_device_keeps_running_stats_like_ddp(broadcast_buffers):
    """With dist_bn=reduce the emulation keeps devices 1..N-1's running statistics exactly as
    N separate replicas under DDP would: each updates from its own slice, and with
    broadcast_buffers starts every synced step from device 0's (never inside no_sync)."""
    devices, steps, accumulate = 3, 3, 2
    model = resnet(BN, devices=devices)
    emulated = EmulatedDevices(model, devices, broadcast_buffers, track_all_devices=True).train()
    replicas = [torch_bn_copy(model).train() for _ in range(devices)]
    for step in range(steps):
        for micro in range(accumulate):
            images, _ = data(devices * 4, seed=10 * step + micro)
            if micro == 0 and broadcast_buffers:  # DDP broadcasts before the first forward
                for replica in replicas[1:]:
                    for b, b0 in zip(replica.buffers(), replicas[0].buffers(), strict=True):
                        b.copy_(b0)
            sync = emulated.no_sync() if micro < accumulate - 1 else torch.enable_grad()
            with sync:
                emulated(images).sum().backward()
            for d, replica in enumerate(replicas):
                replica(images[4 * d : 4 * (d + 1)])
    emulated.reduce_buffers()
    named = dict(model.named_modules())
    for name, layer in replicas[0].named_modules():
        if isinstance(layer, nn.BatchNorm2d):
            mods = [dict(r.named_modules())[name] for r in replicas]
            mean = torch.stack([m.running_mean for m in mods]).mean(0)
            var = torch.stack([m.running_var for m in mods]).mean(0)
            torch.testing.assert_close(named[name].running_mean, mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(named[name].running_var, var, rtol=1e-5, atol=1e-6)


# -- gradient accumulation ---------------------------------------------------------------------
@pytest.mark.parametrize("devices", [1, 2])
def test_accumulation_equals_a_larger_batch_without_bn(devices):
    """bn=gn (batch-independent): K micro-batches give the update of one K-times batch."""
    accumulate, per_step = 4, 32
    images, labels = data(per_step, dtype=torch.float64)
    updated = []
    for k in (1, accumulate):
        cfg = compose_config(
            [*TINY, "bn=gn", "bn.groups=2", "parallel=emulated", f"parallel.devices={devices}"]
        )
        cfg.trainer.accumulate = k
        model = resnet(GN, dtype=torch.float64)
        wrapped = parallelize(model, cfg, Runtime()).model
        trainer = trainer_for(cfg, model, wrapped)
        size = per_step // k
        micro = [
            (images[i * size : (i + 1) * size], labels[i * size : (i + 1) * size]) for i in range(k)
        ]
        totals = trainer.train_step(micro)
        updated.append((torch.cat([p.detach().flatten() for p in model.parameters()]), totals))
    (one, totals_one), (acc, totals_acc) = updated
    torch.testing.assert_close(acc, one, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(totals_acc, totals_one, rtol=1e-9, atol=1e-9)


def test_accumulation_with_bn_normalises_each_micro_batch_per_device():
    """With BatchNorm, each micro-batch is normalised with its own per-device statistics
    (batch global / (devices x K)), and running statistics are updated once per micro-batch
    from device 0's slice: K updates per optimizer step."""
    devices, accumulate, per_device = 2, 2, 4
    cfg = compose_config([*TINY, "parallel=emulated", f"parallel.devices={devices}"])
    cfg.trainer.accumulate = accumulate
    model = resnet(BN, devices=devices)
    reference = torch_bn_copy(model).train()
    wrapped = parallelize(model, cfg, Runtime()).model
    trainer = trainer_for(cfg, model, wrapped)
    micro = [data(devices * per_device, seed=s) for s in range(accumulate)]

    # reference: torch BN on each device slice of each micro-batch; loss = mean over all
    losses = []
    for images, labels in micro:
        for d in range(devices):
            part = slice(d * per_device, (d + 1) * per_device)
            losses.append(F.cross_entropy(reference(images[part]), labels[part]))
    loss = torch.stack(losses).mean()
    loss.backward()
    reference_grads = [p.grad.clone() for p in reference.parameters()]
    # running stats of device 0: one update per micro-batch from its slice
    expected_buffers = copy.deepcopy(torch_bn_copy(model)).train()
    for images, _ in micro:
        expected_buffers(images[:per_device])

    grads = []
    trainer.optimizer.step = lambda: grads.extend(p.grad.clone() for p in model.parameters())
    totals = trainer.train_step(micro)
    torch.testing.assert_close(totals[0] / totals[2], loss.double(), rtol=1e-5, atol=1e-7)
    for g, r in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    for a, b in zip(model.buffers(), expected_buffers.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert model.stem[1].num_batches_tracked.item() == accumulate


# -- PreciseBN ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bn_cfg,devices", [(BN, 1), (BN, 2), (SYNC, 2)], ids=["bn1", "bn2", "sync2"]
)
def test_precise_bn_equals_population_statistics(bn_cfg, devices):
    """Population statistics of every BN layer's input over all device batches, computed
    from the concatenated inputs of a torch-BN model run on each device batch."""
    per_device, num_batches = 4, 3
    model = resnet(bn_cfg, devices=devices)
    images = [data(devices * per_device, seed=s) for s in range(num_batches + 2)]
    params = [p.detach().clone() for p in model.parameters()]
    counters = [
        m.num_batches_tracked.clone() for m in model.modules() if hasattr(m, "num_batches_tracked")
    ]
    reference = torch_bn_copy(model).train()
    update_bn_stats(model, images, num_batches, Runtime(slices_per_process=devices))

    captured: dict[str, list[torch.Tensor]] = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, a, n=n: captured.setdefault(n, []).append(a[0]))
        for n, m in reference.named_modules()
        if isinstance(m, nn.BatchNorm2d)
    ]
    with torch.no_grad():
        for x, _ in images[:num_batches]:
            if bn_cfg.name == "sync":  # normalised over the whole batch, as SyncBN does
                reference(x)
            else:  # each device batch on its own
                for d in range(devices):
                    reference(x[d * per_device : (d + 1) * per_device])
    for h in hooks:
        h.remove()
    assert_running_stats_are_population_stats(model, captured)
    for p, before in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, before)
    after = [m.num_batches_tracked for m in model.modules() if hasattr(m, "num_batches_tracked")]
    assert all(torch.equal(a, b) for a, b in zip(after, counters, strict=True))


def test_precise_bn_in_the_summary(tmp_path):
    cfg = compose_config(
        [
            *TINY,
            "parallel=emulated",
            "parallel.devices=2",
            "trainer.max_steps=4",
            "trainer.precise_bn_batches=4",
        ]
    )
    summary = run(cfg, tmp_path)
    assert 0 <= summary["test_acc_precise_bn"] <= 100
    assert 0 <= summary["test_acc"] <= 100
    assert (tmp_path / "checkpoints" / "last_precise_bn.pt").exists()


# -- DataParallel's loss inside the replicas (the math, on CPU) ---------------------------------
def test_loss_in_module_gathers_scalars_and_keeps_the_global_mean():
    model = resnet(GN, dtype=torch.float64)
    images, labels = data(12, dtype=torch.float64)
    wrapped = LossInModule(model)
    # what DataParallel does with 3 replicas: chunk, run, gather along dim 0
    chunks = zip(images.chunk(3), labels.chunk(3), strict=True)
    gathered = torch.cat([wrapped(x, y) for x, y in chunks])
    assert gathered.shape == (3, 3)  # N x [loss sum, correct, count]: scalars only
    loss, correct, count = loss_and_counts(gathered)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(images)
    expected = F.cross_entropy(logits, labels)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(loss, expected)
    assert correct.item() == (logits.argmax(1) == labels).sum().item() and count.item() == 12
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_trainer_with_loss_in_module_takes_the_same_step():
    images, labels = data(16, dtype=torch.float64)
    updates = []
    for loss_in_module in (False, True):
        cfg = compose_config(
            [
                *TINY,
                "bn=gn",
                "bn.groups=2",
                "parallel=dp",
                f"parallel.loss_in_module={loss_in_module}",
            ]
        )
        model = resnet(GN, dtype=torch.float64)
        parallel = MODES["dp"].wrap(model, cfg, Runtime())  # what the mode hands the loop
        assert (parallel.model_loss is not None) is loss_in_module
        trainer = trainer_for(cfg, model, parallel.model, model_loss=parallel.model_loss)
        totals = trainer.train_step([(images, labels)])
        updates.append((torch.cat([p.detach().flatten() for p in model.parameters()]), totals))
    torch.testing.assert_close(updates[1][0], updates[0][0])
    torch.testing.assert_close(updates[1][1], updates[0][1])
