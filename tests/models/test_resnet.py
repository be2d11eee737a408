import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from syncbn_lab import models
from syncbn_lab.nn.registry import norm_layer


def count(model, kind):
    return sum(isinstance(m, kind) for m in model.modules())


@pytest.mark.parametrize("name,blocks", [("resnet8", 3), ("resnet20", 9), ("resnet56", 27)])
def test_cifar_resnet_depth(name, blocks):
    cfg = OmegaConf.create(dict(name=name, width=16, zero_init_residual=False))
    model = models.build(cfg, lambda c: nn.BatchNorm2d(c), num_classes=10, in_channels=3)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    # depth = 3x3 convs + the classifier
    assert len(convs) + 1 == int(name.removeprefix("resnet"))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    widths = sorted({m.out_channels for m in convs})
    assert widths == [16, 32, 64]


def test_norm_factory_decides_every_norm():
    cfg = OmegaConf.create(dict(name="resnet8", width=8, zero_init_residual=False))
    gn = norm_layer(OmegaConf.create(dict(name="gn", groups=4, eps=1e-5)))
    model = models.build(cfg, gn, num_classes=10, in_channels=1)
    assert count(model, nn.GroupNorm) > 0 and count(model, nn.BatchNorm2d) == 0
    assert model(torch.randn(1, 1, 28, 28)).shape == (1, 10)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_torchvision_resnet_small_stem(name):
    cfg = OmegaConf.create(dict(name=name, small_input_stem=True, zero_init_residual=True))
    model = models.build(cfg, lambda c: nn.BatchNorm2d(c), num_classes=7, in_channels=1)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    last = "bn3" if name == "resnet50" else "bn2"
    assert all(torch.all(getattr(b, last).weight == 0) for b in model.layer1)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 7)


def test_zero_init_residual_makes_blocks_identity_at_init():
    cfg = OmegaConf.create(dict(name="resnet8", width=8, zero_init_residual=True))
    model = models.build(cfg, lambda c: nn.BatchNorm2d(c), num_classes=10, in_channels=3)
    block = model.stages[0]
    assert torch.all(block.bn2.weight == 0)
    x = torch.relu(torch.randn(2, 8, 8, 8))
    block.eval()
    torch.testing.assert_close(block(x), x)  # identity shortcut + zero branch, then ReLU


def test_unknown_model_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown model 'resnet9'; choose one of"):
        models.build(OmegaConf.create(dict(name="resnet9")), nn.BatchNorm2d, 10, 3)
