"""``position_fraction``: KFAC-expand's patch factor from a random subset of positions.

Against the loop-based definition of the factors (kfac_reference.py), float64: with every
position kept (through the sampling path) the factors are the definition's; with a fraction, the
mean over many draws is the full factor within its standard error (unbiased), one draw is not,
and every other factor is the one computed with every position (same draws of ``z``).
"""

import math

import pytest
import torch
from torch import nn

import lsn_ext
from lsn_ext.kron import kron_curvature, layers
from lsn_ext.rules.losses import BCEWithLogits, CrossEntropy
from tests.kron.kfac_reference import reference_factors
from tests.networks import tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")

# id -> (layer under test, number of spatial dims, input shape)
LAYERS = {
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
    "conv3d-stride-pad": (
        lambda: nn.Conv3d(2, 3, 3, stride=(1, 2, 1), padding=1),
        3,
        (2, 2, 3, 4, 3),
    ),
    "convT2d-dilation-groups2": (
        lambda: nn.ConvTranspose2d(
            4, 6, 3, stride=(2, 1), padding=(0, 1), dilation=(1, 2), groups=2
        ),
        2,
        (2, 4, 3, 3),
    ),
}
# Draws of the positions per test (was 600). Each entry's 6-se bound uses the standard error of
# these draws; the relative error of the mean, which the bound of 0.1 keeps small (the test's
# power), grows as 1/√DRAWS: 0.064 at most over every factor here with 300 draws (0.041 with
# 600, 0.101 with 150).
DRAWS = 300


def _net(case: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer, tanh and a 1×1 head; input, targets and two fixed draws ``z``."""
    make, d, shape = LAYERS[case]
    layer = make()
    head = [nn.Conv1d, nn.Conv2d, nn.Conv3d][d - 1](layer.out_channels, 2, 1)
    net = nn.Sequential(layer, nn.Tanh(), head)
    x = torch.randn(shape)
    with torch.no_grad():
        f = net(x)
    y = torch.randint(0, 2, (f.shape[0], *f.shape[2:]))
    z = torch.randint(0, 2, (2, *f.shape)).double() * 2 - 1
    return net, x, y, z


def _assert_unbiased(draws: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """Every entry's mean over the draws within 6 standard errors of the full factor."""
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(draws.shape[0])
    assert torch.all((mean - full).abs() <= 6 * se + 1e-12), name
    assert float((mean - full).norm() / full.norm()) < 0.1, name


@pytest.mark.parametrize("case", list(LAYERS))
def test_every_position_kept_is_the_definition(case):
    """A fraction just below 1 keeps every position, in random order, by the gather path."""
    net, x, y, z = _net(case)
    gen = torch.Generator().manual_seed(0)
    result = kron_curvature(net, x, y, noise=z, position_fraction=1 - 1e-9, generator=gen)
    reference = reference_factors(net, x, y, CrossEntropy(), z, "expand")
    for name, ref in reference.items():
        for a, b in zip(result.factors(name), ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [1.0, 1 - 1e-9], ids=["every-position", "sampling-path"])
@pytest.mark.parametrize("case", list(LAYERS))
def test_small_chunks_give_the_definition(case, fraction, monkeypatch):
    """Patches gathered a few entries at a time (many chunks, both paths): the same factors."""
    monkeypatch.setattr(layers, "CHUNK", 7)
    net, x, y, z = _net(case)
    gen = torch.Generator().manual_seed(0)
    result = kron_curvature(net, x, y, noise=z, position_fraction=fraction, generator=gen)
    reference = reference_factors(net, x, y, CrossEntropy(), z, "expand")
    for name, ref in reference.items():
        for a, b in zip(result.factors(name), ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("case", list(LAYERS))
def test_a_fraction_is_unbiased_and_leaves_the_other_factors(case):
    net, x, y, z = _net(case)
    reference = reference_factors(net, x, y, CrossEntropy(), z, "expand")
    gen = torch.Generator().manual_seed(0)
    runs = [
        kron_curvature(net, x, y, noise=z, position_fraction=0.4, generator=gen)
        for _ in range(DRAWS)
    ]
    for name in ("0.weight", "2.weight"):  # F_1, the patch factor, of both layers
        draws = torch.stack([r.factors(name)[1] for r in runs])
        _assert_unbiased(draws, reference[name][1], name)
    assert not torch.allclose(draws[0], reference["2.weight"][1], rtol=1e-3, atol=0)
    for name, ref in reference.items():  # every other factor: as with every position
        for i, b in enumerate(ref):
            if runs[0].blocks[name] != "kfac" or i == 0:
                torch.testing.assert_close(runs[0].factors(name)[i], b, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_unet_patch_factors_are_unbiased():
    """Every weight of a U-Net with concatenating skips, BCE, several layers sampled at once."""
    net = tiny_unet(out_channels=1, up="transposed")
    x = torch.randn(2, 2, 8, 8)
    y = torch.randint(0, 2, (2, 1, 8, 8)).double()
    z = torch.randint(0, 2, (1, 2, 1, 8, 8)).double() * 2 - 1
    loss = BCEWithLogits()
    reference = reference_factors(net, x, y, loss, z, "expand")
    gen = torch.Generator().manual_seed(1)
    runs = [
        kron_curvature(net, x, y, loss, noise=z, position_fraction=0.25, generator=gen)
        for _ in range(DRAWS)
    ]
    weights = [n for n in runs[0].names if runs[0].blocks[n] == "kfac"]
    assert len(weights) == 8
    for name in weights:
        draws = torch.stack([r.factors(name)[1] for r in runs])
        _assert_unbiased(draws, reference[name][1], name)
        torch.testing.assert_close(runs[0].factors(name)[0], reference[name][0])


def test_g_is_the_same_for_the_same_generator():
    """The positions are drawn after ``z``: ``G``, biases and other blocks are unchanged."""
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.Tanh(), nn.Conv2d(3, 2, 1)
    )
    x, y = torch.randn(2, 2, 6, 6), torch.randint(0, 2, (2, 6, 6))

    def fit(fraction: float):
        gen = torch.Generator().manual_seed(3)
        return kron_curvature(net, x, y, position_fraction=fraction, generator=gen)

    every, some = fit(1.0), fit(0.3)
    for name in every.names:
        for i, (a, b) in enumerate(zip(every.factors(name), some.factors(name), strict=True)):
            if every.blocks[name] == "kfac" and i == 1:
                assert not torch.allclose(a, b), name
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_the_backend_passes_the_fraction():
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 1)).double()
    x, y = torch.randn(2, 1, 5, 5), torch.randint(0, 2, (2, 5, 5))
    full = lsn_ext.DiagBackprop(net, "classification").kron(x, y, N=2)[1].kfacs
    part = lsn_ext.DiagBackprop(net, "classification", kron_position_fraction=0.2)
    assert part.kron_position_fraction == 0.2
    kfacs = part.kron(x, y, N=2)[1].kfacs
    torch.testing.assert_close(kfacs[0][0], full[0][0])  # G: the same draws
    assert not torch.allclose(kfacs[0][1], full[0][1])  # A: a fifth of the positions


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kron_position_fraction": 0.0}, r"kron_position_fraction must be a number in \(0, 1\]"),
        ({"kron_position_fraction": 1.5}, r"kron_position_fraction must be a number in \(0, 1\]"),
        ({"kron_position_fraction": True}, r"kron_position_fraction must be a number"),
        (
            {"kron_position_fraction": 0.5, "kron_mode": "reduce"},
            "kron_position_fraction=0.5 samples the positions of KFAC-expand's patch factor",
        ),
    ],
    ids=["zero", "above-one", "bool", "with-reduce"],
)
def test_the_backend_checks_the_fraction(kwargs, message):
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 1))
    with pytest.raises(ValueError, match=message):
        lsn_ext.DiagBackprop(net, "classification", **kwargs)
