"""KFAC factors of ``kron_curvature`` against their loop-based definition (kfac_reference.py)."""

import itertools

import pytest
import torch
from torch import nn

from lsn_ext.kron import kron_curvature
from lsn_ext.rules.losses import BCEWithLogits, CrossEntropy
from tests.kron.kfac_reference import reference_factors
from tests.networks import tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")


def _head(d: int, c: int) -> nn.Module:
    return [nn.Conv1d, nn.Conv2d, nn.Conv3d][d - 1](c, 2, 1)


# id -> (layer under test, number of spatial dims (0: Linear on tokens), input shape)
LAYERS = {
    "linear-tokens": (lambda: nn.Linear(3, 4), 0, (2, 5, 3)),
    "conv1d-stride2-pad1": (lambda: nn.Conv1d(2, 3, 3, stride=2, padding=1), 1, (2, 2, 7)),
    "conv1d-same-even-kernel": (lambda: nn.Conv1d(2, 3, 4, padding="same"), 1, (2, 2, 6)),
    "conv2d-dilation-groups2": (
        lambda: nn.Conv2d(4, 4, 3, dilation=(2, 1), padding=(2, 1), groups=2),
        2,
        (2, 4, 5, 4),
    ),
    "conv2d-reflect-stride": (
        lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, padding_mode="reflect"),
        2,
        (2, 2, 5, 5),
    ),
    "conv2d-circular": (
        lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"),
        2,
        (2, 2, 4, 4),
    ),
    "conv3d-stride-pad": (
        lambda: nn.Conv3d(2, 3, 3, stride=(1, 2, 1), padding=1),
        3,
        (2, 2, 3, 4, 3),
    ),
    "convT1d-stride2-outpad1": (
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1),
        1,
        (2, 2, 4),
    ),
    "convT1d-dilation3-outpad2": (
        lambda: nn.ConvTranspose1d(2, 2, 3, dilation=3, output_padding=2),
        1,
        (2, 2, 3),
    ),
    "convT2d-k2s2": (lambda: nn.ConvTranspose2d(3, 2, 2, stride=2), 2, (2, 3, 3, 3)),
    "convT2d-dilation-groups2": (
        lambda: nn.ConvTranspose2d(
            4, 6, 3, stride=(2, 1), padding=(0, 1), dilation=(1, 2), groups=2
        ),
        2,
        (2, 4, 3, 3),
    ),
    "convT3d-pad1-nobias": (
        lambda: nn.ConvTranspose3d(2, 2, 3, stride=2, padding=1, bias=False),
        3,
        (1, 2, 2, 3, 2),
    ),
}


def _net(case: str) -> tuple[nn.Module, torch.Tensor]:
    make, d, shape = LAYERS[case]
    layer = make()
    if d == 0:
        return nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 2)), torch.randn(shape)
    out_channels = layer.out_channels
    return nn.Sequential(layer, nn.Tanh(), _head(d, out_channels)), torch.randn(shape)


def _targets(net: nn.Module, x: torch.Tensor, tokens: bool) -> torch.Tensor:
    with torch.no_grad():
        f = net(x)
    if tokens:  # CE over the last axis: give [N, C, L] logits
        return torch.randint(0, 2, (f.shape[0], f.shape[1]))
    return torch.randint(0, 2, (f.shape[0], *f.shape[2:]))


class TokenCE(CrossEntropy):
    """Cross-entropy with the classes on the last axis (a transformer's ``[N, L, C]``)."""

    def value(self, logits, targets):
        return super().value(logits.movedim(-1, 1), targets)

    def hessian_sqrt(self, logits, targets, z):
        s = super().hessian_sqrt(logits.movedim(-1, 1), targets, z.movedim(-1, 2))
        return s.movedim(2, -1)


def _assert_entries(result, reference):
    assert set(reference) <= set(result.names)
    for name, ref in reference.items():
        got = result.factors(name)
        assert len(got) == len(ref), name
        for a, b in zip(got, ref, strict=True):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("mode", ["expand", "reduce"])
@pytest.mark.parametrize("case", list(LAYERS))
def test_factors_match_their_definition(case, mode):
    net, x = _net(case)
    tokens = LAYERS[case][1] == 0
    loss = TokenCE() if tokens else CrossEntropy()
    y = _targets(net, x, tokens)
    with torch.no_grad():
        f = net(x)
    z = torch.randint(0, 2, (2, *f.shape)).double() * 2 - 1
    bias_block = "kfac" if "1d" in case else "exact"
    result = kron_curvature(net, x, y, loss, mode=mode, noise=z, N=7, bias_block=bias_block)
    reference = reference_factors(net, x, y, loss, z, mode, N_data=7, bias_block=bias_block)
    _assert_entries(result, reference)
    assert all(result.blocks[n] in ("kfac", "kfac bias") for n in result.names)


@pytest.mark.parametrize("bias_block", ["exact", "kfac"])
@pytest.mark.parametrize("mode", ["expand", "reduce"])
@pytest.mark.parametrize("up", ["transposed", "bilinear"])
def test_unet_with_concat_skips(up, mode, bias_block):
    """Every factor of a U-Net with nested concatenating skips, BCE with one channel."""
    net = tiny_unet(out_channels=1, up=up)
    x = torch.randn(2, 2, 8, 8)
    y = torch.randint(0, 2, (2, 1, 8, 8)).double()
    z = torch.randint(0, 2, (3, 2, 1, 8, 8)).double() * 2 - 1
    loss = BCEWithLogits()
    result = kron_curvature(net, x, y, loss, mode=mode, noise=z, bias_block=bias_block)
    reference = reference_factors(net, x, y, loss, z, mode, bias_block=bias_block)
    assert len(reference) == len(result.names)
    _assert_entries(result, reference)


def test_module_called_twice_pools_its_positions():
    """A layer applied twice (a shared head) has the positions of both calls in its factors."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            return self.conv(torch.tanh(self.conv(x)))

    net, x = Twice(), torch.randn(2, 2, 4, 4)
    y = torch.randint(0, 2, (2, 4, 4))
    z = torch.randint(0, 2, (2, 2, 2, 4, 4)).double() * 2 - 1
    for mode in ("expand", "reduce"):
        result = kron_curvature(net, x, y, mode=mode, noise=z)
        _assert_entries(result, reference_factors(net, x, y, CrossEntropy(), z, mode))


def test_transposed_called_with_output_size():
    """``output_size=`` changes the output padding per call; the columns follow the output."""

    class Up(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1)

        def forward(self, x):
            return self.up(x, output_size=[2 * x.shape[2], 2 * x.shape[3]])

    net, x = Up(), torch.randn(2, 2, 3, 3)
    y = torch.randint(0, 2, (2, 6, 6))
    z = torch.randint(0, 2, (2, 2, 2, 6, 6)).double() * 2 - 1
    result = kron_curvature(net, x, y, noise=z)
    _assert_entries(result, reference_factors(net, x, y, CrossEntropy(), z, "expand"))


def test_rademacher_draws_average_to_the_exact_expectation():
    """Averaging over all 2^K sign vectors is the expectation: it equals mc_samples='exact'."""
    net = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.GroupNorm(1, 2), nn.Conv2d(2, 2, 1)
    )
    x = torch.randn(1, 1, 2, 1)
    y = torch.randint(0, 2, (1, 2, 1))
    signs = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=4)))
    z = signs.reshape(-1, 1, 2, 2, 1)
    for mode in ("expand", "reduce"):
        every = kron_curvature(net, x, y, mode=mode, noise=z)
        exact = kron_curvature(net, x, y, mode=mode, mc_samples="exact")
        for name in exact.names:
            for a, b in zip(every.factors(name), exact.factors(name), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    one = kron_curvature(net, x, y, noise=z[:1])
    assert not torch.allclose(one.factors("0.weight")[0], exact.factors("0.weight")[0])
