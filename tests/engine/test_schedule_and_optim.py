import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from syncbn_lab.engine.optim import build_optimizer, lr_factor, parameter_groups


def sched(**kw):
    return OmegaConf.create(kw)


def test_cosine_warmup_then_decay():
    cfg = sched(name="cosine", warmup_epochs=1.0, warmup_start_ratio=0.1, min_lr_ratio=0.0)
    steps_per_epoch, total = 10, 100
    assert lr_factor(cfg, 0, total, steps_per_epoch) == pytest.approx(0.1)
    assert lr_factor(cfg, 5, total, steps_per_epoch) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(cfg, 10, total, steps_per_epoch) == pytest.approx(1.0)
    # halfway through the cosine part the factor is one half
    assert lr_factor(cfg, 55, total, steps_per_epoch) == pytest.approx(0.5)
    assert lr_factor(cfg, 100, total, steps_per_epoch) == pytest.approx(0.0, abs=1e-12)


def test_onecycle_peaks_at_pct_start():
    cfg = sched(name="onecycle", pct_start=0.25, div_factor=25.0, final_div_factor=1e4)
    assert lr_factor(cfg, 0, 100, 10) == pytest.approx(1 / 25)
    assert lr_factor(cfg, 25, 100, 10) == pytest.approx(1.0)
    assert lr_factor(cfg, 100, 100, 10) == pytest.approx(1 / 25 / 1e4)


def test_step_decays_at_milestones():
    cfg = sched(
        name="step", milestones=[0.5, 0.75], gamma=0.1, warmup_epochs=0.0, warmup_start_ratio=0.1
    )
    # 4 epochs of 10 steps: decay after epoch 2 and epoch 3
    assert lr_factor(cfg, 19, 40, 10) == 1.0
    assert lr_factor(cfg, 20, 40, 10) == pytest.approx(0.1)
    assert lr_factor(cfg, 30, 40, 10) == pytest.approx(0.01)


def test_weight_decay_excludes_norm_and_bias():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2))
    decay, no_decay = parameter_groups(model, 1e-4, exclude_norm_and_bias=True)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decay["params"]) == {id(model[0].weight), id(model[2].weight)}
    assert ids(no_decay["params"]) == {
        id(model[0].bias),
        id(model[1].weight),
        id(model[1].bias),
        id(model[2].bias),
    }
    assert no_decay["weight_decay"] == 0.0


def test_sgd_step_matches_torch_with_groups():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    cfg = OmegaConf.create(
        dict(
            name="sgd",
            lr=0.1,
            momentum=0.9,
            nesterov=True,
            weight_decay=0.5,
            exclude_norm_and_bias=True,
        )
    )
    opt = build_optimizer(cfg, model)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    model.weight.grad = torch.ones_like(w0)
    model.bias.grad = torch.ones_like(b0)
    opt.step()
    # first nesterov step: v = g; update = g + momentum * v = (1 + 0.9) g
    gw = 1 + 0.5 * w0
    torch.testing.assert_close(model.weight, w0 - 0.1 * 1.9 * gw)
    torch.testing.assert_close(model.bias, b0 - 0.1 * 1.9 * torch.ones_like(b0))
    assert math.isclose(opt.param_groups[1]["weight_decay"], 0.0)
