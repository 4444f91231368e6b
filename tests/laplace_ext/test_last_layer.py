"""Last-layer Laplace for convolution and token heads (lsn_ext.laplace_ext.head*, last_layer).

References are independent of the closed forms: dense Jacobians of the whole network w.r.t. the
head's parameters (``torch.func.jacfwd``), the loss Hessian by ``torch.func.hessian``, dense
posterior covariances from laplace-torch, Monte Carlo over head weights set into the network
with ``functional_call``, and lsn_ext.kron's loop-based KFAC expectation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacfwd

from lsn_ext.kron import kron_curvature
from lsn_ext.laplace_ext import (
    HeadError,
    HeadFeatureExtractor,
)
from lsn_ext.laplace_ext.head import capture_head, find_head
from lsn_ext.laplace_ext.head_curvature import head_curvature
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy
from tests.model_state import assert_unchanged, snapshot


class Tokens(nn.Module):
    """A token model: Linear head on [N, T, D], logits moved to [N, C, H, W]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(2, 5, 2, stride=2)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x)).flatten(2).transpose(1, 2)  # [N, T, 5]
        out = self.head(h)  # [N, T, 3]
        return out.movedim(-1, 1).reshape(x.shape[0], 3, x.shape[2] // 2, x.shape[3] // 2)


def _trunk(conv=nn.Conv2d, c_in=2, width=4):
    return [conv(c_in, width, 3, padding=1), nn.Tanh()]


NETS = {  # name: (build, input shape, classes)
    "conv2d-1x1": (lambda: nn.Sequential(*_trunk(), nn.Conv2d(4, 3, 1)), (2, 2, 5, 6), 3),
    "conv2d-3x3-reflect-stride2": (
        lambda: nn.Sequential(
            *_trunk(), nn.Conv2d(4, 3, 3, padding=1, stride=2, padding_mode="reflect")
        ),
        (2, 2, 5, 6),
        3,
    ),
    "conv3d-3x3x3-nobias": (
        lambda: nn.Sequential(*_trunk(nn.Conv3d, 1, 3), nn.Conv3d(3, 2, 3, padding=1, bias=False)),
        (2, 1, 2, 3, 2),
        2,
    ),
    "convtranspose2d-stride2": (
        lambda: nn.Sequential(
            *_trunk(), nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)
        ),
        (2, 2, 3, 4),
        3,
    ),
    "convtranspose3d-stride2": (
        lambda: nn.Sequential(
            *_trunk(nn.Conv3d, 1, 3),
            nn.ConvTranspose3d(3, 2, 3, stride=2, padding=1, output_padding=1),
        ),
        (1, 1, 2, 3, 2),
        2,
    ),
    "linear-tokens": (Tokens, (2, 2, 4, 6), 3),
    "linear-classifier": (
        lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), (5, 4), 3
    ),
}  # fmt: skip


def build_net(name):
    build, shape, classes = NETS[name]
    torch.manual_seed(0)
    return build().eval(), torch.randn(*shape), classes


def targets(f, kind):
    gen = torch.Generator().manual_seed(1)
    if kind == "ce":
        return torch.randint(0, f.shape[1], (f.shape[0], *f.shape[2:]), generator=gen)
    if kind == "bce":
        return (torch.rand(f.shape, generator=gen) > 0.5).to(f.dtype)
    return torch.randn(f.shape, generator=gen)


LOSSES = {"ce": CrossEntropy(), "bce": BCEWithLogits(pos_weight=torch.tensor(2.0)), "mse": MSE()}


def head_of(net, x):
    name = find_head(net, x)
    return name, net.get_submodule(name)


def dense_jacobian(net, name, head, x):
    """``J [outputs, P]`` of ``net(x)`` w.r.t. the head's parameters in parameters() order
    (forward mode through the whole network: one JVP per head parameter)."""
    params = {f"{name}.{n}": p.detach() for n, p in head.named_parameters()}
    J = jacfwd(lambda p: functional_call(net, p, (x,)))(params)
    rows = net(x).numel()
    return torch.cat([J[f"{name}.{n}"].reshape(rows, -1) for n, _ in head.named_parameters()], 1)


def dense_ggn(net, name, head, x, y, loss):
    J = dense_jacobian(net, name, head, x)
    f = net(x).detach()
    H = torch.func.hessian(lambda g: loss.value(g, y))(f).reshape(f.numel(), f.numel())
    return J.T @ H @ J


# -- head detection ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "expected"),
    [("conv2d-1x1", "2"), ("conv3d-3x3x3-nobias", "2"), ("convtranspose3d-stride2", "2"),
     ("linear-tokens", "head"), ("linear-classifier", "2")],
)  # fmt: skip
def test_head_is_the_last_layer_with_parameters(name, expected):
    net, x, _ = build_net(name)
    assert find_head(net, x) == expected
    extractor = HeadFeatureExtractor(net)
    out = extractor(x)
    assert extractor.last_layer is net.get_submodule(expected)
    assert torch.equal(out, net(x))


def test_a_named_head_is_used_and_checked():
    net = nn.Sequential(*_trunk(), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 3, 1)).eval()
    x = torch.randn(2, 2, 4, 4)
    extractor = HeadFeatureExtractor(net, last_layer_name="3")
    assert extractor.last_layer is net[3]
    with pytest.raises(HeadError, match=r"not the output of its last layer '2'"):
        capture_head(net, net[2], x, "2")
    with pytest.raises(HeadError, match=r"no module named 'nope'.*\['0', '2', '3'\]"):
        HeadFeatureExtractor(net, last_layer_name="nope")


class _Standardised(nn.Conv2d):
    def forward(self, x):
        w = (self.weight - self.weight.mean()) / self.weight.std()
        return self._conv_forward(x, w, self.bias)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        return self.head(self.head(x))


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3)),
         r"'1' \(BatchNorm2d, weight \[3\]\) is not a Linear, Conv1d/2d/3d"),
        (lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.Upsample(scale_factor=2)),
         r"output \(2, 3, 8, 8\) is not the output of its last layer '0'"),
        (lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.Sigmoid()),
         r"differs from the output of its last layer '0'.*an activation"),
        (lambda: nn.Sequential(nn.Conv2d(2, 4, 1, groups=2)), r"groups=2"),
        (lambda: nn.Sequential(_Standardised(2, 3, 1)), r"does not compute W·φ \+ b.*Conv2d"),
        (lambda: _Twice(), r"runs 2 times"),
        (lambda: nn.Sequential(nn.ReLU()), r"no module with parameters runs"),
    ],
    ids=["batchnorm-last", "upsample-after", "activation-after", "groups", "standardised",
         "called-twice", "no-parameters"],
)  # fmt: skip
def test_no_usable_head_is_a_clear_error(build, pattern):
    net = build().eval()
    x = torch.randn(2, 2, 4, 4)
    before = snapshot(net)
    with pytest.raises(HeadError, match=pattern):
        HeadFeatureExtractor(net).find_last_layer(x)
    assert_unchanged(net, before)


def test_classes_on_the_last_axis_and_frozen_heads_are_refused():
    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(x)

    with pytest.raises(HeadError, match=r"last axis.*movedim\(-1, 1\)"):
        HeadFeatureExtractor(Last()).find_last_layer(torch.randn(2, 5, 4))
    net = nn.Sequential(nn.Conv2d(2, 3, 1))
    net[0].bias.requires_grad_(False)
    with pytest.raises(HeadError, match=r"frozen parameters \['bias'\]"):
        HeadFeatureExtractor(net).find_last_layer(torch.randn(1, 2, 3, 3))


# -- exact curvature --------------------------------------------------------------------------
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("name", sorted(NETS))
def test_head_ggn_is_the_dense_jacobian_ggn(name, loss):
    net, x, _ = build_net(name)
    head_name, head = head_of(net, x)
    y = targets(net(x), loss)
    dense = dense_ggn(net, head_name, head, x, y, LOSSES[loss])
    value, full = head_curvature(net, head, x, y, LOSSES[loss], "full")
    _, diag = head_curvature(net, head, x, y, LOSSES[loss], "diag")
    torch.testing.assert_close(full, dense, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(diag, dense.diagonal(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(value, LOSSES[loss].value(net(x), y))


@pytest.mark.parametrize("loss", ["ce", "bce"])
@pytest.mark.parametrize("name", sorted(set(NETS) - {"linear-tokens"}))
def test_kron_factors_are_the_kfac_expectation(name, loss):
    """Against lsn_ext.kron's KFAC-expand with the exact expectation over the draws (one
    backward pass per logit), run on the head alone with its captured input."""
    net, x, _ = build_net(name)
    x = x[
        (slice(0, 1), slice(None), *[slice(0, 4 - x.dim() // 5)] * (x.dim() - 2))
    ]  # one backward per logit
    _, head = head_of(net, x)
    y = targets(net(x), loss)
    inputs = capture_head(net, head, x).inputs
    reference = kron_curvature(
        head, inputs, y, LOSSES[loss], N=7, mode="expand", mc_samples="exact"
    ).kron
    _, kron = head_curvature(net, head, x, y, LOSSES[loss], "kron", N=7)
    assert len(kron.kfacs) == len(reference.kfacs)
    for ours, theirs in zip(kron.kfacs, reference.kfacs, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_kron_of_a_1x1_head_is_exact_for_one_pixel():
    """One position, one sample: G ⊗ A and G are the GGN's weight and bias blocks exactly
    (laplace-torch's Kron drops the weight-bias cross terms)."""
    net = nn.Sequential(*_trunk(), nn.Conv2d(4, 2, 1)).eval()
    x = torch.randn(1, 2, 1, 1)
    y = torch.ones(1, 2, 1, 1)
    _, full = head_curvature(net, net[2], x, y, LOSSES["bce"], "full")
    _, kron = head_curvature(net, net[2], x, y, LOSSES["bce"], "kron", N=1)
    block_diagonal = full.clone()
    block_diagonal[:8, 8:] = block_diagonal[8:, :8] = 0
    torch.testing.assert_close(kron.to_matrix(), block_diagonal, rtol=1e-12, atol=1e-14)
