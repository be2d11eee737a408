"""The noise of BatchNorm's batch statistics, measured on a model that a config builds.

A BN layer in training normalises with the mean and (biased) variance of its normalisation
batch of b images instead of the statistics of the whole data; how far apart the two are is
the noise that per-device BN adds when devices shrink b. This module measures it for any
``model`` and ``data`` of the project, at initialisation (``trainer.seed``) or from a run's
checkpoint (``noise.checkpoint``); ``scripts/bn_noise.py`` runs it (docs/bn_noise.md).

**The sample and its reference statistics.** ``noise.images`` training images (a seeded random
choice, as the training sampler shuffles; augmented as training augments them) pass through
the model in training mode, every BN layer normalising with the statistics of its input over
the whole sample: what training mode does on one batch of all N images, the regime that a
normalisation batch of N approaches. Those statistics are found by ``noise.passes`` passes
over the sample: pass 1 normalises with the statistics of each chunk of
``trainer.eval_batch_size`` images, pass t with those that pass t - 1 measured at the layer's
input. A layer that has k BN layers before it on its path through the network is exact from
pass k + 1 on (its input no longer depends on an estimate), the others are within the chunk's
noise (about 1/sqrt(chunk x positions) of the normalisation). The last pass keeps, per image
and channel, the sum of the layer's input values and of their squares over the layer's
positions (H x W), in float64 (:class:`LayerSample`).

**Per layer and b** (:func:`layer_noise`): the sample cut into G = N // b groups of b
consecutive images (images after the last whole group take no part), each group's mean m_b and
biased variance v_b per channel against the sample's m and v:

- ``mean_error``: RMS over groups and channels of (m_b - m) / sqrt(v + eps);
- ``var_error``: RMS of (v_b - v) / (v + eps), and ``var_bias`` its mean;
- ``noise``: sqrt(mean_error^2 + var_error^2 / 4), the RMS change of the layer's normalised
  output (in units of its standard deviation) that batch statistics cause, to first order:
  x_hat_b - x_hat = -(m_b - m)/sigma - x_hat (v_b - v)/(2 v) + ...;
- ``effective_count``: (1 - b/N) / mean_error^2, the number of independent values per channel
  that would give this mean error (b x positions for i.i.d. input; nearer b in a network, whose
  positions within one image are correlated).

For i.i.d. Gaussian values the answers are known (n = b x positions, M = N x positions):
E[mean_error^2] = (1/n - 1/M) sigma^2 / (sigma^2 + eps), the mean of (v_b - v)/v is about
-1/n and its spread about sqrt(2/n) (a chi-square of n - 1 degrees of freedom). At b = N every
error is exactly zero: the group is the sample, computed by the same sums.

Per b, the summary is the RMS of ``noise`` over all layers and over "the first layers", those
whose input has the most positions (the network's highest resolution: in resnet8 the stem's BN
and the first block's two). At the network's output, the test loss and error with every BN
layer normalising each group of b test images with its own statistics
(:func:`syncbn_lab.engine.batch_stats.batch_statistics`, ``trainer.eval_batch_stats``'s code),
beside evaluation with the running statistics (the train-test inconsistency) and with the
sample's statistics (exact population statistics, what PreciseBN estimates).

The normalisation batches come from the run's settings as the norm variants' specs derive them
(:func:`normalization_batches`): per-device BN's (global batch / devices / accumulate), SyncBN
over groups of ``bn.group_size`` devices, SyncBN over every device, the run's own variant's, and
``noise.batches``. The model runs in float32 (statistics summed in float64) whatever
``trainer.precision`` says; every norm layer is a ``_BatchNorm`` whose weight, bias and eps are
used, whichever variant built it.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, Dataset, Subset

from syncbn_lab.checks import positive
from syncbn_lab.errors import ConfigError, one_line
from syncbn_lab.variants import GROUP as VARIANT_GROUP

KEY = "noise"
"""The config node of the tool's own keys (configs/bn_noise.yaml)."""


# -- the measurement ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerSample:
    """One BN layer's input over the sample: per image and channel (N x C, float64), the sum
    of its values and of their squares over the layer's ``positions`` (H x W)."""

    name: str
    eps: float
    positions: int
    sums: Tensor
    squares: Tensor

    @property
    def images(self) -> int:
        return self.sums.shape[0]

    @property
    def channels(self) -> int:
        return self.sums.shape[1]


def group_statistics(sample: LayerSample, group: int) -> tuple[Tensor, Tensor]:
    """Mean and biased variance per channel (G x C, float64) of each of the G = N // ``group``
    groups of ``group`` consecutive images of ``sample``."""
    count = sample.images // group
    if count < 1:
        raise ValueError(f"a group of {group} images exceeds the sample's {sample.images}")
    values = group * sample.positions

    def per_group(per_image: Tensor) -> Tensor:
        return per_image[: count * group].view(count, group, -1).sum(1) / values

    mean = per_group(sample.sums)
    return mean, (per_group(sample.squares) - mean * mean).clamp_min(0.0)


@dataclass(frozen=True)
class LayerNoise:
    """One layer's batch statistics at a normalisation batch of ``batch`` images against the
    sample's (see the module's docstring for each figure)."""

    layer: str
    channels: int
    positions: int
    batch: int
    mean_error: float
    var_error: float
    var_bias: float
    noise: float
    effective_count: float | None  # None at b = N, where the mean error is zero


def layer_noise(sample: LayerSample, batch: int) -> LayerNoise:
    """The errors of ``sample``'s group statistics at ``batch`` images against its own."""
    mean, var = group_statistics(sample, sample.images)
    mean_b, var_b = group_statistics(sample, batch)
    mean_rel = (mean_b - mean) / (var + sample.eps).sqrt()
    var_rel = (var_b - var) / (var + sample.eps)
    mean_error = mean_rel.square().mean().sqrt().item()
    var_error = var_rel.square().mean().sqrt().item()
    shortfall = 1.0 - batch / sample.images
    return LayerNoise(
        layer=sample.name,
        channels=sample.channels,
        positions=sample.positions,
        batch=batch,
        mean_error=mean_error,
        var_error=var_error,
        var_bias=var_rel.mean().item(),
        noise=math.sqrt(mean_error**2 + var_error**2 / 4),
        effective_count=shortfall / mean_error**2 if mean_error > 0 else None,
    )


def bn_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The BN layers of ``model`` by qualified name (every ``_BatchNorm``: ours, torch's,
    SyncBN, Batch Renormalization)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


class _Pass:
    """One pass over the sample: every BN layer normalises with ``given`` statistics (layer ->
    (mean, var)) or, without them, with each chunk's, and records its input's sums."""

    def __init__(self, given: dict[_BatchNorm, tuple[Tensor, Tensor]] | None, keep: bool):
        self.given = {
            layer: tuple(t.float() for t in stats) for layer, stats in (given or {}).items()
        }
        self.keep = keep  # per-image sums (the last pass); else per-channel totals only
        self.order: list[_BatchNorm] = []  # layers in the order the forward reaches them
        self.sums: dict[_BatchNorm, list[Tensor]] = {}
        self.squares: dict[_BatchNorm, list[Tensor]] = {}
        self.positions: dict[_BatchNorm, int] = {}
        self.values: dict[_BatchNorm, int] = {}  # values per channel seen

    def forward(self, layer: _BatchNorm, x: Tensor) -> Tensor:
        if layer not in self.sums:
            self.order.append(layer)
            self.sums[layer], self.squares[layer] = [], []
            self.positions[layer], self.values[layer] = math.prod(x.shape[2:]), 0
        self.values[layer] += x.shape[0] * self.positions[layer]
        dims = tuple(range(2, x.dim()))
        sums = x.sum(dims, dtype=torch.float64)
        squares = (x * x).sum(dims, dtype=torch.float64)
        if not self.keep:
            sums, squares = sums.sum(0, keepdim=True), squares.sum(0, keepdim=True)
        self.sums[layer].append(sums.cpu())
        self.squares[layer].append(squares.cpu())
        stats = self.given.get(layer)
        if stats is None:  # training mode's normalisation over this chunk
            return F.batch_norm(x, None, None, layer.weight, layer.bias, True, 0.0, layer.eps)
        return normalise(layer, x, stats)

    def statistics(self) -> dict[_BatchNorm, tuple[Tensor, Tensor]]:
        """Each layer's mean and biased variance over every image this pass saw."""
        stats = {}
        for layer in self.order:
            mean = torch.cat(self.sums[layer]).sum(0) / self.values[layer]
            second = torch.cat(self.squares[layer]).sum(0) / self.values[layer]
            stats[layer] = (mean, (second - mean * mean).clamp_min(0.0))
        return stats

    def sample(self, layer: _BatchNorm, name: str) -> LayerSample:
        return LayerSample(
            name=name,
            eps=layer.eps,
            positions=self.positions[layer],
            sums=torch.cat(self.sums[layer]),
            squares=torch.cat(self.squares[layer]),
        )


def normalise(layer: _BatchNorm, x: Tensor, stats: tuple[Tensor, Tensor]) -> Tensor:
    """``x`` normalised with ``stats`` (mean, biased variance) and ``layer``'s affine
    parameters: training mode's output where the batch has those statistics."""
    mean, var = (t.to(x.device, x.dtype) for t in stats)
    return F.batch_norm(x, mean, var, layer.weight, layer.bias, False, 0.0, layer.eps)


@contextlib.contextmanager
def _forwards(model: nn.Module, forward: Callable[[_BatchNorm, Tensor], Tensor]) -> Iterator[None]:
    """Within: every BN layer of ``model`` runs ``forward(layer, x)`` instead of its own."""
    layers = [m for _, m in bn_layers(model)]
    for layer in layers:
        layer.forward = functools.partial(forward, layer)  # an instance attribute
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


@torch.no_grad()
def sample_layers(
    model: nn.Module, batches: Callable[[], Iterable[Tensor]], passes: int
) -> list[LayerSample]:
    """The input of every BN layer of ``model`` over the images that ``batches()`` yields (the
    same ones, in the same order, at every call), in the reference regime of the module's
    docstring after ``passes`` passes; the layers in the order the forward reaches them (a
    layer the forward never reaches is left out). Parameters and buffers are untouched."""
    names = {layer: name for name, layer in bn_layers(model)}
    was_training = model.training
    model.train()
    given = None
    try:
        for index in range(passes):
            current, fed = _Pass(given, keep=index == passes - 1), 0
            with _forwards(model, current.forward):
                for images in batches():
                    model(images)
                    fed += images.shape[0]
            given = current.statistics()
    finally:
        model.train(was_training)
    samples = [current.sample(layer, names[layer]) for layer in current.order]
    for sample in samples:
        if sample.images != fed:
            raise ValueError(
                f"BN layer {sample.name} is called {sample.images / fed:g} times per forward; "
                "the measurement takes layers called once"
            )
    return samples


@contextlib.contextmanager
def sample_statistics(model: nn.Module, samples: list[LayerSample]) -> Iterator[None]:
    """Within: every measured BN layer of ``model`` normalises with the statistics of its input
    over the sample (the population statistics that PreciseBN estimates), in any mode."""
    layers = dict(bn_layers(model))
    stats = {}
    for sample in samples:
        mean, var = group_statistics(sample, sample.images)
        stats[layers[sample.name]] = (mean[0].float(), var[0].float())

    def forward(layer: _BatchNorm, x: Tensor) -> Tensor:
        return normalise(layer, x, stats[layer])

    with _forwards(model, forward):
        yield


def first_layers(samples: list[LayerSample]) -> list[str]:
    """The layers at the network's highest resolution: those whose input has the most
    positions."""
    most = max(s.positions for s in samples)
    return [s.name for s in samples if s.positions == most]


def root_mean_square(values: Iterable[float]) -> float:
    values = list(values)
    return math.sqrt(sum(v * v for v in values) / len(values))


# -- which normalisation batches ---------------------------------------------------------------


@dataclass(frozen=True)
class NormBatch:
    """One normalisation batch to measure and what it stands for in the run's settings."""

    size: int
    kinds: tuple[str, ...]

    @property
    def label(self) -> str:
        return ", ".join(self.kinds)


def normalization_batches(cfg: DictConfig) -> list[NormBatch]:
    """The normalisation batches of ``cfg``'s settings, from the norm variants' specs: the
    per-device one (the baseline variant's), SyncBN's over groups of ``bn.group_size``
    devices (where set) and over every device (the reference variant's), this run's own
    variant's, and ``noise.batches``; by size, each once with every kind it stands for."""
    from syncbn_lab.config import derive
    from syncbn_lab.variants import with_role

    shape = derive(cfg)
    per_device, devices = shape.per_device_batch_size, shape.devices
    per_device_bn, synced = with_role("baseline")[0], with_role("reference")[0]
    kinds: dict[int, list[str]] = {}

    def add(size: int, kind: str) -> None:
        kinds.setdefault(int(size), []).append(kind)

    add(per_device_bn.normalization_batch_size(cfg.bn, per_device, devices), "per-device")
    group = cfg.bn.get("group_size")
    if group and group < devices:
        node = OmegaConf.create({"group_size": group})
        add(synced.normalization_batch_size(node, per_device, devices), f"SyncBN groups of {group}")
    every = OmegaConf.create({"group_size": None})
    add(synced.normalization_batch_size(every, per_device, devices), f"SyncBN over {devices}")
    add(shape.normalization_batch_size, f"this run (bn={cfg.bn.name})")
    for size in cfg[KEY].get("batches") or []:
        add(size, f"{KEY}.batches")
    return [NormBatch(size, tuple(kinds[size])) for size in sorted(kinds)]


CONFIG_NAME = "bn_noise"
"""configs/bn_noise.yaml: the training config and the tool's keys."""


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The config scripts/bn_noise.py gets for ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from syncbn_lab.config import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(CONFIG_NAME, overrides=list(overrides or []))


# -- the checks a user's config meets ----------------------------------------------------------


def check(cfg: DictConfig) -> None:
    """Every problem of ``cfg`` that needs no data, as one-line ConfigErrors, before any work
    (scripts/bn_noise.py runs it before Hydra makes the output folder)."""
    from syncbn_lab.config import resolve_device
    from syncbn_lab.parallel.modes import mode
    from syncbn_lab.variants import variant

    t, p, noise = cfg.trainer, cfg.parallel, cfg.get(KEY)
    if noise is None:
        raise ConfigError(f"the config has no {KEY} node; compose configs/bn_noise.yaml")
    for key in ("images", "passes"):
        positive(noise.get(key), f"{KEY}.{key}")
    if noise.get("test_images") is not None:
        positive(noise.test_images, f"{KEY}.test_images")
    seed = noise.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"{KEY}.seed={seed} must be an integer >= 0")
    if not isinstance(noise.get("shuffle"), bool):
        raise ConfigError(f"{KEY}.shuffle={noise.get('shuffle')} must be true or false")
    batches = noise.get("batches")
    if batches is not None and not OmegaConf.is_list(batches):
        raise ConfigError(f"{KEY}.batches={batches} must be a list, e.g. {KEY}.batches=[2,8,32]")
    for i, size in enumerate(batches or []):
        positive(size, f"{KEY}.batches[{i}]")
    for value, key in ((t.global_batch_size, "trainer.global_batch_size"),
                       (t.accumulate, "trainer.accumulate"), (p.devices, "parallel.devices"),
                       (t.eval_batch_size, "trainer.eval_batch_size")):  # fmt: skip
        positive(value, key)
    if t.global_batch_size % (p.devices * t.accumulate):
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by "
            f"parallel.devices x trainer.accumulate = {p.devices} x {t.accumulate}; "
            "pick a global batch that is a multiple of their product"
        )
    device = resolve_device(t.device)
    variant(cfg.bn.name).check(cfg, mode(p.name), device)
    for batch in normalization_batches(cfg):
        if batch.size > noise.images:
            raise ConfigError(
                f"the normalisation batch b={batch.size} ({batch.label}) exceeds the sample of "
                f"{KEY}.images={noise.images}; raise {KEY}.images to at least {batch.size}"
            )
    if noise.get("checkpoint"):
        from syncbn_lab.engine import checkpoint

        checkpoint.resolve(noise.checkpoint, key=f"{KEY}.checkpoint")


def checkpoint_state(cfg: DictConfig) -> tuple[Path, dict[str, Any]]:
    """``noise.checkpoint``'s file and contents, checked against ``cfg``'s model and data (one
    line naming the first setting that differs)."""
    from syncbn_lab.engine import checkpoint

    key = f"{KEY}.checkpoint"
    path = checkpoint.resolve(cfg[KEY].checkpoint, key=key)
    state = checkpoint.load(path, key=key)
    saved = state.get("resume_key") or {}
    model = OmegaConf.to_container(cfg.model, resolve=True)
    differs = [(f"model.{k}", v, model.get(k)) for k, v in (saved.get("model") or {}).items()]
    differs += [("data.name", saved.get("data.name"), cfg.data.name)]
    for name, was, now in differs:
        if was is not None and was != now:
            raise ConfigError(
                f"{key}: {path} holds a model trained with {name}={was}, this config has "
                f"{name}={now}; pass the run's settings (its config.yaml), e.g. {name}={was}"
            )
    return path, state


# -- the tool ---------------------------------------------------------------------------------


def run(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Measure as ``cfg`` says, print the tables, write bn_noise.json, layers.csv and
    summary.csv into ``out_dir``; return what bn_noise.json holds."""
    from syncbn_lab.config import resolve_device
    from syncbn_lab.data import build_datasets, prepare_data
    from syncbn_lab.engine.compute import memory_format, to_device
    from syncbn_lab.parallel.sampling import seed_everything

    started = time.perf_counter()
    check(cfg)
    t, noise = cfg.trainer, cfg[KEY]
    saved = checkpoint_state(cfg) if noise.get("checkpoint") else None
    if t.threads:
        torch.set_num_threads(t.threads)
    device = torch.device(resolve_device(t.device))
    layout = memory_format(t.channels_last)
    batches = normalization_batches(cfg)
    seed_everything(t.seed)  # as training: the same initial weights for the same seed
    prepare_data(cfg.data)
    splits = build_datasets(cfg.data)
    if noise.images > len(splits.train):
        raise ConfigError(
            f"{KEY}.images={noise.images} exceeds the {len(splits.train)} training images of "
            f"data={cfg.data.name}; lower {KEY}.images"
        )
    model, source = build_model(cfg, splits.num_classes, splits.in_channels, saved)
    model = model.to(device, torch.float32, memory_format=layout)
    sample_set, test_set = choose(splits.train, noise.images, splits.test, noise.test_images,
                                  noise.seed if noise.shuffle else None)  # fmt: skip
    loader = DataLoader(sample_set, batch_size=t.eval_batch_size)

    def sample_images() -> Iterator[Tensor]:
        for images, _ in loader:
            yield to_device(images, device, layout)

    samples = sample_layers(model, sample_images, noise.passes)
    first = first_layers(samples)
    outputs, reference = output_metrics(
        model, samples, test_set, batches, t.eval_batch_size, device, layout
    )
    layers = [asdict(layer_noise(s, b.size)) | {"kinds": b.label} for b in batches for s in samples]

    def summary(b: NormBatch) -> dict[str, Any]:
        rows = [r for r in layers if r["batch"] == b.size]
        return {
            "batch": b.size,
            "kinds": b.label,
            "noise": root_mean_square(r["noise"] for r in rows),
            "noise_first_layers": root_mean_square(r["noise"] for r in rows if r["layer"] in first),
            **outputs[b.size],
        }

    result = {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        VARIANT_GROUP: cfg.bn.name,
        "data": cfg.data.name,
        "heterogeneity": cfg.data.get("heterogeneity", 0.0),
        "source": source,
        "images": noise.images,
        "test_images": len(test_set),
        "passes": noise.passes,
        "first_layers": first,
        "reference": reference,
        "summary": [summary(b) for b in batches],
        "layers": layers,
        "time_s": time.perf_counter() - started,
    }
    write(result, Path(out_dir))
    print(report(result), flush=True)
    return result


def build_model(
    cfg: DictConfig, num_classes: int, in_channels: int, saved: tuple[Path, dict] | None
) -> tuple[nn.Module, str]:
    """The model as training builds it (norm layers of ``cfg.bn`` for one device slice; the
    statistics' owner does not matter here), with the checkpoint's weights and buffers where
    ``saved`` holds them, and where it comes from in words."""
    from syncbn_lab import models
    from syncbn_lab.nn.registry import norm_layer

    model = models.build(cfg.model, norm_layer(cfg.bn, 1, training_batches=1), num_classes,
                         in_channels)  # fmt: skip
    if not bn_layers(model):
        raise ConfigError(
            f"model={cfg.model.name} with bn={cfg.bn.name} has no BatchNorm layer: its "
            "normalisation does not depend on the batch, there is no noise to measure"
        )
    if saved is None:
        return model, f"initialisation (trainer.seed={cfg.trainer.seed})"
    path, state = saved
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise ConfigError(
            f"{KEY}.checkpoint: {path} does not fit this model ({one_line(e)[:200]}); pass the "
            "run's settings (its config.yaml)"
        ) from None
    return model, f"{path} (epoch {state['epoch']}, step {state['step']})"


def choose(
    train: Dataset, images: int, test: Dataset, test_images: int | None, seed: int | None
) -> tuple[Subset, Subset]:
    """The sample (``images`` training images) and the test images (all: None), drawn at
    random from ``seed``, or the first ones as the splits store them (seed None)."""
    order = None if seed is None else torch.Generator().manual_seed(seed)

    def first(split: Dataset, count: int | None) -> Subset:
        index = (
            torch.arange(len(split))
            if order is None
            else torch.randperm(len(split), generator=order)
        )
        return Subset(split, index[:count].tolist())

    return first(train, images), first(test, test_images)


def output_metrics(
    model: nn.Module,
    samples: list[LayerSample],
    test_set: Dataset,
    batches: list[NormBatch],
    batch_size: int,
    device: torch.device,
    layout: torch.memory_format,
) -> tuple[dict[int, dict[str, float]], dict[str, dict[str, float]]]:
    """Test loss and error (%) with every BN layer normalising each group of b test images by
    their own statistics, by b; and with the running statistics and with the sample's."""
    from syncbn_lab.engine.batch_stats import batch_statistics
    from syncbn_lab.engine.evaluate import evaluate
    from syncbn_lab.parallel.context import Runtime
    from syncbn_lab.parallel.sampling import eval_loader

    rt = Runtime(device=device)

    def test(group: int = 1) -> dict[str, float]:
        loader = eval_loader(test_set, rt, batch_size, 0, group=group)
        result = evaluate(model, loader, rt, "fp32", layout)
        return {"test_loss": result["loss"], "test_error": 100.0 - result["acc"]}

    per_batch = {}
    for batch in batches:
        with batch_statistics(model, batch.size):
            per_batch[batch.size] = test(batch.size)
    reference = {"running statistics": test()}
    with sample_statistics(model, samples):
        reference["sample statistics"] = test()
    return per_batch, reference


def write(result: dict[str, Any], out_dir: Path) -> None:
    """bn_noise.json (everything), layers.csv (one row per layer and b), summary.csv (one row
    per b)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bn_noise.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    for name, rows in (("layers.csv", result["layers"]), ("summary.csv", result["summary"])):
        with open(out_dir / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def report(result: dict[str, Any]) -> str:
    """The terminal's tables: one row per layer for every b, then one row per b."""
    model = ", ".join(f"{k}={v}" for k, v in result["model"].items())
    lines = [
        f"BN batch-statistics noise: {model}, bn={result[VARIANT_GROUP]}, data={result['data']} "
        f"(heterogeneity {result['heterogeneity']}), {result['source']}",
        f"sample: {result['images']} training images, {result['passes']} passes; test: "
        f"{result['test_images']} images; first layers: {', '.join(result['first_layers'])}",
    ]
    head = f"{'layer':<28}{'channels':>9}{'positions':>10}{'mean err':>10}{'var err':>9}"
    head += f"{'var bias':>10}{'noise':>8}{'eff. count':>12}"
    for row in result["summary"]:
        lines += ["", f"b = {row['batch']} ({row['kinds']})", head]
        for r in (r for r in result["layers"] if r["batch"] == row["batch"]):
            count = r["effective_count"]
            lines.append(
                f"{r['layer']:<28}{r['channels']:>9}{r['positions']:>10}{r['mean_error']:>10.4f}"
                f"{r['var_error']:>9.4f}{r['var_bias']:>10.4f}{r['noise']:>8.4f}"
                f"{'-' if count is None else f'{count:.1f}':>12}"
            )
    lines += ["", f"{'b':>6}  {'kinds':<44}{'noise':>8}{'first':>8}{'test loss':>11}{'error %':>9}"]
    for row in result["summary"]:
        lines.append(
            f"{row['batch']:>6}  {row['kinds']:<44}{row['noise']:>8.4f}"
            f"{row['noise_first_layers']:>8.4f}{row['test_loss']:>11.4f}{row['test_error']:>9.2f}"
        )
    for name, r in result["reference"].items():
        lines.append(f"{'':>6}  {name:<60}{r['test_loss']:>11.4f}{r['test_error']:>9.2f}")
    lines.append(f"{result['time_s']:.1f} s")
    return "\n".join(lines)
