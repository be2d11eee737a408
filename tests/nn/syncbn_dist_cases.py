"""Cases that run on every rank of one spawned gloo job per world size (see test_sync_dist.py).

Not collected by pytest (no ``test_`` prefix): ``run_all(rank, world_size)`` runs every case in
the same process group and returns ``{case: result}``; the tests assert on the results.

The comparison, as in mmcv's and apex's SyncBN tests: every rank holds its shard of one global
batch, and SyncBatchNorm on the shards must equal torch's BatchNorm on the whole batch computed
in float64. Each rank r back-propagates ``grad_y`` restricted to its shard, i.e. the per-rank
loss L_r = sum(y_r * grad_y_r). Scaling of the gradients:

- input: SyncBN's backward all-reduces sum(dy) and sum(dy * xhat), so rank r receives
  dL_sum/dx_r with L_sum = sum_r L_r (x_r also moves the other ranks' outputs through the
  shared statistics); compared with the float64 gradient of L_sum on the full batch;
- weight and bias: each rank's gradient is dL_r/dtheta over its own data; DDP averages them,
  (1/W) sum_r dL_r/dtheta = dL_mean/dtheta with L_mean = L_sum / W, the mean of the per-rank
  losses; compared with the float64 gradient of L_mean on the full batch.

With subgroups the "full batch" is the union of the batches of the ranks in the group and W
is the size of the group.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from helpers import error_ratio, torch_batchnorm_class

from syncbn_lab.nn import SyncBatchNorm

CHANNELS = 3
SPATIAL = (5, 4)

# Per-rank batch sizes: equal, uneven, and with one rank holding nothing.
SPLITS = {
    2: {"equal": [4, 4], "uneven": [2, 7], "one_empty": [0, 6]},
    3: {"equal": [3, 3, 3], "uneven": [1, 5, 2], "one_empty": [4, 0, 3]},
    4: {"equal": [2, 2, 2, 2], "uneven": [1, 4, 2, 5], "one_empty": [3, 3, 0, 4]},
}

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "barrier",
)


def _global_batch(sizes, spatial, seed, dtype):
    """The same global batch on every rank; values representable in ``dtype``, kept in fp64."""
    g = torch.Generator().manual_seed(seed)
    n, view = sum(sizes), (CHANNELS,) + (1,) * len(spatial)
    scale = (0.5 + torch.rand(CHANNELS, generator=g, dtype=torch.float64)).view(view)
    offset = (3 * torch.randn(CHANNELS, generator=g, dtype=torch.float64)).view(view)
    x = torch.randn(n, CHANNELS, *spatial, generator=g, dtype=torch.float64) * scale + offset
    grad = torch.randn(n, CHANNELS, *spatial, generator=g, dtype=torch.float64)
    return x.to(dtype).double(), grad.to(dtype).double()


def _shard(t, sizes, rank):
    start = sum(sizes[:rank])
    return t[start : start + sizes[rank]]


def _match(
    rank: int,
    sizes: list[int],
    make_layer: Callable[[], SyncBatchNorm],
    group_ranks: list[int],
    *,
    spatial=SPATIAL,
    dtype=torch.float32,
    memory_format=torch.contiguous_format,
    momentum: float | None = 0.1,
    steps: int = 2,
    tol: float = 1e-5,
) -> dict[str, float]:
    """Worst error ratio (<= 1 passes) of each quantity against float64 torch BatchNorm."""
    layer = make_layer()
    reference = torch_batchnorm_class(2 + len(spatial))(CHANNELS, momentum=momentum).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight = (1 + 0.5 * torch.randn(CHANNELS, generator=g, dtype=torch.float64)).float()
        bias = (0.3 * torch.randn(CHANNELS, generator=g, dtype=torch.float64)).float()
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
        reference.weight.copy_(weight.double())
        reference.bias.copy_(bias.double())
    members = [r for r in range(len(sizes)) if r in group_ranks]
    group_sizes = [sizes[r] for r in members]
    worst: dict[str, float] = {}

    def note(name, actual, expected, atol=tol, rtol=tol):
        worst[name] = max(worst.get(name, 0.0), error_ratio(actual, expected, atol, rtol))

    for step in range(steps):
        x_all, grad_all = _global_batch(sizes, spatial, seed=100 + step, dtype=dtype)
        x = _shard(x_all, sizes, rank).to(dtype).contiguous(memory_format=memory_format)
        x.requires_grad_()
        y = layer(x)
        y.backward(_shard(grad_all, sizes, rank).to(dtype).contiguous(memory_format=memory_format))

        # The reference: torch BatchNorm in float64 on the union of the group's batches.
        x_ref = torch.cat([_shard(x_all, sizes, r) for r in members]).requires_grad_()
        grad_ref = torch.cat([_shard(grad_all, sizes, r) for r in members])
        y_ref = reference(x_ref)
        y_ref.backward(grad_ref)  # gradient of L_sum
        mine = members.index(rank)
        note("output", y, _shard(y_ref.detach(), group_sizes, mine))
        note("input_grad", x.grad, _shard(x_ref.grad, group_sizes, mine))
        # DDP's average over the group versus the gradient of L_mean = L_sum / W.
        grads = [None] * len(sizes)
        dist.all_gather_object(grads, (layer.weight.grad.double(), layer.bias.grad.double()))
        w = len(members)
        note("weight_grad", sum(grads[r][0] for r in members) / w, reference.weight.grad / w)
        note("bias_grad", sum(grads[r][1] for r in members) / w, reference.bias.grad / w)
        note("running_mean", layer.running_mean, reference.running_mean)
        note("running_var", layer.running_var, reference.running_var)
        worst["num_batches_tracked"] = float(
            int(layer.num_batches_tracked) != int(reference.num_batches_tracked)
        )
        worst["keeps_memory_format"] = float(
            not y.is_contiguous(memory_format=memory_format) or y.dtype != dtype
        )
        layer.zero_grad()
        reference.zero_grad()
    return worst


def _sync_layer(**kwargs) -> Callable[[], SyncBatchNorm]:
    return lambda: SyncBatchNorm(CHANNELS, **kwargs)


def case_errors(rank: int, world_size: int) -> dict[str, object]:
    """Bad input raises on every rank, and the group is still usable afterwards."""
    out: dict[str, object] = {}
    try:
        SyncBatchNorm(CHANNELS)(torch.randn(2, CHANNELS + 1, 4, 4))
        out["wrong_channels"] = "no error"
    except ValueError as e:
        out["wrong_channels"] = str(e)
    # One value per channel over the whole group: rank 0 holds one sample of (N, C) input.
    x = torch.randn(1 if rank == 0 else 0, CHANNELS)
    try:
        SyncBatchNorm(CHANNELS)(x)
        out["single_value"] = "no error"
    except ValueError as e:
        out["single_value"] = str(e)
    check = torch.ones(1)
    dist.all_reduce(check)
    out["group_still_usable"] = int(check.item())
    return out


class _CountCollectives:
    """Wrap torch.distributed's collectives and record (name, numel, dtype) of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self._saved: dict[str, Callable] = {}

    def __enter__(self):
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                numel, dtype = (t.numel(), str(t.dtype)) if t is not None else (0, "")
                self.calls.append((_name, numel, dtype))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def case_collectives(rank: int, world_size: int) -> dict[str, object]:
    """Training: one collective per direction per layer with O(C) payload; eval: none."""
    model = torch.nn.Sequential(SyncBatchNorm(CHANNELS), SyncBatchNorm(CHANNELS))
    x = torch.randn(3 + rank, CHANNELS, 4, 4, requires_grad=True)
    out: dict[str, object] = {}
    with _CountCollectives() as c:
        y = model(x)
    out["train_forward"] = c.calls
    with _CountCollectives() as c:
        y.backward(torch.randn_like(y))
    out["train_backward"] = c.calls
    model.eval()
    with _CountCollectives() as c:
        y = model(x)
        y.backward(torch.randn_like(y))
    out["eval_forward_backward"] = c.calls
    return out


def case_subgroup_api(rank: int, world_size: int) -> dict[str, object]:
    """subgroup_for: cached per group size, clear error for a non-divisor; membership check."""
    from syncbn_lab.nn.comm import communicator_for, subgroup_for

    out: dict[str, object] = {}
    first = subgroup_for(2)
    out["cached"] = subgroup_for(2) is first
    out["pair_size"] = communicator_for(first).world_size
    out["pair_ranks"] = dist.get_process_group_ranks(first)
    try:
        subgroup_for(3)
        out["non_divisor"] = "no error"
    except ValueError as e:
        out["non_divisor"] = str(e)
    singletons = [dist.new_group([r]) for r in range(world_size)]  # all ranks create all
    not_mine = singletons[(rank + 1) % world_size]  # a group this rank is not in
    try:
        communicator_for(not_mine)
        out["not_member"] = "no error"
    except ValueError as e:
        out["not_member"] = str(e)
    return out


def _cases(world_size: int) -> dict[str, Callable[[int], object]]:
    everyone = list(range(world_size))
    cases: dict[str, Callable[[int], object]] = {}
    for split, sizes in SPLITS[world_size].items():
        cases[f"match_{split}"] = lambda r, s=sizes: _match(r, s, _sync_layer(), everyone)
    sizes = SPLITS[world_size]["uneven"]
    cases["match_momentum_none"] = lambda r: _match(
        r, sizes, _sync_layer(momentum=None), everyone, momentum=None, steps=3
    )
    cases["errors"] = lambda r: case_errors(r, world_size)
    cases["collectives"] = lambda r: case_collectives(r, world_size)
    if world_size == 2:
        sizes = SPLITS[2]["uneven"]
        cases["match_channels_last"] = lambda r: _match(
            r, sizes, _sync_layer(), everyone, memory_format=torch.channels_last
        )
        cases["match_5d_channels_last_3d"] = lambda r: _match(
            r, sizes, _sync_layer(), everyone, spatial=(3, 2, 2),
            memory_format=torch.channels_last_3d,
        )  # fmt: skip
        cases["match_3d"] = lambda r: _match(r, sizes, _sync_layer(), everyone, spatial=(6,))
        cases["match_2d"] = lambda r: _match(r, sizes, _sync_layer(), everyone, spatial=())
        cases["match_bf16"] = lambda r: _match(
            r, sizes, _sync_layer(), everyone, dtype=torch.bfloat16, tol=2e-2
        )
        cases["match_fp16"] = lambda r: _match(
            r, sizes, _sync_layer(), everyone, dtype=torch.float16, tol=5e-3
        )
    if world_size == 4:
        sizes = SPLITS[4]["uneven"]
        pairs = [[0, 1], [2, 3]]
        cases["subgroup_group_size_2"] = lambda r: _match(
            r, sizes, _sync_layer(group_size=2), pairs[r // 2]
        )

        def explicit_groups(r):
            groups = [dist.new_group(p) for p in pairs]  # every rank creates every group
            return _match(r, sizes, _sync_layer(process_group=groups[r // 2]), pairs[r // 2])

        cases["subgroup_process_group"] = explicit_groups
        cases["subgroup_api"] = lambda r: case_subgroup_api(r, world_size)
        even = [2, 4, 0, 6]  # each rank emulates 2 devices: local batches split in two

        def emulated_devices(group_size):
            def make():
                return SyncBatchNorm(CHANNELS, group_size=group_size, device_slices=2)

            return make

        cases["devices_2_global"] = lambda r: _match(r, even, emulated_devices(None), everyone)
        cases["devices_2_group_size_4"] = lambda r: _match(
            r, even, emulated_devices(4), pairs[r // 2]
        )
        cases["devices_2_group_size_2"] = lambda r: _match(r, even, emulated_devices(2), [r])
    return cases


def run_all(rank: int, world_size: int) -> dict[str, object]:
    """Every case in order on this rank; an exception is recorded as ``{"exception": tb}``."""
    results: dict[str, object] = {}
    for name, case in _cases(world_size).items():
        torch.manual_seed(1234 + rank)
        try:
            results[name] = case(rank)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
    return results


def echo_rank(rank: int, world_size: int) -> tuple[int, int, int]:
    """For the harness test: who am I, and does a collective work."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return rank, world_size, int(t.item())


def fail_on_rank_1(rank: int, world_size: int) -> None:
    """For the harness test: rank 1 raises while the others wait in a collective."""
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))
