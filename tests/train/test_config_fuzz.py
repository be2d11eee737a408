"""Every key of the composed config, fuzzed: each value either passes the checks a run makes
before it starts (``config.validate``, then ``run_dir.decide``), and is then one the key's
comment in configs/ allows, or stops them with one ConfigError line that names the key.
Never a traceback, never a pass for a meaningless value.

The reference is this file's own table of what each key means (:data:`DOMAINS`, read off
the YAML comments) and of the combinations the docs refuse (:func:`violations`), not the
project's checks. The keys are those of every option of every config group, composed as
scripts/train.py composes them; a key without a domain here fails
:func:`test_every_key_of_every_option_has_a_domain`.

Two tests draw the values: one tries every key with every edge value (wrong types, 0,
negative, huge, empty, null, non-finite, the interval's ends) on the options that have it;
the Hypothesis one draws up to three keys at once on any option (combinations). Bounded by
default (a fixed seed, ``max_examples`` of the ``suite`` profile in tests/conftest.py);
``--hypothesis-profile=fuzz`` (or HYPOTHESIS_PROFILE=fuzz) runs 20,000 examples.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf, open_dict

from syncbn_lab.config import CONFIG_DIR, compose, validate
from syncbn_lab.errors import UserError, one_line
from syncbn_lab.machine import available_cores
from syncbn_lab.run_dir import decide

GROUPS = ("data", "model", "bn", "parallel", "optim", "sched", "logger")
CUDA = torch.cuda.is_available()


# --- what each key means (the YAML comments), independent of syncbn_lab.checks ----------------


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def ints(low: int, high: int | None = None, null: bool = False):
    return lambda v: (
        (null and v is None) or (is_int(v) and v >= low and (high is None or v <= high))
    )


def nums(low: float, high: float | None = None, lo_in=True, hi_in=True, null=False):
    def ok(v):
        if null and v is None:
            return True
        if not is_num(v):
            return False
        above = v > low or (lo_in and v == low)
        return above and (high is None or v < high or (hi_in and v == high))

    return ok


def choice(*names):
    return lambda v: isinstance(v, str) and v in names


def string(null: bool = False):
    return lambda v: (null and v is None) or (isinstance(v, str) and v.strip() != "")


def boolean(v) -> bool:
    return isinstance(v, bool)


def number_list(count: int | None, each):
    return lambda v: (
        isinstance(v, list) and (count is None or len(v) == count) and all(each(x) for x in v)
    )


def eval_every(v) -> bool:
    return is_num(v) and v > 0 and (v < 1 or float(v).is_integer())


def checkpoint_every(v) -> bool:
    if v is None or (not isinstance(v, str) and v == 0):
        return True  # null, 0 (false): at epoch ends only
    if is_int(v):
        return v > 0
    match = isinstance(v, str) and re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(min|s)\s*", v)
    return bool(match) and float(match.group(1)) > 0


def callbacks(v) -> bool:
    return v is None or (isinstance(v, list) and all(_importable(n) for n in v))


def _importable(node) -> bool:
    target = node.get("_target_") if isinstance(node, dict) else None
    return target == "syncbn_lab.faults.Fault"  # the one importable callable the draws name


SEED = ints(0, 2**32 - 1)
POSITIVE = ints(1)
POSITIVE_OR_NULL = ints(1, null=True)
FRACTION = nums(0, 1)

# key -> whether a value means what its comment says (the interval's ends are edges to try)
DOMAINS: dict[str, Any] = {
    "study": string(),
    "skip_finished": boolean,
    # trainer
    "trainer.epochs": POSITIVE,
    "trainer.max_steps": POSITIVE_OR_NULL,
    "trainer.log_every": POSITIVE,
    "trainer.global_batch_size": POSITIVE,
    "trainer.accumulate": POSITIVE,
    "trainer.eval_every": eval_every,
    "trainer.eval_dense_epochs": POSITIVE_OR_NULL,
    "trainer.eval_sparse_every": POSITIVE,
    "trainer.seed": SEED,
    "trainer.deterministic": boolean,
    "trainer.num_workers": ints(0),
    "trainer.precision": choice("auto", "fp32", "fp64", "bf16", "fp16"),
    "trainer.channels_last": boolean,
    "trainer.preflight": boolean,
    "trainer.compile": boolean,
    "trainer.grad_clip": nums(0, None, lo_in=False, null=True),
    "trainer.resume": lambda v: v is None or v == "auto",  # a path must hold a checkpoint
    "trainer.checkpoint_every": checkpoint_every,
    "trainer.device": choice("auto", "cpu", "cuda"),
    "trainer.threads": POSITIVE_OR_NULL,
    "trainer.precise_bn_batches": ints(0),
    "trainer.eval_batch_stats": boolean,
    "trainer.eval_batch_size": POSITIVE,
    "trainer.eval_images": POSITIVE_OR_NULL,
    "trainer.overfit_batches": POSITIVE_OR_NULL,
    "trainer.callbacks": callbacks,
    # model
    "model.width": POSITIVE,
    "model.zero_init_residual": boolean,
    "model.small_input_stem": boolean,
    # bn
    "bn.eps": nums(0, None, lo_in=False),
    "bn.momentum": nums(0, 1, null=True),
    "bn.group_size": POSITIVE_OR_NULL,
    "bn.impl": choice("auto", "fused", "reference"),
    "bn.groups": POSITIVE,
    "bn.rmax": nums(1),
    "bn.dmax": nums(0),
    "bn.warmup": FRACTION,
    "bn.ramp": FRACTION,
    # parallel
    "parallel.devices": POSITIVE,
    "parallel.backend": choice("auto", "gloo", "nccl"),
    "parallel.broadcast_buffers": boolean,
    "parallel.dist_bn": choice("none", "broadcast", "reduce"),
    "parallel.timeout_s": POSITIVE,
    "parallel.find_unused_parameters": boolean,
    "parallel.start_method": choice("forkserver", "spawn"),
    "parallel.loss_in_module": boolean,
    # optim
    "optim.lr": nums(0),
    "optim.momentum": nums(0, 1, hi_in=False),
    "optim.nesterov": boolean,
    "optim.weight_decay": nums(0),
    "optim.exclude_norm_and_bias": boolean,
    "optim.betas": number_list(2, nums(0, 1, hi_in=False)),
    "optim.eps": nums(0, None, lo_in=False),
    # sched
    "sched.warmup_epochs": nums(0),
    "sched.warmup_start_ratio": FRACTION,
    "sched.min_lr_ratio": FRACTION,
    "sched.pct_start": nums(0, 1, lo_in=False),
    "sched.div_factor": nums(0, None, lo_in=False),
    "sched.final_div_factor": nums(0, None, lo_in=False),
    "sched.milestones": number_list(None, FRACTION),
    "sched.gamma": nums(0, None, lo_in=False),
    # logger
    "logger.mode": choice("offline", "online", "disabled"),
    "logger.project": string(),
    "logger.entity": string(null=True),
    "logger.group": string(null=True),
    "logger.tags": lambda v: isinstance(v, list) and all(string()(t) for t in v),
    "logger.run_name": string(null=True),
    # data
    "data.root": string(),
    "data.download": boolean,
    "data.download_timeout": nums(0, None, lo_in=False),
    "data.verify_checksums": boolean,
    "data.val_size": POSITIVE,
    "data.split_seed": SEED,
    "data.val_fraction": nums(0, 1, False, False),
    "data.test_fraction": nums(0, 1, False, False),
    "data.normalize": boolean,
    "data.augment": boolean,
    "data.crop_padding": ints(0),
    "data.hflip": boolean,
    "data.augment_seed": SEED,
    "data.heterogeneity": nums(0, 1, hi_in=False),
    "data.heterogeneity_seed": SEED,
    "data.train_dir": string(),
    "data.val_dir": string(),
    "data.test_dir": string(),
    "data.image_size": POSITIVE,
    "data.channels": POSITIVE,
    "data.in_memory": boolean,
    "data.mean": lambda v: isinstance(v, list) and all(nums(0)(x) for x in v),
    "data.std": lambda v: isinstance(v, list) and all(nums(0, lo_in=False)(x) for x in v),
    "data.num_train": POSITIVE,
    "data.num_val": POSITIVE,
    "data.num_test": POSITIVE,
    "data.num_classes": ints(2),
    "data.noise_std": nums(0),
    "data.seed": SEED,
}


@dataclass
class Violation:
    keys: tuple[str, ...]  # a refusal must name one of them
    why: str


def norm_channels(model: dict) -> set[int]:
    """The channel counts of the model's norm layers (He et al.'s CIFAR ResNets: width, 2x,
    4x; torchvision's resnet18 and resnet50 their stages' widths)."""
    if model["name"] == "resnet18":
        return {64, 128, 256, 512}
    if model["name"] == "resnet50":
        return {64, 128, 256, 512, 1024, 2048}
    w = model["width"]
    return {w, 2 * w, 4 * w}


def violations(cfg: dict, base: str) -> list[Violation]:
    """What is wrong with ``cfg`` (a plain container of the composed config, drawn from the
    option set ``base``): each key outside its domain, and the combinations the docs refuse
    among the others (each bad key set back to its value in ``base``)."""
    found = []
    repaired = copy.deepcopy(bases()[base])
    for key, value in flatten(cfg).items():
        if key.endswith(".name") and key.split(".")[0] in GROUPS:
            group = key.split(".")[0]
            options = option_keys(group)
            known = isinstance(value, str) and value in options
            if not known or not options[value] <= set(cfg[group]):
                found.append(Violation((key,), "not an option whose keys the node has"))
                continue
        elif key in DOMAINS and not DOMAINS[key](value):
            found.append(Violation((key,), "outside its domain"))
            continue
        put(repaired, key, value)
    return found + combinations(repaired)


def combinations(cfg: dict) -> list[Violation]:
    """The combinations of valid values that the docs refuse."""
    found = []
    t, p, bn, optim, data = cfg["trainer"], cfg["parallel"], cfg["bn"], cfg["optim"], cfg["data"]
    device = "cuda" if t["device"] == "cuda" or (t["device"] == "auto" and CUDA) else "cpu"

    def refuse(keys, why):
        found.append(Violation(keys, why))

    if t["global_batch_size"] % (p["devices"] * t["accumulate"]):
        refuse(("trainer.global_batch_size",), "devices x accumulate does not divide it")
    if t["device"] == "cuda" and not CUDA:
        refuse(("trainer.device",), "no CUDA device")
    if t["precision"] == "fp16" and device != "cuda":
        refuse(("trainer.precision",), "fp16 needs CUDA")
    if p["name"] == "single" and p["devices"] != 1:
        refuse(("parallel.devices", "parallel.name"), "single runs one device")
    if p["name"] == "dp":
        refuse(("parallel.devices", "parallel.name", "bn.name"), "DataParallel: CUDA devices")
    if p["name"] == "ddp" and (p["backend"] == "nccl" and device != "cuda"):
        refuse(("parallel.backend",), "nccl needs CUDA")
    if p["name"] == "ddp" and device == "cuda" and torch.cuda.device_count() < p["devices"]:
        refuse(("parallel.devices",), "one GPU per rank")
    if bn["name"] == "torch_sync" and (device != "cuda" or p["name"] == "emulated"):
        refuse(("bn.name",), "torch.nn.SyncBatchNorm: CUDA and DDP only")
    if bn.get("group_size") is not None and p["devices"] % bn["group_size"]:
        refuse(("bn.group_size",), "does not divide the devices")
    if bn["name"] in ("brn", "brn_tuned"):
        if bn["warmup"] + bn["ramp"] > 1:
            refuse(("bn.warmup", "bn.ramp"), "the ramp does not fit in the run")
        emulated = p["name"] == "emulated" and p["devices"] > 1
        if emulated and (t["accumulate"] > 1 or not p.get("broadcast_buffers", True)):
            refuse(("bn.name", "parallel.name"), "BRN emulated needs device 0's statistics")
    if bn["name"] == "gn":
        if any(c % min(bn["groups"], c) for c in norm_channels(cfg["model"])):
            refuse(("bn.groups",), "does not divide every norm layer's channels")
    if optim.get("nesterov") and optim.get("momentum") == 0:
        refuse(("optim.nesterov", "optim.momentum"), "Nesterov without momentum")
    if "val_fraction" in data and data["val_fraction"] + data["test_fraction"] >= 1:
        refuse(("data.val_fraction", "data.test_fraction"), "no training images left")
    if "mean" in data:
        if data["channels"] not in (1, 3):
            refuse(("data.channels",), "decodes as RGB or greyscale")
        elif len(data["mean"]) != data["channels"] or len(data["std"]) != data["channels"]:
            refuse(("data.mean", "data.std"), "one number per channel")
    if t["compile"] and p["name"] == "dp":
        refuse(("trainer.compile",), "DataParallel does not compile")
    return found


# --- the config's keys and values ---------------------------------------------------------------


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: leaves are scalars, lists (a whole list is one
    value) and whatever a key of :data:`DOMAINS` holds."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        leaf = path in DOMAINS or path.endswith(".name")
        if isinstance(value, dict) and value and not leaf:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


@cache
def option_keys(group: str) -> dict[str, set[str]]:
    """Each option of ``group`` -> the keys its YAML file gives the node."""
    return {
        p.stem: set(OmegaConf.load(p)) for p in sorted((Path(CONFIG_DIR) / group).glob("*.yaml"))
    }


@cache
def bases() -> dict[str, dict]:
    """The default config and every option of every group in it, composed as train.py does,
    as plain containers without their sweep node (the option sets the draws start from)."""

    def plain(overrides: list[str]) -> dict:
        tree = OmegaConf.to_container(compose(overrides), resolve=True)
        tree.pop("sweep")
        return tree

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {"default": plain([])}
        for group in GROUPS:
            for option in option_keys(group):
                out[f"{group}={option}"] = plain([f"{group}={option}"])
    return out


def put(tree: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree[part]
    tree[last] = copy.deepcopy(value)


def keys_of(base: str) -> list[str]:
    return sorted(flatten(bases()[base]))


def every_key() -> set[str]:
    return {key for base in bases() for key in keys_of(base)}


HUGE = 10**30
# tried on every key: wrong types, the edges, the non-finite, the empty
EDGES = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    0.0,
    0.5,
    -0.5,
    1.5,
    1e-300,
    HUGE,
    -HUGE,
    2**32,
    1e308,
    math.inf,
    -math.inf,
    math.nan,
    "",
    " ",
    "abc",
    "auto",
    "0",
    [],
    [1],
    [0.5, 0.5],
    ["a"],
    {},
    {"a": 1},
]


def edges_of(key: str, default: Any) -> list[Any]:
    """The values to try on ``key``: :data:`EDGES`, its default and, around numbers, the
    neighbours of the interval ends a key's domain may have (0, 1 and the default)."""
    values = [*EDGES, default]
    if is_num(default) and not isinstance(default, bool):
        values += [default * 2, -default, default + 1e-9, math.nextafter(1.0, 0.0), 2**32 - 1]
    if isinstance(default, str):
        values += [default.upper(), default + "x"]
    if key.endswith(".name"):
        values += list(option_keys(key.split(".")[0]))
    return values


def check(base: str, values: dict[str, Any], tmp: Path) -> None:
    """Set ``values`` on ``base`` and run the checks a run makes before it starts; assert
    that they pass exactly when :func:`violations` finds nothing, and refuse otherwise with
    one ConfigError line naming a key at fault."""
    container = copy.deepcopy(bases()[base])
    for key, value in values.items():
        put(container, key, value)
    expected = violations(container, base)
    cfg = composed(base)
    shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
    try:
        with warnings.catch_warnings(), drawn_into(cfg, values, bases()[base]):
            warnings.simplefilter("ignore")
            validate(cfg)
            decide(cfg, tmp / "run")
    except UserError as e:
        line = one_line(e)  # what the entry points print
        assert expected, f"{base} {shown}: refused though it means what its comment says: {line}"
        named = {k for v in expected for k in v.keys}
        assert any(_names(line, k) for k in named), (
            f"{base} {shown}: the line names none of {sorted(named)}: {line}"
        )
        return
    except Exception as e:  # a traceback where a one-line refusal belongs
        raise AssertionError(f"{base} {shown}: {type(e).__name__}: {e}") from e
    assert not expected, f"{base} {shown}: passed though {expected[0].keys[0]} is bad"


@cache
def composed(base: str):
    """``base`` as the DictConfig a run gets (struct: an unknown key is an error); the checks
    borrow it with the drawn values set (:func:`drawn_into`)."""
    cfg = OmegaConf.create(bases()[base])
    OmegaConf.set_struct(cfg, True)
    return cfg


@contextlib.contextmanager
def drawn_into(cfg, values: dict[str, Any], base: dict):
    """``cfg`` with ``values`` set while inside; every key back to ``base`` after (what the
    checks may set too: decide() fills in trainer.resume)."""
    try:
        with open_dict(cfg):
            for key, value in values.items():
                OmegaConf.update(cfg, key, copy.deepcopy(value), merge=False)
        yield
    finally:
        with open_dict(cfg):
            for key in [*values, "trainer.resume"]:
                OmegaConf.update(cfg, key, copy.deepcopy(flatten(base)[key]), merge=False)


def _names(line: str, key: str) -> bool:
    group = key.split(".")[0]
    return key in line or (key.endswith(".name") and f"{group}=" in line)


# --- the tests ------------------------------------------------------------------------------------


def test_every_key_of_every_option_has_a_domain():
    names = {k for k in every_key() if k.endswith(".name")}
    missing = sorted(every_key() - set(DOMAINS) - names)
    assert not missing, f"keys with no domain in DOMAINS: {missing}; add what their comment says"


def test_every_option_this_machine_runs_passes_as_composed(tmp_path):
    for base in bases():
        if violations(bases()[base], base):  # CUDA-only options on a CPU machine
            continue
        check(base, {}, tmp_path)


@cache
def valid_bases() -> list[str]:
    return [b for b in bases() if not violations(bases()[b], b)]


def test_every_key_with_every_edge_value(tmp_path):
    """Each key with each value of :func:`edges_of`, on the default config where it has the
    key, else on the first option that has it (a CUDA-only one on a CPU machine:
    parallel.loss_in_module of parallel=dp, where every value is refused in one line)."""
    tried = 0
    for key in sorted(every_key()):
        holders = [b for b in bases() if key in keys_of(b)]
        base = next((b for b in holders if b in valid_bases()), holders[0])
        for value in edges_of(key, flatten(bases()[base])[key]):
            check(base, {key: value}, tmp_path)
            tried += 1
    assert tried >= 30 * len(every_key())  # every key, every edge


def values(key: str, default: Any):
    return st.one_of(
        st.sampled_from(edges_of(key, default)),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=6),
        st.lists(st.one_of(st.integers(-3, 3), st.floats(-2, 2)), max_size=4),
    )


@st.composite
def cases(draw) -> tuple[str, dict[str, Any]]:
    base = draw(st.sampled_from(valid_bases()))
    keys = draw(st.lists(st.sampled_from(keys_of(base)), min_size=1, max_size=3, unique=True))
    flat = flatten(bases()[base])
    return base, {key: draw(values(key, flat[key])) for key in keys}


@given(case=cases())
def test_combinations_of_drawn_values(tmp_path_factory, case):
    base, drawn = case
    check(base, drawn, tmp_path_factory.getbasetemp())


def test_the_oracle_refuses_what_issue_54_found():
    """The reference itself: a negative clip, momentum outside [0, 1) and workers below 0 are
    bad, their valid neighbours are not (so the tests above cannot pass vacuously)."""
    default = bases()["default"]
    for key, bad, good in [
        ("trainer.grad_clip", -1, 1.0),
        ("optim.momentum", 2, 0.9),
        ("trainer.num_workers", -1, 2),
    ]:
        group, field = key.split(".")
        for value, wrong in ((bad, True), (good, False)):
            cfg = {**default, group: {**default[group], field: value}}
            assert bool(violations(cfg, "default")) == wrong, (key, value)


def test_ddp_beyond_the_cores_is_allowed(tmp_path):
    """More ranks than cores only warns (docs/parallel.md): a valid value, not a refusal."""
    cores = available_cores()
    drawn = {"parallel.devices": 2 * cores, "trainer.global_batch_size": 64 * cores}
    check("parallel=ddp", drawn, tmp_path)
