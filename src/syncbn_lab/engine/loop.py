"""The training loop: optimizer steps over micro-batches, evaluation, checkpoints, logs.

The loop holds no global state; everything parallel comes in through ``Runtime`` and
the wrapped model, so the same loop runs single-device, DDP and emulated N-device jobs.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.profiler import record_function
from torch.utils.data import DataLoader

from syncbn_lab.engine import checkpoint, compute, preemption
from syncbn_lab.engine.batch_stats import batch_statistics
from syncbn_lab.engine.evaluate import evaluate
from syncbn_lab.engine.optim import lr_factor
from syncbn_lab.engine.precise_bn import update_bn_stats
from syncbn_lab.engine.precision import autocast
from syncbn_lab.engine.rng import rng_state, set_rng_state
from syncbn_lab.errors import Diverged, Preempted
from syncbn_lab.loss import at_least_fp32
from syncbn_lab.parallel.bn_buffers import BNBuffers
from syncbn_lab.parallel.context import Runtime
from syncbn_lab.traffic import TRAFFIC


@dataclass
class Loaders:
    train: DataLoader
    val: DataLoader
    test: DataLoader
    # the test set in whole groups of the normalisation batch (trainer.eval_batch_stats)
    test_groups: DataLoader | None = None


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    step_in_epoch: int = 0  # optimizer steps taken in epoch ``epoch`` (0 at an epoch's start)
    best_val_acc: float = float("-inf")
    history: dict[str, Any] = field(default_factory=dict)


@dataclass
class EpochProgress:
    """What this process has summed since the epoch (``totals``) and the log window
    (``window``) began: [loss sum, correct, count] of its samples, not yet reduced."""

    totals: torch.Tensor
    window: torch.Tensor
    window_images: int = 0
    window_time: float = 0.0


class PhaseClock:
    """Seconds this process spends in each phase of a run outside its training steps
    (validation, checkpoints, logging, the test passes): ``with clock("validation"): ...``.
    A phase entered inside another counts towards the inner one only (best.pt written during
    a validation is checkpoint time), so the phases never add up to more than the wall time.
    ``now``: the clock to read (a fake one in tests)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.seconds: dict[str, float] = {}
        self._open: list[list] = []  # [phase, since] of the phases entered, innermost last

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._pause()
        self._open.append([phase, self.now()])
        try:
            yield
        finally:
            self._pause()
            self._open.pop()
            if self._open:
                self._open[-1][1] = self.now()

    def _pause(self) -> None:
        """Credit the innermost open phase with the time since it was last credited."""
        if self._open:
            now = self.now()
            phase, since = self._open[-1]
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - since
            self._open[-1][1] = now

    def summary(self) -> dict[str, float]:
        """{"time_<phase>_s": seconds} for the summary."""
        return {f"time_{phase}_s": seconds for phase, seconds in self.seconds.items()}


class Trainer:
    """Runs ``fit`` for one process. ``model`` may be wrapped (DDP, DataParallel, emulated
    devices); ``model_without_ddp`` is what gets evaluated and checkpointed (as in
    torchvision's references). ``bn_buffers`` reconciles the devices' BN running statistics
    before each evaluation (``parallel.dist_bn``)."""

    def __init__(
        self,
        cfg: DictConfig,
        rt: Runtime,
        model: nn.Module,
        model_without_ddp: nn.Module,
        optimizer: torch.optim.Optimizer,
        loaders: Loaders,
        logger,
        run_dir: Path,
        bn_buffers: BNBuffers | None = None,
        model_loss: Callable | None = None,
    ):
        self.cfg, self.rt = cfg, rt
        self.module = model_without_ddp
        self.layout = compute.memory_format(cfg.trainer.get("channels_last", False))
        self.compiled = bool(cfg.trainer.get("compile", False))
        self.model = model  # compiled: as one graph, except under DDP (engine/compute.py)
        if self.compiled:
            self.model = compute.compile_model(model, fullgraph=not rt.distributed)
            self.compile_counts = compute.compile_counts()  # the run's own count from here
        self.optimizer, self.loaders, self.logger = optimizer, loaders, logger
        self.run_dir = run_dir
        self.bn_buffers = bn_buffers if bn_buffers is not None else BNBuffers()
        self.model_loss = model_loss  # the wrapped model computes the loss (Parallel's)
        self.no_sync = _no_sync(model)  # the wrapped model's, compiled or not
        self.device_stats = getattr(model, "device_stats", [])  # emulated devices 1..N-1
        self.callbacks = _instantiate_callbacks(cfg.trainer.get("callbacks"))
        self.trainer_cfg = cfg.trainer
        self.accumulate = cfg.trainer.accumulate
        self.steps_per_epoch, self.total_steps = step_counts(cfg.trainer, len(loaders.train))
        self.val_steps = val_steps_in_epoch(cfg.trainer.eval_every, self.steps_per_epoch)
        # within-epoch validation only in the first this many epochs (None: in every epoch)
        self.dense_epochs = cfg.trainer.get("eval_dense_epochs")
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.state = TrainState()
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=cfg.trainer.precision == "fp16")
        self.train_time = 0.0
        self.images_seen = 0
        self.clock = PhaseClock()  # where the time outside the training steps goes
        self.progress = self.new_progress()
        # [loss sum, correct, count] of the last finished epoch over all devices (the summary)
        self.last_epoch_totals = torch.zeros(3, dtype=torch.float64, device=rt.device)
        self.every_steps, self.every_s = checkpoint.parse_every(cfg.trainer.get("checkpoint_every"))
        self.last_checkpoint = time.monotonic()

    def position_loader(self) -> None:
        """Point the training loader at the run's epoch and step: its sampler's order and
        start, and the dataset's augmentation draws (fit, and the preflight check's batch)."""
        loader, state = self.loaders.train, self.state
        loader.batch_sampler.set_epoch(state.epoch, start=state.step_in_epoch * self.accumulate)
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(state.epoch)

    def new_progress(self) -> EpochProgress:
        zeros = torch.zeros(3, dtype=torch.float64, device=self.rt.device)
        return EpochProgress(totals=zeros, window=zeros.clone())

    # -- checkpoints ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise resume needs, at an epoch boundary or within an epoch. Call
        on every rank: each rank's own state (RNG streams, running statistics, partial
        sums) is gathered to rank 0 (``ranks``); the rest is the same on every rank."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.state.epoch,
            "step": self.state.step,
            "step_in_epoch": self.state.step_in_epoch,
            "best_val_acc": self.state.best_val_acc,
            "last_epoch_totals": self.last_epoch_totals.cpu(),
            "train_time_s": self.train_time,
            "images_seen": self.images_seen,
            "ranks": _gather(self.rt, self.rank_state()),
            "resume_key": checkpoint.resume_key(self.cfg),
        }

    def rank_state(self) -> dict[str, Any]:
        """This process's part of a checkpoint."""
        p = self.progress
        return {
            "rng": rng_state(),
            "buffers": [b.detach().cpu().clone() for b in self.module.buffers()],
            "device_stats": [(d.mean.cpu(), d.var.cpu()) for d in self.device_stats],
            "totals": p.totals.cpu(),
            "window": p.window.cpu(),
            "window_images": p.window_images,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.bn_buffers.adopt_module_buffers()  # every (emulated) device resumes from them
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.state.epoch, self.state.step = state["epoch"], state["step"]
        self.state.step_in_epoch = state.get("step_in_epoch", 0)
        self.state.best_val_acc = state["best_val_acc"]
        self.train_time = state.get("train_time_s", 0.0)
        self.images_seen = state.get("images_seen", 0)
        if "last_epoch_totals" in state:
            self.last_epoch_totals = state["last_epoch_totals"].to(self.rt.device)
        ranks = state.get("ranks")
        if ranks is None:  # a checkpoint from before per-rank state: the epoch's start
            torch.set_rng_state(state["torch_rng"])
            return
        own = ranks[self.rt.rank]
        set_rng_state(own["rng"])
        with torch.no_grad():
            for buffer, saved in zip(self.module.buffers(), own["buffers"], strict=True):
                buffer.copy_(saved)
            for stats, (mean, var) in zip(self.device_stats, own["device_stats"], strict=True):
                stats.mean.copy_(mean)
                stats.var.copy_(var)
        device = self.rt.device
        self.progress = EpochProgress(
            totals=own["totals"].to(device),
            window=own["window"].to(device),
            window_images=own["window_images"],
        )

    def save(self, name: str) -> Path:
        """Write checkpoints/<name> (rank 0); every rank must call it (it gathers)."""
        with self.clock("checkpoints"):
            return self._save(name)

    def _save(self, name: str) -> Path:
        state = self.state_dict()
        path = self.run_dir / "checkpoints" / name
        if self.rt.is_main:
            checkpoint.save_atomic(state, path)
        if self.rt.distributed:  # no rank goes on (or exits) before the file is there
            import torch.distributed as dist

            dist.barrier()
        self.last_checkpoint = time.monotonic()
        return path

    def agree(self, totals: torch.Tensor) -> tuple[float, bool, bool]:
        """After a step, one small collective so that every rank decides alike: (the step's
        mean training loss over all devices, stop now, checkpoint now). Stop: a rank received
        a stop signal. Checkpoint: ``trainer.checkpoint_every`` steps or seconds passed on
        rank 0."""
        due = False
        if self.rt.is_main:
            if self.every_steps:
                due = self.state.step % self.every_steps == 0
            elif self.every_s:
                due = time.monotonic() - self.last_checkpoint >= self.every_s
        flags = torch.stack(
            [
                totals[0],
                totals[2],
                totals.new_tensor(float(preemption.requested() is not None)),
                totals.new_tensor(float(due)),
            ]
        )
        loss_sum, count, stop, checkpoint_due = self.rt.all_reduce_sum(flags).tolist()
        return loss_sum / max(count, 1.0), stop > 0, checkpoint_due > 0

    # -- one optimizer step ---------------------------------------------------
    def set_lr(self) -> float:
        factor = lr_factor(self.cfg.sched, self.state.step, self.total_steps, self.steps_per_epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        return self.base_lrs[0] * factor

    def train_step(self, micro_batches: list) -> torch.Tensor:
        """Forward/backward over the micro-batches, then one optimizer step.

        Returns [loss sum, correct, count] of this process's samples (not yet reduced).
        """
        totals = torch.zeros(3, dtype=torch.float64, device=self.rt.device)
        precision = self.trainer_cfg.precision
        for i, (images, labels) in enumerate(micro_batches):
            images = compute.to_device(images, self.rt.device, self.layout)
            labels = labels.to(self.rt.device, non_blocking=True)
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                with autocast(self.rt.device, precision), record_function("forward"):
                    loss, correct, count = self.forward_loss(images, labels)
                with record_function("backward"):
                    self.scaler.scale(loss / len(micro_batches)).backward()
            with torch.no_grad():
                totals[0] += loss.detach() * count
                totals[1] += correct
                totals[2] += count
        with record_function("optimizer"):
            if self.trainer_cfg.grad_clip:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.model.parameters(), self.trainer_cfg.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return totals

    def forward_loss(self, images: torch.Tensor, labels: torch.Tensor):
        """(mean loss over these samples, correct, count); the loss may be computed inside
        the model's replicas (parallel=dp with parallel.loss_in_module)."""
        if self.model_loss is not None:
            return self.model_loss(self.model, images, labels)
        try:
            logits = self.model(images)
        except Exception as e:
            error = compute.compile_error(e) if self.compiled else None
            if error is None:
                raise
            raise error from None
        loss = F.cross_entropy(at_least_fp32(logits), labels)
        return loss, (logits.argmax(1) == labels).sum(), labels.numel()

    # -- the loop -------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, rt, state = self.trainer_cfg, self.rt, self.state
        epochs = cfg.epochs
        val = {}
        steps_here = 0  # optimizer steps this process ran (a resumed run counts from there)
        TRAFFIC.reset()  # count only this fit's training steps
        train_time_before = self.train_time
        self.model.train()
        while state.epoch < epochs and state.step < self.total_steps:
            epoch = state.epoch
            start = state.step_in_epoch  # > 0 when resumed from a checkpoint within the epoch
            self.position_loader()
            p = self.progress
            progress = _progress(self.steps_per_epoch, epoch, start, enabled=rt.is_main)
            batches = iter(self.loaders.train)
            for step_in_epoch in range(start, self.steps_per_epoch):
                if state.step >= self.total_steps:
                    break
                t0 = time.perf_counter()  # data loading counts towards images/s
                with record_function("data"):  # the phases engine/profile.py reports
                    micro = [next(batches) for _ in range(self.accumulate)]
                lr = self.set_lr()
                totals = self.train_step(micro)
                elapsed = time.perf_counter() - t0
                state.step += 1
                state.step_in_epoch = step_in_epoch + 1
                steps_here += 1
                for callback in self.callbacks:
                    callback(self)
                images = self.cfg.trainer.global_batch_size
                self.train_time += elapsed
                self.images_seen += images
                p.window += totals
                p.totals += totals
                p.window_images += images
                p.window_time += elapsed
                loss, stop, checkpoint_due = self.agree(totals)
                if not math.isfinite(loss):
                    self.log({**_record(state.step, lr=lr), "train/loss": loss})
                    raise Diverged(state.step, loss, lr)
                if state.step % cfg.log_every == 0:
                    reduced = rt.all_reduce_sum(p.window.clone())
                    record = _record(
                        state.step,
                        epoch + (step_in_epoch + 1) / self.steps_per_epoch,
                        lr,
                        reduced,
                        p.window_images / max(p.window_time, 1e-9),
                    )
                    self.log(record)
                    if progress is not None:
                        progress.set_postfix(
                            loss=f"{record['train/loss']:.4f}",
                            acc=f"{record['train/acc']:.2f}",
                            img_s=f"{record['images_per_s']:.0f}",
                        )
                    p.window.zero_()
                    p.window_images, p.window_time = 0, 0.0
                # val within the epoch (trainer.eval_every < 1), before a stop's or a due
                # checkpoint: a run resumed from it continues after this evaluation
                within = self.dense_epochs is None or epoch < self.dense_epochs
                within = within and state.step_in_epoch in self.val_steps
                if within and state.step < self.total_steps:
                    record = _record(state.step, epoch + state.step_in_epoch / self.steps_per_epoch)
                    val = self.validate(record)
                    self.log(record)
                    if rt.is_main:
                        (progress.write if progress is not None else print)(_epoch_line(record))
                if progress is not None:
                    progress.update(1)
                if stop:
                    path = self.save("last.pt")
                    signum = preemption.requested() or preemption.STOP_SIGNALS[0]
                    raise Preempted(preemption.signal_name(signum), signum, state.step, str(path))
                if checkpoint_due:
                    self.save("last.pt")
            if progress is not None:
                progress.close()
            state.epoch += 1
            state.step_in_epoch = 0
            self.last_epoch_totals = last_epoch_totals = rt.all_reduce_sum(p.totals.clone())
            self.progress = self.new_progress()
            finished = state.epoch >= epochs or state.step >= self.total_steps
            record = _record(
                state.step,
                state.epoch,
                self.optimizer.param_groups[0]["lr"],
                last_epoch_totals,
                self.images_seen / max(self.train_time, 1e-9),
            )
            if self._validate_at_epoch_end(state.epoch) or finished:
                val = self.validate(record)
            self.log(record)
            self.save("last.pt")
            if rt.is_main:  # stays on the screen (the progress bar does not) and in train.log
                print(_epoch_line(record), flush=True)
            if finished:
                break
        traffic = TRAFFIC.per_step(steps_here) if rt.distributed else {}
        steps_time = self.train_time - train_time_before
        with self.clock("test"):
            test = self.evaluate(self.loaders.test)
        result = {
            "test_acc": test["acc"],
            "test_loss": test["loss"],
            "val_acc": val.get("acc", float("nan")),
            "best_val_acc": state.best_val_acc,
            "train_loss": (
                self.last_epoch_totals[0] / self.last_epoch_totals[2].clamp(min=1)
            ).item(),
            "epochs": state.epoch,
            "steps": state.step,
            "train_time_s": self.train_time,
            "images_per_s": self.images_seen / max(self.train_time, 1e-9),
            "step_time_s": self.train_time / max(state.step, 1),
            **traffic,  # DDP: bytes this rank handed to collectives per training step
        }
        if self.compiled:  # graphs compiled and recompilations in this process's fit
            counts = compute.compile_counts()
            result.update({k: counts[k] - self.compile_counts[k] for k in counts})
        if cfg.get("eval_batch_stats"):
            with self.clock("test_batch_stats"):
                result.update(self.batch_stats(test))
        if cfg.precise_bn_batches:
            with self.clock("precise_bn"):
                result.update(self.precise_bn(test))
        # this process's seconds: its training steps (train_time_s counts a resumed run's
        # earlier processes too) and each phase outside them
        return {**result, "time_steps_s": steps_time, **self.clock.summary()}

    def _validate_at_epoch_end(self, epochs_done: int) -> bool:
        """Whether val is due after ``epochs_done`` epochs: every ``eval_every`` epochs, or
        with a fraction every epoch, until the ``eval_dense_epochs``, then every
        ``eval_sparse_every`` epochs (the last epoch always validates: see fit)."""
        cfg = self.trainer_cfg
        if cfg.eval_every >= 1:
            return epochs_done % cfg.eval_every == 0
        if self.dense_epochs is None or epochs_done <= self.dense_epochs:
            return True
        return (epochs_done - self.dense_epochs) % cfg.get("eval_sparse_every", 1) == 0

    def log(self, record: dict[str, Any]) -> None:
        with self.clock("logging"):
            self.logger.log(record)

    def validate(self, record: dict[str, Any]) -> dict[str, float]:
        """Evaluate on val, add val/loss and val/acc to ``record``, and write best.pt when
        val accuracy is the best so far (every rank calls it: it may save)."""
        with self.clock("validation"):
            val = self.evaluate(self.loaders.val)
        record.update({"val/loss": val["loss"], "val/acc": val["acc"]})
        if val["acc"] > self.state.best_val_acc:
            self.state.best_val_acc = val["acc"]
            self.save("best.pt")
        return val

    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        with self.bn_buffers.evaluation():
            return self.evaluate_module(loader)

    def evaluate_module(self, loader: DataLoader) -> dict[str, float]:
        """``loader`` through the unwrapped module as its BN buffers stand on this process."""
        return evaluate(self.module, loader, self.rt, self.trainer_cfg.precision, self.layout)

    def batch_stats(self, test_ema: dict[str, float]) -> dict[str, float]:
        """The test set again, each group of as many test images as one norm layer's training
        batch normalised with its own statistics (engine.batch_stats; trainer.eval_batch_stats).
        No buffer is read or changed, so neither dist_bn nor a checkpoint takes part. A model
        without BatchNorm has no batch statistics: the EMA numbers."""
        loader = self.loaders.test_groups
        with batch_statistics(self.module, loader.sampler.group) as layers:
            test = self.evaluate_module(loader) if layers else test_ema
        return {"test_acc_batch_stats": test["acc"], "test_loss_batch_stats": test["loss"]}

    def precise_bn(self, test_ema: dict[str, float]) -> dict[str, float]:
        """PreciseBN from trainer.precise_bn_batches training batches, then the test set
        again (a model without BatchNorm has nothing to recompute: the same numbers)."""
        self.loaders.train.batch_sampler.set_epoch(self.state.epoch)
        layers = update_bn_stats(
            self.module,
            self.loaders.train,
            self.trainer_cfg.precise_bn_batches,
            self.rt,
            autocast=lambda: autocast(self.rt.device, self.trainer_cfg.precision),
            layout=self.layout,
        )
        if not layers:
            test = test_ema
        else:
            self.bn_buffers.adopt_module_buffers()
            test = self.evaluate(self.loaders.test)
            self.save("last_precise_bn.pt")
        return {"test_acc_precise_bn": test["acc"], "test_loss_precise_bn": test["loss"]}


def _no_sync(model: nn.Module):
    """DDP's no_sync for micro-steps before the last (a context factory); nothing to do for
    other models."""
    return model.no_sync if hasattr(model, "no_sync") else contextlib.nullcontext


def step_counts(trainer_cfg: DictConfig, train_batches: int) -> tuple[int, int]:
    """(optimizer steps per epoch, optimizer steps of the run) for ``train_batches`` loader
    batches per epoch: ``accumulate`` batches a step, ``epochs`` epochs, capped at
    ``max_steps``."""
    per_epoch = train_batches // trainer_cfg.accumulate
    total = trainer_cfg.epochs * per_epoch
    if trainer_cfg.max_steps is not None:
        total = min(total, trainer_cfg.max_steps)
    return per_epoch, total


def val_steps_in_epoch(eval_every: float, steps_per_epoch: int) -> frozenset[int]:
    """The optimizer steps of an epoch, counted from its start, after which val is evaluated
    within the epoch: none for a whole number of epochs ``trainer.eval_every``; for a fraction
    f < 1, floor(j f S) for j = 1, 2, ... while j f < 1 (S = ``steps_per_epoch``; those in
    1 .. S - 1, each once). Every epoch's end (step S) is evaluated too: f = 0.25 with S = 781
    evaluates after steps 195, 390, 585 and 781 of each epoch."""
    if eval_every >= 1:
        return frozenset()
    steps, j = set(), 1
    while j * eval_every < 1 - 1e-9:
        steps.add(math.floor(j * eval_every * steps_per_epoch + 1e-9))
        j += 1
    return frozenset(k for k in steps if 0 < k < steps_per_epoch)


def _instantiate_callbacks(nodes) -> list:
    """trainer.callbacks: Hydra ``_target_`` nodes, each instantiated once per process into a
    callable run as ``callback(trainer)`` after every optimizer step (``trainer.state.step``
    and ``trainer.rt.rank`` say where it is). ``syncbn_lab.faults.Fault`` is one."""
    if not nodes:
        return []
    from hydra.utils import instantiate

    return [instantiate(node) for node in nodes]


def _progress(total: int, epoch: int, done: int, enabled: bool):
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    desc = f"epoch {epoch + 1}"
    return tqdm(total=total, initial=done, desc=desc, leave=False, dynamic_ncols=True)


def _gather(rt: Runtime, obj: Any) -> list[Any]:
    """``obj`` of every process, in rank order (a collective under DDP)."""
    if not rt.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * rt.world_size
    dist.all_gather_object(out, obj)
    return out


def _record(
    step: int,
    epoch: float | None = None,
    lr: float | None = None,
    totals: torch.Tensor | None = None,
    images_per_s: float | None = None,
) -> dict[str, Any]:
    """One metrics.jsonl record: the step, and what is given of the epoch, the learning
    rate, the training loss and accuracy of ``totals`` (loss sum, correct, images) and the
    throughput, in that order."""
    record: dict[str, Any] = {"step": step}
    if epoch is not None:
        record["epoch"] = epoch
    if lr is not None:
        record["lr"] = lr
    if totals is not None:
        images = totals[2].clamp(min=1)
        record["train/loss"] = (totals[0] / images).item()
        record["train/acc"] = (100 * totals[1] / images).item()
    if images_per_s is not None:
        record["images_per_s"] = images_per_s
    return record


def _epoch_line(record: dict[str, Any]) -> str:
    parts = [f"epoch {record['epoch']:g}", f"step {record['step']}"]
    for key in ("train/loss", "train/acc", "val/loss", "val/acc", "images_per_s"):
        if key in record:
            parts.append(
                f"{key} {record[key]:.4f}" if "loss" in key else f"{key} {record[key]:.2f}"
            )
    return " | ".join(parts)
