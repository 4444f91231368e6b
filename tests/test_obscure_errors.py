"""Inputs that once ended in a raw torch or library error: each now works or is refused clearly.

Every refusal names the module, argument or value and says what to do instead (issue 38).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lsn_ext


class ChannelsLastLayerNorm(nn.Module):
    """ConvNeXt's idiom: ``LayerNorm(C)`` over the channels of ``[N, C, *]`` through ``permute``."""

    def __init__(self, channels: int, contiguous: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.contiguous = contiguous

    def forward(self, x):
        last = (0, *range(2, x.dim()), 1)
        h = x.permute(last)
        y = self.norm(h.contiguous() if self.contiguous else h)
        return y.permute(0, x.dim() - 1, *range(1, x.dim() - 1))


def _convnext_block(dims: int, contiguous: bool = False) -> nn.Module:
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    model = nn.Sequential(
        conv(2, 4, 3, padding=1), ChannelsLastLayerNorm(4, contiguous), nn.GELU(), conv(4, 3, 1)
    )
    with torch.no_grad():
        model[1].norm.weight.uniform_(0.5, 2)
        model[1].norm.bias.uniform_(-1, 1)
    return model


@pytest.mark.parametrize("estimator", ["mc", "db"])
@pytest.mark.parametrize("dims", [2, 3], ids=["2d", "3d"])
def test_layer_norm_over_permuted_channels_with_a_batch_of_one(dims, estimator):
    """Batch 1 (a 3-D volume's usual batch) gives the numbers of the contiguous twin network.

    The permuted batch of one reached torch's fused group norm as a strided view: ``Expected
    X.is_contiguous(memory_format)``. The rule itself is checked against ``jacrev`` in
    ``tests/rules/test_norm.py``.
    """
    model = _convnext_block(dims)
    twin = _convnext_block(dims, contiguous=True)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(1, 2, *(4,) * dims)
    y = torch.randint(0, 3, (1, *(4,) * dims))

    def run(m):
        gen = torch.Generator().manual_seed(3)
        kwargs = {"generator": gen, "mc_samples": 2} if estimator == "mc" else {}
        return lsn_ext.ggn_diagonal(m, x, y, "ce", estimator=estimator, **kwargs).vector

    got, want = run(model), run(twin)
    assert (want > 0).any()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
