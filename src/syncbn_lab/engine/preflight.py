"""The preflight check (``trainer.preflight``): the run's gradients against float64 before
the first optimizer step.

One training batch goes through the run's own step, as it will train: its precision,
layout, compilation, norm kernels and parallel mode (emulated device slices, or DDP with
its gradient all-reduce and SyncBN's collectives). The same batch then goes through the
same model in float64, NCHW, eager, on the reference norm implementation (a replica built
from the config, holding the run's weights; under DDP every rank checks its own replica and
batch and the replicas' gradients are averaged over the ranks as DDP averages them). Every
parameter's gradient, and the loss, must agree within the precision's tolerance
(:data:`TOLERANCES`, relative L2 error ``||g - g64|| / ||g64||`` per tensor).

Beyond it, the run stops with one line that names the worst tensor, its error, and the
setting whose change brings it within (each setting that the step turns on is turned off
once, on a fresh replica, to find it), before metrics, checkpoints or W&B are written.
Nothing of the run changes: parameters, buffers (running statistics, emulated devices'
statistics), gradients and random streams are as they were before the check.

Why: a wrong kernel trains silently. oneDNN's AVX2 strided 1x1 convolution (issue 6035)
gave weight gradients 0.88 off at two threads with no error; any model that reaches a bug
of that kind fails here instead of training on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from syncbn_lab.engine import compute
from syncbn_lab.engine.precision import autocast, model_dtype
from syncbn_lab.engine.rng import rng_state, set_rng_state
from syncbn_lab.errors import OneLineError
from syncbn_lab.loss import at_least_fp32

# Relative L2 error ``||g - g64|| / ||g64||`` per tensor (and of the loss) that a float64
# or float32 step may show against float64 on one batch. A correct float32 step reaches
# 1.6e-2 on the project's models: the gradients of early layers are ill-conditioned (BN
# removes what their weights' scale does), and torch's CPU channels_last BatchNorm
# accumulates ~1000x less precisely than its NCHW kernel (7.9e-5 against 6.2e-8 on one
# (64, 16, 28, 28) layer); resnet8 at width 16, channels_last: 2e-3 to 1.6e-2, NCHW: up to
# 1.1e-3. The bugs the check exists for are far beyond: oneDNN issue 6035 puts the shortcut's
# weight gradient 2e2 to 4.5e2 off (width 4, two threads), a kernel 1.5x off is 0.5 off.
# Autocast steps are held to a plain autocast step on the same batch instead
# (``_Reference.tolerance``).
TOLERANCES = {"fp64": 1e-6, "fp32": 0.1}
AUTOCAST_MARGIN = 4.0

# A tensor whose float64 gradient is smaller than this fraction of the largest one is compared
# against that floor instead of its own norm. A gradient that is a sum whose terms cancel has no
# meaningful relative error: resnet8 at width 2 on Animal-MNIST (seed 2, 256 images,
# channels_last) has stages.0.bn2.bias's gradient at 4.5e-4 against the largest, 0.149; float32
# puts it 1.2e-4 off, as far as its neighbours (bn1.bias 1.4e-4, conv weights up to 7.7e-4),
# which is 0.26 of its own norm but 0.04 of the floor. A kernel 1.5x off still shows on every
# tensor above 0.4 % of the largest (0.5 x 0.004 / 0.02 = 0.1), and on everything upstream of it.
_FLOOR = 0.02


class PreflightFailed(OneLineError):
    """The run's step computes gradients that float64 does not: a numerics bug, not a
    setting the user got wrong."""

    reason = "preflight"


@dataclass(frozen=True)
class Step:
    """How one step computes: what the run configures, or the float64 reference."""

    precision: str
    channels_last: bool
    fused: bool  # norm layers on their configured impl (else impl="reference")
    compiled: bool

    def levers(self) -> list[tuple[str, Step]]:
        """(the setting that turns one lever off, this step with that lever off)."""
        out = []
        if self.compiled:
            out.append(("trainer.compile=false", _replace(self, compiled=False)))
        if self.channels_last:
            out.append(("trainer.channels_last=false", _replace(self, channels_last=False)))
        if self.fused:
            out.append(("bn.impl=reference", _replace(self, fused=False)))
        if self.precision not in ("fp32", "fp64"):
            out.append(("trainer.precision=fp32", _replace(self, precision="fp32")))
        return out

    def describe(self) -> str:
        parts = [self.precision, "channels_last" if self.channels_last else "NCHW"]
        parts += ["compiled"] * self.compiled + ["fused norm kernels"] * self.fused
        return ", ".join(parts)


REFERENCE = Step(precision="fp64", channels_last=False, fused=False, compiled=False)


def _replace(step: Step, **changes) -> Step:
    return Step(**{**step.__dict__, **changes})


# replica(fused) -> a fresh float32 NCHW copy of the run's model on its device, holding the
# run's weights and buffers, its norm layers on the configured impl (fused) or the reference
Replica = Callable[[bool], nn.Module]


def check(trainer, replica: Replica, fused: bool, chunks: int = 1) -> dict[str, float | str]:
    """Run the check for ``trainer`` (every rank calls it); return what the run's summary
    records, or raise :class:`PreflightFailed`. ``fused``: the run's norm layers take the
    fused kernels (an impl other than "reference" where they are built). ``chunks``: the
    replicas one process's batch is split into outside the norm layers (DataParallel's)."""
    started = time.perf_counter()
    t = trainer.trainer_cfg
    configured = Step(t.precision, bool(t.get("channels_last")), fused, trainer.compiled)
    reference = _Reference(trainer, replica, chunks)
    with _untouched(trainer) as untouched:
        images, labels = _first_batch(trainer)
        loss, grads = _configured_step(trainer, images, labels)
        untouched.restore()  # the replicas start from the run's state, not the step's
        ref_loss, ref_grads = reference.step(REFERENCE, images, labels)
        tolerance = reference.tolerance(configured.precision, images, labels, ref_loss, ref_grads)
        name, error, allowed = _worst(trainer.rt, loss, grads, ref_loss, ref_grads, tolerance)
        if error > allowed:
            raise _failure(reference, configured, images, labels, (name, error, allowed))
    return {
        "preflight_worst_tensor": name,
        "preflight_error": error,
        "preflight_tolerance": allowed,
        "preflight_s": time.perf_counter() - started,
    }


def _failure(reference, configured, images, labels, worst) -> PreflightFailed:
    """The one-line error, with the first lever whose removal brings the step within."""
    name, error, allowed = worst
    ref_loss, ref_grads = reference.step(REFERENCE, images, labels)
    found = ""
    for setting, step in configured.levers():
        loss, grads = reference.step(step, images, labels)
        tolerance = reference.tolerance(step.precision, images, labels, ref_loss, ref_grads)
        _, trial, within = _worst(reference.rt, loss, grads, ref_loss, ref_grads, tolerance)
        if trial <= within:
            found = f"; with {setting} it is {trial:.1e}: run with {setting}"
            break
    if not found:
        found = (
            "; no single setting brings it within: run with trainer.precision=fp32 "
            "trainer.channels_last=false trainer.compile=false bn.impl=reference, and report "
            "the bug"
        )
    what = "the loss" if name == "loss" else f"the gradient of {name}"
    return PreflightFailed(
        f"preflight: {what} is {error:.2g} off the float64 reference (relative L2 error; "
        f"{configured.precision} allows {allowed:.2g} here) in this run's step "
        f"({configured.describe()}){found} (trainer.preflight=false skips this check)"
    )


def _first_batch(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """The first micro-batch the run trains on from here (its epoch and step)."""
    trainer.position_loader()
    images, labels = next(iter(trainer.loaders.train))
    return images, labels


def _configured_step(trainer, images, labels) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of the run's own (wrapped, maybe compiled) model, as a training
    step does them (fp16: scaled, then unscaled); no optimizer step."""
    rt = trainer.rt
    trainer.model.train()
    images = compute.to_device(images, rt.device, trainer.layout)
    labels = labels.to(rt.device)
    with autocast(rt.device, trainer.trainer_cfg.precision):
        loss, _, _ = trainer.forward_loss(images, labels)
    scale = trainer.scaler.get_scale() if trainer.scaler.is_enabled() else 1.0
    (loss * scale).backward()
    grads = {n: p.grad.detach().double() / scale for n, p in _with_grad(trainer.module)}
    return loss.detach().double(), grads


@dataclass
class _Reference:
    """Steps of fresh eager replicas of the run's model (the float64 reference, and the
    trials of a failure)."""

    trainer: object
    replica: Replica
    chunks: int

    @property
    def rt(self):
        return self.trainer.rt

    def step(self, step: Step, images, labels) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of a replica computing as ``step`` says. Under DDP the
        gradients are averaged over the ranks, as DDP's all-reduce does; under DataParallel
        the batch goes through in its replicas' chunks."""
        rt = self.rt
        dtype, layout = model_dtype(step.precision), compute.memory_format(step.channels_last)
        model = self.replica(step.fused).to(dtype=dtype, memory_format=layout).train()
        images = compute.to_device(images.to(dtype), rt.device, layout)
        labels = labels.to(rt.device)
        with autocast(rt.device, step.precision):
            logits = torch.cat([model(chunk) for chunk in images.chunk(self.chunks)])
            loss = F.cross_entropy(at_least_fp32(logits), labels)
        loss.backward()
        grads = {}
        for name, p in _with_grad(model):
            grad = p.grad.detach().double()
            if rt.distributed:
                rt.all_reduce_sum(grad)
                grad /= rt.world_size
            grads[name] = grad
        return loss.detach().double(), grads

    def tolerance(self, precision, images, labels, ref_loss, ref_grads) -> Callable[[str], float]:
        """name -> the relative error ``precision`` may show on that tensor. fp32 and fp64:
        :data:`TOLERANCES`. Autocast (bf16, fp16) rounds some gradients (those of norm
        weights over small slices, which cancel) by 100 % and more on a correct step, so
        each tensor may be :data:`AUTOCAST_MARGIN` times as far off as it is in a plain
        autocast step (eager, NCHW, reference norms) on the same batch, and at least
        :data:`TOLERANCES`' fp32 figure."""
        if precision in ("fp32", "fp64"):
            return lambda name: TOLERANCES[precision]
        plain = _replace(REFERENCE, precision=precision)
        loss, grads = self.step(plain, images, labels)
        errors = _errors(loss, grads, ref_loss, ref_grads)
        return lambda name: max(TOLERANCES["fp32"], AUTOCAST_MARGIN * errors.get(name, 0.0))


def _with_grad(model: nn.Module):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]


def _errors(loss, grads, ref_loss, ref_grads) -> dict[str, float]:
    """name -> relative L2 error of each gradient, and "loss" -> the loss's relative error
    (unless ``loss`` is None); inf for a missing or non-finite one."""
    largest = max((g.norm().item() for g in ref_grads.values()), default=0.0)
    errors = {}
    for name, ref in ref_grads.items():
        if name not in grads:
            errors[name] = float("inf")
            continue
        scale = max(ref.norm().item(), _FLOOR * largest, 1e-300)
        error = (grads[name] - ref).norm().item() / scale
        errors[name] = error if error == error else float("inf")  # NaN: wrong
    if loss is not None:
        error = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-300)
        errors["loss"] = error if error == error else float("inf")
    return errors


def _worst(rt, loss, grads, ref_loss, ref_grads, tolerance) -> tuple[str, float, float]:
    """(name, error, allowed) of the tensor furthest beyond its tolerance (the loss counts
    as one), the same on every rank: the worst of any rank."""
    errors = _errors(loss, grads, ref_loss, ref_grads)
    allowed = {name: tolerance(name) for name in errors}
    name = max(errors, key=lambda n: errors[n] / allowed[n])
    if rt.distributed:  # the rank whose worst tensor is furthest beyond decides for all
        import torch.distributed as dist

        local = torch.tensor([errors[name] / allowed[name]], dtype=torch.float64, device=rt.device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        ratio = local.item()
        return name, ratio * allowed[name], allowed[name]
    return name, errors[name], allowed[name]


class _untouched:
    """Everything a step changes, as it was: parameters and buffers, the emulated devices'
    running statistics, gradients (none), and every random stream."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __enter__(self):
        t = self.trainer
        self.state = {k: v.detach().clone() for k, v in t.module.state_dict().items()}
        self.device_stats = [(d.mean.clone(), d.var.clone()) for d in t.device_stats]
        self.rng = rng_state()
        return self

    def restore(self) -> None:
        t = self.trainer
        with torch.no_grad():
            t.module.load_state_dict(self.state)
            for stats, (mean, var) in zip(t.device_stats, self.device_stats, strict=True):
                stats.mean.copy_(mean)
                stats.var.copy_(var)
        t.optimizer.zero_grad(set_to_none=True)

    def __exit__(self, *exc):
        self.restore()
        set_rng_state(self.rng)
        return False


def takes_fused(model: nn.Module) -> bool:
    """Whether ``model``'s norm layers run on the fused kernels (an impl other than
    "reference", and the kernels built)."""
    from syncbn_lab.nn.functional import fused_unavailable_reason

    layers = [m for m in model.modules() if getattr(m, "impl", "reference") != "reference"]
    return bool(layers) and fused_unavailable_reason() is None


def summary_line(checked: dict[str, float | str]) -> str:
    """The run log's line for a check that passed."""
    return (
        f"preflight: gradients match float64 (worst {checked['preflight_worst_tensor']}: "
        f"{checked['preflight_error']:.1e}, allowed {checked['preflight_tolerance']:g}) "
        f"in {checked['preflight_s']:.1f} s"
    )
