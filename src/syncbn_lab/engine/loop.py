"""The training loop: optimizer steps over micro-batches, evaluation, checkpoints, logs.

The loop holds no global state; everything parallel comes in through ``Runtime`` and
the wrapped model, so the same loop runs single-device, DDP and emulated N-device jobs.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.profiler import record_function
from torch.utils.data import DataLoader

from syncbn_lab.engine import checkpoint, compute
from syncbn_lab.engine.evaluate import evaluate
from syncbn_lab.engine.optim import lr_factor
from syncbn_lab.engine.precise_bn import update_bn_stats
from syncbn_lab.engine.precision import autocast
from syncbn_lab.parallel.bn_buffers import BNBuffers
from syncbn_lab.parallel.context import Runtime
from syncbn_lab.parallel.dp import at_least_fp32, loss_and_counts
from syncbn_lab.traffic import TRAFFIC


@dataclass
class Loaders:
    train: DataLoader
    val: DataLoader
    test: DataLoader


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    best_val_acc: float = float("-inf")
    history: dict[str, Any] = field(default_factory=dict)


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
    ):
        self.cfg, self.rt = cfg, rt
        self.module = model_without_ddp
        self.layout = compute.memory_format(cfg.trainer.get("channels_last", False))
        self.compiled = bool(cfg.trainer.get("compile", False))
        self.model = compute.compile_model(model) if self.compiled else model
        self.optimizer, self.loaders, self.logger = optimizer, loaders, logger
        self.run_dir = run_dir
        self.bn_buffers = bn_buffers if bn_buffers is not None else BNBuffers()
        self.loss_in_model = bool(getattr(model, "computes_loss", False))
        self.no_sync = _no_sync(model)  # the wrapped model's, compiled or not
        self.callbacks = _instantiate_callbacks(cfg.trainer.get("callbacks"))
        self.trainer_cfg = cfg.trainer
        self.accumulate = cfg.trainer.accumulate
        self.steps_per_epoch, self.total_steps = step_counts(cfg.trainer, len(loaders.train))
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.state = TrainState()
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=cfg.trainer.precision == "fp16")
        self.train_time = 0.0
        self.images_seen = 0

    # -- checkpoints ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.state.epoch,
            "step": self.state.step,
            "best_val_acc": self.state.best_val_acc,
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.bn_buffers.adopt_module_buffers()  # every (emulated) device resumes from them
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.state.epoch, self.state.step = state["epoch"], state["step"]
        self.state.best_val_acc = state["best_val_acc"]
        torch.set_rng_state(state["torch_rng"])

    def save(self, name: str) -> None:
        if self.rt.is_main:
            checkpoint.save_atomic(self.state_dict(), self.run_dir / "checkpoints" / name)

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
        if self.loss_in_model:
            return loss_and_counts(self.model(images, labels))
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
        last_epoch_totals = torch.zeros(3, dtype=torch.float64, device=rt.device)
        val = {}
        TRAFFIC.reset()  # count only this fit's training steps
        self.model.train()
        while state.epoch < epochs and state.step < self.total_steps:
            epoch = state.epoch
            self.loaders.train.batch_sampler.set_epoch(epoch)
            if hasattr(self.loaders.train.dataset, "set_epoch"):
                self.loaders.train.dataset.set_epoch(epoch)
            epoch_totals = torch.zeros(3, dtype=torch.float64, device=rt.device)
            window = torch.zeros(3, dtype=torch.float64, device=rt.device)
            window_images, window_time = 0, 0.0
            progress = _progress(self.steps_per_epoch, epoch, enabled=rt.is_main)
            batches = iter(self.loaders.train)
            for step_in_epoch in range(self.steps_per_epoch):
                if state.step >= self.total_steps:
                    break
                t0 = time.perf_counter()  # data loading counts towards images/s
                with record_function("data"):  # the phases engine/profile.py reports
                    micro = [next(batches) for _ in range(self.accumulate)]
                lr = self.set_lr()
                totals = self.train_step(micro)
                elapsed = time.perf_counter() - t0
                state.step += 1
                for callback in self.callbacks:
                    callback(self)
                images = self.cfg.trainer.global_batch_size
                self.train_time += elapsed
                self.images_seen += images
                window += totals
                epoch_totals += totals
                window_images += images
                window_time += elapsed
                if state.step % cfg.log_every == 0:
                    reduced = rt.all_reduce_sum(window.clone())
                    record = {
                        "step": state.step,
                        "epoch": epoch + (step_in_epoch + 1) / self.steps_per_epoch,
                        "lr": lr,
                        "train/loss": (reduced[0] / reduced[2]).item(),
                        "train/acc": (100 * reduced[1] / reduced[2]).item(),
                        "images_per_s": window_images / max(window_time, 1e-9),
                    }
                    self.logger.log(record)
                    if progress is not None:
                        progress.set_postfix(
                            loss=f"{record['train/loss']:.4f}",
                            acc=f"{record['train/acc']:.2f}",
                            img_s=f"{record['images_per_s']:.0f}",
                        )
                    window.zero_()
                    window_images, window_time = 0, 0.0
                if progress is not None:
                    progress.update(1)
            if progress is not None:
                progress.close()
            state.epoch += 1
            last_epoch_totals = rt.all_reduce_sum(epoch_totals)
            finished = state.epoch >= epochs or state.step >= self.total_steps
            record = {
                "step": state.step,
                "epoch": state.epoch,
                "lr": self.optimizer.param_groups[0]["lr"],
                "train/loss": (last_epoch_totals[0] / last_epoch_totals[2].clamp(min=1)).item(),
                "train/acc": (
                    100 * last_epoch_totals[1] / last_epoch_totals[2].clamp(min=1)
                ).item(),
                "images_per_s": self.images_seen / max(self.train_time, 1e-9),
            }
            if state.epoch % cfg.eval_every == 0 or finished:
                val = self.evaluate(self.loaders.val)
                record.update({"val/loss": val["loss"], "val/acc": val["acc"]})
                if val["acc"] > state.best_val_acc:
                    state.best_val_acc = val["acc"]
                    self.save("best.pt")
            self.logger.log(record)
            self.save("last.pt")
            if rt.is_main:  # stays on the screen (the progress bar does not) and in train.log
                print(_epoch_line(record), flush=True)
            if finished:
                break
        steps_run = self.images_seen // cfg.global_batch_size
        traffic = TRAFFIC.per_step(steps_run) if rt.distributed else {}
        test = self.evaluate(self.loaders.test)
        result = {
            "test_acc": test["acc"],
            "test_loss": test["loss"],
            "val_acc": val.get("acc", float("nan")),
            "best_val_acc": state.best_val_acc,
            "train_loss": (last_epoch_totals[0] / last_epoch_totals[2].clamp(min=1)).item(),
            "epochs": state.epoch,
            "steps": state.step,
            "train_time_s": self.train_time,
            "images_per_s": self.images_seen / max(self.train_time, 1e-9),
            "step_time_s": self.train_time / max(steps_run, 1),
            **traffic,  # DDP: bytes this rank handed to collectives per training step
        }
        if cfg.precise_bn_batches:
            result.update(self.precise_bn(test))
        return result

    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        with self.bn_buffers.evaluation():
            return evaluate(self.module, loader, self.rt, self.trainer_cfg.precision, self.layout)

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


def _instantiate_callbacks(nodes) -> list:
    """trainer.callbacks: Hydra ``_target_`` nodes, each instantiated once per process into a
    callable run as ``callback(trainer)`` after every optimizer step (``trainer.state.step``
    and ``trainer.rt.rank`` say where it is). ``syncbn_lab.testing.Fault`` is one."""
    if not nodes:
        return []
    from hydra.utils import instantiate

    return [instantiate(node) for node in nodes]


def _progress(total: int, epoch: int, enabled: bool):
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"epoch {epoch + 1}", leave=False, dynamic_ncols=True)


def _epoch_line(record: dict[str, Any]) -> str:
    parts = [f"epoch {record['epoch']}", f"step {record['step']}"]
    for key in ("train/loss", "train/acc", "val/loss", "val/acc", "images_per_s"):
        if key in record:
            parts.append(
                f"{key} {record[key]:.4f}" if "loss" in key else f"{key} {record[key]:.2f}"
            )
    return " | ".join(parts)
