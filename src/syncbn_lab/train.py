"""One training run: compose the parts the config names and fit.

``run(cfg, run_dir)`` is the whole job; ``scripts/train.py`` only composes the config.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from syncbn_lab import models
from syncbn_lab import run_dir as run_dir_start
from syncbn_lab.config import validate
from syncbn_lab.disk import writing
from syncbn_lab.engine import checkpoint, precision, preemption, preflight
from syncbn_lab.engine.compute import memory_format
from syncbn_lab.engine.loop import Loaders, Trainer, step_counts
from syncbn_lab.engine.optim import build_optimizer
from syncbn_lab.engine.precise_bn import bn_layers
from syncbn_lab.errors import (
    ConfigError,
    UserError,
    one_line,
    out_of_memory_is_one_line,
    warn_one_line,
)
from syncbn_lab.logging import NullLogger, RunLogger
from syncbn_lab.logging.console import LOG_FILE, log_terminal, result_block
from syncbn_lab.machine import available_cores, torchrun_env
from syncbn_lab.nn.registry import norm_layer
from syncbn_lab.parallel import parallelize
from syncbn_lab.parallel.context import Runtime
from syncbn_lab.parallel.ddp import refuse_torchrun_ranks
from syncbn_lab.parallel.modes import mode
from syncbn_lab.parallel.sampling import eval_loader, seed_everything, train_loader
from syncbn_lab.provenance import cpu_isa, cpu_model, git_commit, training_code
from syncbn_lab.run_dir import Start, follows_the_run_dir
from syncbn_lab.shape import RunShape
from syncbn_lab.variants import GROUP as VARIANT_GROUP
from syncbn_lab.variants import variant

# The code this process trains with, read when it loads it: a sweep's worker process runs the
# jobs after its first with the modules it imported then, whatever the checkout holds by then.
LOADED_CODE = {"git_commit": git_commit(), "training_code": training_code()}


def run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train as ``cfg`` says, writing outputs into ``run_dir``; return the summary. Where the
    run starts (afresh, or continuing its run dir's checkpoint) is :mod:`syncbn_lab.run_dir`'s
    decision, taken by the process that owns the run dir (torchrun: rank 0, whose ranks > 0
    learn it when the group forms)."""
    run_dir = Path(run_dir)
    shape = validate(cfg)
    cfg = pin_precision(cfg, shape.device)
    launched = torchrun_env()
    if launched is not None and launched["rank"] != 0:
        if not follows_the_run_dir(cfg):
            checkpoint.check_resume(cfg)  # fail now, not after the processes start
    else:
        try:
            chosen = start_in(cfg, run_dir)
        except UserError as e:
            if launched is not None:  # the other ranks wait for rank 0: say why, tell them, exit
                refuse_torchrun_ranks(cfg, shape, e)
            raise
        if chosen.note:
            print(chosen.note, file=sys.stderr, flush=True)
        if chosen.finished is not None:
            return chosen.finished
    with preemption.stop_signals():
        return mode(shape.mode).launch(cfg, shape, worker, run_dir)


def start_in(cfg: DictConfig, run_dir: Path) -> Start:
    """Decide where the run starts (see :mod:`syncbn_lab.run_dir`), fetch and check the
    data, then write the run dir's config.yaml: nothing is written before a check fails."""
    from syncbn_lab.data import prepare_data

    chosen = run_dir_start.decide(cfg, run_dir)
    if chosen.finished is not None:
        return chosen
    prepare_data(cfg.data)  # fetched and checked before anything is written
    run_dir_start.prepare(chosen, run_dir)
    try:
        with writing(run_dir / "config.yaml"):
            run_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    except OSError as e:
        raise ConfigError(
            f"cannot write the run dir {run_dir} ({e.strerror}); point hydra.run.dir at a "
            "writable folder"
        ) from e
    return chosen


def pin_precision(cfg: DictConfig, device: str) -> DictConfig:
    """``cfg`` with ``trainer.precision=auto`` replaced by what this device computes fastest
    (config.yaml, and so a resume, holds the choice); warns once where bf16 is emulated."""
    chosen = precision.resolve(cfg.trainer.precision, torch.device(device))
    warning = precision.slow_bf16_warning(chosen, torch.device(device))
    if warning and cfg.trainer.precision == "bf16":
        warn_one_line(warning)
    if chosen == cfg.trainer.precision:
        return cfg
    cfg = cfg.copy()
    cfg.trainer.precision = chosen
    return cfg


def worker(rt: Runtime, cfg: DictConfig, shape: RunShape, run_dir: Path) -> dict[str, Any]:
    """Everything one process does: data, model, optimizer, fit, summary (rank 0). Rank 0
    copies what it prints into the run's train.log, spawned DDP rank 0 included. A refused
    allocation is one line (:class:`OutOfMemory`)."""
    log = log_terminal(run_dir / LOG_FILE) if rt.is_main else contextlib.nullcontext()
    with log, out_of_memory_is_one_line():
        return _work(rt, cfg, shape, run_dir)


def _work(rt: Runtime, cfg: DictConfig, shape: RunShape, run_dir: Path) -> dict[str, Any]:
    from syncbn_lab.data import build_datasets

    started = time.perf_counter()
    t = cfg.trainer
    if t.threads:
        torch.set_num_threads(t.threads)
    if t.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    seed_everything(t.seed)
    if rt.is_main:
        print(precision.describe(t.precision, torch.device(shape.device)), flush=True)
        spec = variant(shape.variant)  # a per-device BN over <= 4 images says so
        if note := spec.small_batch_note(shape.normalization_batch_size, shape.devices):
            print(note, flush=True)

    dtype = precision.model_dtype(t.precision)
    splits = build_datasets(cfg.data)
    for split in (splits.train, splits.val, splits.test):
        split.set_dtype(dtype)
    per_device = shape.per_device_batch_size
    train_batches = train_loader(
        splits.train,
        rt,
        per_device,
        t.seed,
        t.num_workers,
        t.get("overfit_batches"),
        accumulate=t.accumulate,
    )
    _, steps = step_counts(t, len(train_batches))  # the Trainer's total_steps
    norm = norm_layer(cfg.bn, shape.device_slices, training_batches=steps * t.accumulate)
    model = models.build(cfg.model, norm, splits.num_classes, splits.in_channels)
    model = model.to(rt.device, dtype, memory_format=memory_format(t.channels_last))
    parallel = parallelize(model, cfg, rt)
    optimizer = build_optimizer(cfg.optim, model)

    batch = shape.normalization_batch_size  # trainer.eval_batch_stats: test in such groups

    def share(split, group: int = 1):
        return eval_loader(split, rt, t.eval_batch_size, t.num_workers, t.get("eval_images"), group)

    loaders = Loaders(
        train=train_batches,
        val=share(splits.val),
        test=share(splits.test),
        test_groups=share(splits.test, batch) if t.get("eval_batch_stats") else None,
    )
    if len(loaders.train) < t.accumulate:
        raise ConfigError(
            f"the training set ({len(splits.train)} images) gives no full step of "
            f"trainer.global_batch_size={t.global_batch_size}; use a smaller global batch"
        )
    if t.precise_bn_batches > len(loaders.train):
        raise ConfigError(
            f"trainer.precise_bn_batches={t.precise_bn_batches} is more than the "
            f"{len(loaders.train)} training batches of an epoch; PreciseBN would measure the "
            f"same batches again (time, no statistics): pick at most {len(loaders.train)}"
        )

    trainer = Trainer(
        cfg,
        rt,
        parallel.model,
        model,
        optimizer,
        loaders,
        NullLogger(),  # the run's logger comes after the preflight check: nothing written before
        run_dir,
        parallel.bn_buffers,
        parallel.model_loss,
    )
    if t.resume:
        path = checkpoint.resolve(t.resume)
        try:
            trainer.load_state_dict(checkpoint.load(path, rt.device))
        except (RuntimeError, KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"trainer.resume: {path} does not fit this run's model or devices "
                f"({one_line(e)[:200]}); resume with the settings it was written with"
            ) from None
    checked = {}
    if t.preflight:

        def replica(fused: bool) -> torch.nn.Module:
            bn = cfg.bn if fused or "impl" not in cfg.bn else {**cfg.bn, "impl": "reference"}
            factory = norm_layer(OmegaConf.create(bn), shape.device_slices, steps * t.accumulate)
            copy = models.build(cfg.model, factory, splits.num_classes, splits.in_channels)
            copy.load_state_dict(model.state_dict())
            return copy.to(rt.device)

        chunks = shape.slices_per_process // shape.device_slices  # DataParallel's replicas
        checked = preflight.check(trainer, replica, preflight.takes_fused(model), chunks)
        if rt.is_main:
            print(preflight.summary_line(checked), flush=True)

    logger = RunLogger(run_dir, cfg, shape) if rt.is_main else NullLogger()
    trainer.logger = logger
    exit_code = 1
    try:
        # data, model, compile set-up, a resume's checkpoint and the run logger (W&B), not the
        # preflight check
        startup = time.perf_counter() - started - checked.get("preflight_s", 0.0)
        result = trainer.fit()
        summary = {
            **result,
            **checked,
            "time_startup_s": startup,
            "wall_time_s": time.perf_counter() - started,
            "precision": t.precision,
            "global_batch_size": t.global_batch_size,
            "per_device_batch_size": per_device,
            "normalization_batch_size": shape.normalization_batch_size,
            "accumulate": t.accumulate,
            "devices": cfg.parallel.devices,
            "parallel": cfg.parallel.name,
            "dist_bn": cfg.parallel.get("dist_bn", "none"),
            VARIANT_GROUP: cfg.bn.name,
            "dataset": cfg.data.name,
            "model": cfg.model.name,
            "seed": t.seed,
            "resumed_from": str(t.resume) if t.resume else None,
            **LOADED_CODE,
            "torch_version": torch.__version__,
            # where it ran, for the report's cost table
            "device": shape.device,
            "backend": shape.backend,
            "cpu_model": cpu_model(),
            **cpu_isa(),
            "cores": available_cores(),
        }
        logger.summary(summary)
        exit_code = 0
    finally:
        logger.finish(exit_code)
    if rt.is_main:
        running_stats = bool(bn_layers(model))
        print(result_block(summary, run_dir, logger.wandb_lines, running_stats), flush=True)
    return summary
