"""Why nbs_depth trains in NCHW: torch's CPU BatchNorm in channels_last sums its statistics
less precisely in float32 than in NCHW (the statistics of 256 x 28 x 28 values per channel),
which resnet20 at initialisation amplifies past the preflight check's limit. Against float64.
If this fails, torch has made the two layouts agree and configs/experiment/nbs_depth.yaml's
trainer.channels_last=false can be revisited."""

import torch


def test_channels_last_batchnorm_is_much_less_precise_than_nchw_in_float32():
    torch.manual_seed(0)
    x = torch.randn(256, 4, 28, 28, dtype=torch.float64) * 3 + 1
    reference = torch.nn.functional.batch_norm(x, None, None, training=True)

    def error(memory_format):
        xf = x.float().contiguous(memory_format=memory_format)
        out = torch.nn.functional.batch_norm(xf, None, None, training=True).double()
        return ((out - reference).norm() / reference.norm()).item()

    nchw, channels_last = error(torch.contiguous_format), error(torch.channels_last)
    assert nchw < 1e-6  # float32 rounding of the output alone
    assert channels_last > 20 * nchw, (nchw, channels_last)
