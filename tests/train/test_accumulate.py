"""Gradient accumulation shrinks BatchNorm's normalisation batch exactly as more devices do:
``parallel=single trainer.accumulate=K`` trains as ``parallel=emulated parallel.devices=K``
(bn=bn, the same global batch, seed and data, random crops and flips included), in float64:
the loss at every step, the parameters and the SGD momentum buffers agree to 1e-10 across an
epoch boundary. The one difference is the running statistics: the emulation keeps device 0's
(as DDP does), updated once a step from its slice; accumulation updates them once per
micro-batch, K times a step, from every device's slice in turn (``num_batches_tracked``
counts K times as many). The runs use ``bn.momentum=null``, cumulative averages in which
every update weighs alike (the momentum changes no step of training), so that the relation
is exact: accumulation's running statistics are the mean over the K devices of each
device's own, which the emulation computes with ``parallel.dist_bn=reduce
parallel.broadcast_buffers=false``. More generally, D devices accumulating K micro-batches
train as D x K devices (micro-batch k of device d is device d + D k).
"""

import pytest
from conftest import TINY, compose_config
from torch.utils.data import DistributedSampler

from syncbn_lab.parallel.sampling import DeviceBatchSampler
from syncbn_lab.run_compare import checkpoint_tensors, run_difference
from syncbn_lab.train import run

K, STEPS = 4, 4
COMMON = [
    *TINY,  # resnet8 width 4, synthetic 8x8 images, global batch 32: 8 images per slice
    "data.num_train=64",
    "data.augment=true",
    "data.crop_padding=1",
    "data.hflip=true",
    "trainer.epochs=2",  # 2 steps an epoch: a reshuffle and new draws in between
    "trainer.precision=fp64",
    "bn=bn",
    "bn.momentum=null",
]
EMULATE = ["parallel=emulated", f"parallel.devices={K}"]
RUNS = {
    "accumulate": ["parallel=single", f"trainer.accumulate={K}"],
    "device-0": EMULATE,  # device 0's statistics, as DDP keeps rank 0's
    "device-mean": [*EMULATE, "parallel.dist_bn=reduce", "parallel.broadcast_buffers=false"],
    "2-devices-accumulate": ["parallel=emulated", "parallel.devices=2", "trainer.accumulate=2"],
}
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
RTOL = 1e-10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("accumulate")
    for name, overrides in RUNS.items():
        assert run(compose_config([*COMMON, *overrides]), root / name)["steps"] == STEPS
    return root


def counters(run_dir) -> set[int]:
    tensors = checkpoint_tensors(run_dir)
    return {int(v) for k, v in tensors.items() if k.endswith("num_batches_tracked")}


@pytest.mark.parametrize("accumulating", ["accumulate", "2-devices-accumulate"])
def test_accumulating_k_micro_batches_trains_as_k_times_the_devices(runs, accumulating):
    diff = run_difference(runs / accumulating, runs / "device-0", leave_out=BUFFERS)
    assert len(diff["loss_by_step"]) == STEPS
    assert diff["worst"] <= RTOL, diff  # loss at every step, parameters, momentum buffers
    assert diff["tensors"] == 58  # 29 parameters and their 29 momentum buffers
    # device 0's statistics once a step, against devices 0, D, 2D, ...'s once a micro-batch
    assert min(diff["left_out"][b] for b in BUFFERS[:2]) > 1e-3, diff
    assert counters(runs / "device-0") == {STEPS}
    assert counters(runs / accumulating) == {STEPS * (K if accumulating == "accumulate" else 2)}


def test_accumulated_running_statistics_are_the_mean_over_devices(runs):
    leave_out = ("num_batches_tracked",)
    diff = run_difference(runs / "accumulate", runs / "device-mean", leave_out=leave_out)
    assert diff["worst"] <= RTOL, diff
    assert diff["tensors"] == 76  # and the 9 layers' running_mean and running_var


@pytest.mark.parametrize("devices", [1, 2])
def test_micro_batch_k_of_device_d_is_device_d_plus_devices_times_k(devices):
    """The sampler of D devices accumulating K micro-batches against that of D x K devices,
    and the images of each step against the D devices' own DistributedSampler shards."""
    dataset, per_device, seed = range(96), 4, 5
    more = DeviceBatchSampler(dataset, per_device, devices * K, list(range(devices * K)), seed)
    accumulating = [
        DeviceBatchSampler(dataset, per_device, devices, [d], seed, accumulate=K)
        for d in range(devices)
    ]
    for epoch in (0, 1):
        for sampler in (more, *accumulating):
            sampler.set_epoch(epoch)
        batches = list(more)
        for d, sampler in enumerate(accumulating):
            micro = list(sampler)
            assert len(micro) == K * len(batches) == len(sampler)
            own = DistributedSampler(dataset, devices, d, seed=seed)  # this device's shard
            own.set_epoch(epoch)
            shard = list(own)
            for i, batch in enumerate(micro):
                step, k = divmod(i, K)
                device = d + devices * k
                assert batch.devices == (device,)
                assert batch == batches[step][device * per_device : (device + 1) * per_device]
                assert batches[step].devices == tuple(range(devices * K))
            for step in range(len(batches)):
                images = [i for batch in micro[step * K : (step + 1) * K] for i in batch]
                chunk = shard[step * K * per_device : (step + 1) * K * per_device]
                assert sorted(images) == sorted(chunk)
