"""Bad inputs and unsupported uses: errors that name the problem; the model is left as it was."""

import pytest
import torch
from torch import nn

from lsn_ext.kron import kron_curvature
from tests.networks import TiedNet


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 1))


def _hooks(net: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())


X, Y = torch.randn(2, 1, 3, 3, dtype=torch.float64), torch.randint(0, 2, (2, 3, 3))

BAD_ARGUMENTS = {
    "mode": ({"mode": "average"}, "mode must be 'expand' or 'reduce'"),
    "mc_samples-zero": ({"mc_samples": 0}, "mc_samples must be a positive int or 'exact'"),
    "mc_samples-bool": ({"mc_samples": True}, "mc_samples must be a positive int"),
    "full_limit": ({"full_limit": -1}, "full_limit must be a non-negative int"),
    "N-below-batch": ({"N": 1}, "at least the batch's 2"),
    "position_fraction-zero": (
        {"position_fraction": 0},
        r"position_fraction must be a number in \(0, 1\], got 0",
    ),
    "position_fraction-above-one": (
        {"position_fraction": 1.01},
        r"position_fraction must be a number in \(0, 1\]",
    ),
    "position_fraction-string": ({"position_fraction": "half"}, "position_fraction must be a"),
    "position_fraction-with-reduce": (
        {"position_fraction": 0.5, "mode": "reduce"},
        "KFAC-reduce only sums the patches",
    ),
    "noise-shape": (
        {"noise": torch.ones(2, 2, 2, 3, dtype=torch.float64)},
        r"noise must have shape \[S, 2, 2, 3, 3\]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments(case):
    kwargs, message = BAD_ARGUMENTS[case]
    net = _net()
    with pytest.raises(ValueError, match=message):
        kron_curvature(net, X, Y, **kwargs)
    assert _hooks(net) == 0


def test_tied_weight_gets_a_block_from_its_gradients():
    """Two convolutions holding one weight: not a KFAC layer, a block from batch gradients."""
    net = TiedNet()
    x, y = torch.randn(2, 1, 4, 4), torch.randint(0, 2, (2, 4, 4))
    result = kron_curvature(net, x, y)
    assert result.blocks["mid.weight"] == "nearest kron"
    assert result.paths["mid.weight"] == "batch gradient"
    assert result.blocks["mid2.bias"] == "kfac bias"


def test_weight_also_used_outside_its_module():
    class Reused(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3, padding=1)

        def forward(self, x):
            return self.conv(x) + self.conv.weight[:, 0, :1, :1]  # per class: not in H's null space

    net = Reused()
    with pytest.raises(ValueError, match=r"'conv' \(Conv2d, weight \[2, 1, 3, 3\]\).*weight"):
        kron_curvature(net, X, torch.randint(0, 2, (2, 3, 3)))
    assert _hooks(net) == 0


def test_linear_without_the_batch_on_dim_0():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x.permute(1, 0, 2)).permute(1, 0, 2).movedim(-1, 1)

    net = Flat()
    x, y = torch.randn(2, 3, 2), torch.randint(0, 2, (2, 3))
    with pytest.raises(ValueError, match=r"'fc' \(Linear, weight \[2, 2\]\).*dim 0"):
        kron_curvature(net, x, y)
    assert _hooks(net) == 0


def test_non_finite_logits():
    net = _net()
    with pytest.raises(ValueError, match="non-finite"):
        kron_curvature(net, X * float("nan"), Y)


def test_bad_targets_come_from_the_loss():
    with pytest.raises(ValueError, match="cross-entropy targets"):
        kron_curvature(_net(), X, Y[:, :2])


def test_exact_refuses_large_outputs():
    x = torch.randn(4, 1, 64, 64)
    with pytest.raises(ValueError, match="one backward pass per logit entry"):
        kron_curvature(_net(), x, torch.randint(0, 2, (4, 64, 64)), mc_samples="exact")


def test_mc_samples_beyond_memory():
    with pytest.raises(ValueError, match=r"mc_samples=\d+ needs .* GiB"):
        kron_curvature(_net(), X, Y, mc_samples=2**40)


def test_no_trainable_parameters():
    net = _net().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        kron_curvature(net, X, Y)


def test_frozen_weight_keeps_its_bias():
    net = _net()
    net[0].weight.requires_grad_(False)
    result = kron_curvature(net, X, Y)
    assert "0.weight" not in result.names
    assert result.blocks["0.bias"] == "kfac bias"
