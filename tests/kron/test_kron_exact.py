"""Kron blocks in expectation (``mc_samples="exact"``) against the exact GGN blocks.

KFAC is exact where the factors are independent: one sample without weight sharing (every
layer), the last layer under a constant loss Hessian (MSE) with expand-type sharing, and
KFAC-reduce for a sample whose weight-shared outputs are pooled linearly. Blocks of parameters
outside KFAC layers are exact (full, diagonal) or exact where the block is a Kronecker product.
"""

import pytest
import torch
from torch import nn

from lsn_ext.kron import kron_curvature
from lsn_ext.rules.losses import MSE, CrossEntropy
from tests.kron.kfac_reference import dense_entry, exact_blocks
from tests.networks import tiny_unet


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_exact(net, x, y, loss, names=None, mode="expand", **kwargs):
    result = kron_curvature(net, x, y, loss, mode=mode, mc_samples="exact", **kwargs)
    exact = exact_blocks(net, x, y, loss)
    for name in names or result.names:
        torch.testing.assert_close(
            dense_entry(result.factors(name)), exact[name], rtol=1e-9, atol=1e-11, msg=name
        )
    return result, exact


def test_one_sample_without_sharing_is_exact_for_every_layer():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    _assert_exact(net, torch.randn(1, 3), torch.tensor([2]), CrossEntropy())


# id -> (last layer, input shape); MSE: H = I, independent positions, so expand is exact
LAST_LAYERS = {
    "linear-tokens": (lambda: nn.Linear(3, 2), (3, 4, 3)),
    "conv2d-3x3-stride2": (lambda: nn.Conv2d(2, 2, 3, stride=2, padding=1), (2, 2, 5, 5)),
    "conv3d-3x3x3": (lambda: nn.Conv3d(2, 2, 3, padding=1), (2, 2, 3, 3, 2)),
    "convT2d-k2s2": (lambda: nn.ConvTranspose2d(2, 2, 2, stride=2), (2, 2, 2, 3)),
    "convT3d-k2s2": (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (1, 2, 2, 1, 2)),
}


@pytest.mark.parametrize("case", list(LAST_LAYERS))
def test_expand_is_exact_for_a_last_layer_under_mse(case):
    make, shape = LAST_LAYERS[case]
    net = nn.Sequential(make())
    x = torch.randn(shape)
    with torch.no_grad():
        y = torch.randn_like(net(x))
    _assert_exact(net, x, y, MSE())


def test_reduce_is_exact_for_pooled_outputs_and_expand_is_not():
    """One sample, conv → mean over pixels → Linear: KFAC-reduce's setting (Eschenhagen et al.)."""

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 3, padding=1)
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(self.conv(x).mean((2, 3)))

    net, x, y = Pooled(), torch.randn(1, 2, 4, 4), torch.tensor([1])
    _assert_exact(net, x, y, CrossEntropy(), mode="reduce")
    expand = kron_curvature(net, x, y, mode="expand", mc_samples="exact")
    exact = exact_blocks(net, x, y, CrossEntropy())
    assert _rel(dense_entry(expand.factors("conv.weight")), exact["conv.weight"]) > 0.1


@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_bias_blocks_are_exact_with_weight_sharing(mode):
    """The default bias block is the bias's GGN block; expand's G (bias_block='kfac') is not."""
    net = tiny_unet(out_channels=2, up="transposed")
    x, y = torch.randn(1, 2, 4, 4), torch.randint(0, 2, (1, 4, 4))
    result = kron_curvature(net, x, y, mode=mode, mc_samples="exact")
    exact = exact_blocks(net, x, y, CrossEntropy())
    biases = [n for n in result.names if result.blocks[n] == "kfac bias"]
    assert len(biases) == 8
    for name in biases:
        torch.testing.assert_close(result.factors(name)[0], exact[name], rtol=1e-9, atol=1e-11)
    kfac = kron_curvature(net, x, y, mode=mode, mc_samples="exact", bias_block="kfac")
    worst = max(_rel(kfac.factors(n)[0], exact[n]) for n in biases)
    assert worst > 0.1 if mode == "expand" else worst < 1e-9


class Mix(nn.Module):
    """A leaf holding a 2-D parameter that is not an ``nn.Linear``: ``y = W x`` per position."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c_out, c_in))

    def forward(self, x):
        return torch.einsum("oi,ni...->no...", self.weight, x)


def _normed_net():
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.PReLU(4),
        nn.InstanceNorm2d(4, affine=True),
        nn.Conv2d(4, 2, 1),
    )
    with torch.no_grad():
        for m in (net[1], net[3]):
            m.weight.uniform_(0.5, 1.5)
            m.bias.normal_()
    return net


@pytest.mark.parametrize("full_limit", [512, 0], ids=["full", "diagonal"])
def test_norm_and_prelu_blocks_are_exact(full_limit):
    net, x = _normed_net(), torch.randn(2, 2, 3, 3)
    y = torch.randint(0, 2, (2, 3, 3))
    result = kron_curvature(net, x, y, mc_samples="exact", full_limit=full_limit)
    exact = exact_blocks(net, x, y, CrossEntropy())
    for name in ("1.weight", "1.bias", "2.weight", "3.weight", "3.bias"):
        assert result.paths[name] == "per-sample"
        want = exact[name] if full_limit else torch.diag(exact[name].diagonal())
        assert result.blocks[name] == ("full" if full_limit else "diagonal")
        torch.testing.assert_close(result.factors(name)[0], want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("full_limit", [512, 0], ids=["nearest-kron", "kron-moments"])
def test_matrix_parameter_outside_kfac_layers(full_limit):
    """One sample, no sharing: the block is a Kronecker product, and both recover it."""
    net = nn.Sequential(Mix(3, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(1, 3), torch.tensor([0])
    result, _ = _assert_exact(net, x, y, CrossEntropy(), names=["0.weight"], full_limit=full_limit)
    assert result.blocks["0.weight"] == ("nearest kron" if full_limit else "kron moments")
    F0, F1 = result.factors("0.weight")
    assert F0.shape == (4, 4)
    assert F1.shape == (3, 3)
    torch.testing.assert_close(F1.trace(), torch.tensor(1.0))  # M/N with N = M


def test_kron_moments_keep_the_trace():
    """With weight sharing the block is no Kronecker product; the trace is still exact."""
    net = nn.Sequential(Mix(2, 3), nn.Tanh(), nn.Conv2d(3, 2, 1))
    x, y = torch.randn(2, 2, 3, 3), torch.randint(0, 2, (2, 3, 3))
    result = kron_curvature(net, x, y, mc_samples="exact", full_limit=0, N=6)
    exact = exact_blocks(net, x, y, CrossEntropy())
    F0, F1 = result.factors("0.weight")
    torch.testing.assert_close(F1.trace(), torch.tensor(2 / 6))
    torch.testing.assert_close((F0.trace() * F1.trace()) * 6 / 2, exact["0.weight"].trace())


class Scaled(nn.Module):
    """A parameter held by a module with children (no per-sample replay): the batch gradient."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.scale = nn.Parameter(torch.tensor([0.7, 1.3]))

    def forward(self, x):
        return self.conv(x) * self.scale[:, None, None]


class Centred(nn.Module):
    """A leaf whose output mixes the samples: the replay is refused by its output check."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.5, 2.0]))

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) * self.weight[:, None, None]


@pytest.mark.parametrize(
    "make",
    [Scaled, lambda: nn.Sequential(nn.Conv2d(2, 2, 1), Centred())],
    ids=["container", "mixing-leaf"],
)
def test_batch_gradient_path_is_exact_in_expectation(make):
    net, x = make(), torch.randn(3, 2, 2, 2)
    y = torch.randint(0, 2, (3, 2, 2))
    result = kron_curvature(net, x, y, mc_samples="exact")
    exact = exact_blocks(net, x, y, CrossEntropy())
    name = "scale" if isinstance(net, Scaled) else "1.weight"
    assert result.paths[name] == "batch gradient"
    torch.testing.assert_close(result.factors(name)[0], exact[name], rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_monte_carlo_draws_are_unbiased():
    """600 Rademacher draws land within their noise of the expectation, for every block.

    Seed 0 gives relative Frobenius errors of 0.005–0.08 (0.002–0.07 for seeds 1 and 2); a
    bias of a factor 2 or a missing average over draws would give 0.5 or more.
    """
    net = _normed_net()
    x, y = torch.randn(2, 2, 3, 3), torch.randint(0, 2, (2, 3, 3))
    gen = torch.Generator().manual_seed(0)
    mc = kron_curvature(net, x, y, mc_samples=600, generator=gen)
    exact = kron_curvature(net, x, y, mc_samples="exact")
    for name in exact.names:
        assert _rel(dense_entry(mc.factors(name)), dense_entry(exact.factors(name))) < 0.2, name
