"""syncbn_lab.nn.GroupNorm: torch's GroupNorm, with half channels_last input run in NCHW."""

import pytest
import torch

from syncbn_lab.nn import GroupNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_values_as_torch_group_norm_in_nchw(dtype):
    torch.manual_seed(0)
    ours, torch_gn = GroupNorm(4, 8), torch.nn.GroupNorm(4, 8)
    with torch.no_grad():
        for layer in (ours, torch_gn):
            layer.weight.copy_(torch.linspace(0.5, 1.5, 8))
            layer.bias.copy_(torch.linspace(-1, 1, 8))
    x = torch.randn(3, 8, 5, 6).to(dtype)
    dy = torch.randn(3, 8, 5, 6).to(dtype)
    x_cl = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    x_ref = x.clone().requires_grad_()
    y = ours(x_cl)
    y.backward(dy.contiguous(memory_format=torch.channels_last))
    y_ref = torch_gn(x_ref)
    y_ref.backward(dy)
    assert y.is_contiguous(memory_format=torch.channels_last) and y.dtype == dtype
    if dtype == torch.bfloat16:  # the NCHW kernel on the same values: bit for bit
        assert torch.equal(y, y_ref) and torch.equal(x_cl.grad, x_ref.grad)
    else:  # float32 keeps torch's channels_last kernel
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(x_cl.grad, x_ref.grad)
    for p, p_ref in zip(ours.parameters(), torch_gn.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad)
    assert ours.state_dict().keys() == torch_gn.state_dict().keys()
