"""Curvatures of the SSN's own likelihood w.r.t. the mean logits (lsn_ext.rules.ssn_likelihood).

Every curvature is checked against autograd Hessians of the loss it belongs to, the quadrature
against adaptive quadrature, and ``fit_lsn(curvature=...)`` against a dense ``Jᵀ H J``.
"""

import math

import numpy as np
import pytest
import torch
from scipy.integrate import quad
from scipy.special import expit
from torch import nn
from torch.func import functional_call, hessian, jacrev
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import BCEWithLogits, ExpectedBCE, LogsumexpBCE
from lsn_ext.lsn import CURVATURES, fit_lsn
from lsn_ext.models import SSN, ssn_loss
from lsn_ext.models.ssn import SSNOutput
from lsn_ext.rules.ssn_likelihood import marginal_variance
from tests.model_state import assert_unchanged, snapshot

POS_WEIGHTS = [pytest.param(None, id="plain"), pytest.param(3.0, id="pos_weight=3")]


def _output(N=2, H=3, W=3, rank=2, scale=1.0, seed=0) -> SSNOutput:
    g = torch.Generator().manual_seed(seed)
    mean = 2 * torch.randn(N, 1, H, W, generator=g)
    cov_diag = scale * torch.rand(N, 1, H, W, generator=g) + 1e-3 * scale
    factor = scale**0.5 * torch.randn(N, H * W, rank, generator=g)
    return SSNOutput(mean, cov_diag, factor)


def _mask(N=2, H=3, W=3, seed=1) -> torch.Tensor:
    return (torch.rand(N, 1, H, W, generator=torch.Generator().manual_seed(seed)) > 0.5).double()


def _hessian(fn, mu: torch.Tensor) -> torch.Tensor:
    """The dense autograd Hessian of a scalar function of ``mu``, ``[numel, numel]``."""
    return hessian(fn)(mu.detach()).reshape(mu.numel(), mu.numel())


# -- "logsumexp": the SSN loss of LSN Eq. 11 with fixed draws ---------------------------------


@pytest.mark.parametrize("pos_weight", POS_WEIGHTS)
def test_logsumexp_exact_diagonal_is_the_autograd_hessian_diagonal(pos_weight):
    out, y = _output(), _mask()
    loss = LogsumexpBCE(pos_weight, n_samples=6)
    targets = loss.targets(out, y, generator=torch.Generator().manual_seed(2))
    dense = _hessian(lambda m: loss.value(m, targets), out.mean)
    exact = loss.exact_hessian_diag(out.mean, targets)
    torch.testing.assert_close(exact.flatten(), dense.diagonal(), rtol=1e-10, atol=1e-12)
    # The PSD part minus diag Cov_w(g) is the exact diagonal, and the difference matters here.
    psd = loss.hessian_diag(out.mean, targets)
    assert float((psd - exact).min()) >= 0  # diag Cov_w(g) ≥ 0
    assert float((psd - exact).max()) > 1e-2
    # Off the diagonal the Hessian is −Cov_w(g): dense across the pixels of an image, zero
    # between images.
    off = dense - torch.diag(dense.diagonal())
    D = out.mean[0].numel()
    assert float(off[:D, :D].abs().max()) > 1e-3
    assert float(off[:D, D:].abs().max()) == 0.0


@pytest.mark.parametrize("pos_weight", POS_WEIGHTS)
def test_logsumexp_psd_part_is_the_hessian_with_the_weights_held_fixed(pos_weight):
    out, y = _output(seed=3), _mask(seed=4)
    loss = LogsumexpBCE(pos_weight, n_samples=4)
    targets = loss.targets(out, y, generator=torch.Generator().manual_seed(5))
    bce = BCEWithLogits(pos_weight=pos_weight, reduction="sum")
    eta = out.mean + targets[:, 1:]
    log_lik = torch.stack(
        [
            torch.stack([-bce.value(eta[n, m : m + 1][None], y[n][None]) for m in range(4)])
            for n in range(2)
        ]
    )
    w = torch.softmax(log_lik, 1).detach()

    def fixed_weights(mu):
        nll = [
            w[n, m] * bce.value((mu + targets[:, 1:])[n, m : m + 1][None], y[n][None])
            for n in range(2)
            for m in range(4)
        ]
        return sum(nll)

    dense = _hessian(fixed_weights, out.mean)
    torch.testing.assert_close(dense, torch.diag(dense.diagonal()))
    torch.testing.assert_close(
        loss.hessian_diag(out.mean, targets).flatten(), dense.diagonal(), rtol=1e-10, atol=1e-14
    )
    assert float(loss.hessian_diag(out.mean, targets).min()) >= 0


@pytest.mark.parametrize("pos_weight", [pytest.param(1.0, id="plain"), pytest.param(3.0, id="pw3")])
def test_logsumexp_value_is_ssn_loss_with_the_same_draws(pos_weight):
    out, y = _output(seed=6), _mask(seed=7)
    loss = LogsumexpBCE(pos_weight, n_samples=8)
    targets = loss.targets(out, y, generator=torch.Generator().manual_seed(8))
    expected = ssn_loss(
        out,
        y,
        8,
        pos_weight=pos_weight,
        reduction="sum",
        generator=torch.Generator().manual_seed(8),
    )
    torch.testing.assert_close(loss.value(out.mean, targets), expected, rtol=1e-12, atol=1e-12)


def test_logsumexp_draws_have_the_ssn_covariance():
    out = _output(N=1, H=2, W=2, rank=2)
    loss = LogsumexpBCE(n_samples=20000)
    noise = loss.targets(out, _mask(N=1, H=2, W=2), generator=torch.Generator().manual_seed(9))
    eps = noise[0, 1:].flatten(1)  # [M, D]
    assert float(eps.mean(0).abs().max()) < 1e-12  # antithetic pairs
    cov = eps.T @ eps / eps.shape[0]
    torch.testing.assert_close(cov, out.covariance()[0], rtol=0.05, atol=0.05)


# -- "expected": the per-pixel expected NLL -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("pos_weight", POS_WEIGHTS)
def test_expected_curvature_is_the_autograd_hessian_of_the_expected_nll(pos_weight):
    mu = torch.tensor([0.0, 3.0, -8.0, 2.0, 0.5, -1.0, 0.0, 45.0, -30.0]).reshape(1, 1, 3, 3)
    v = torch.tensor([0.0, 0.5, 4.0, 100.0, 1.0, 1e3, 0.99, 20.0, 40.0]).reshape(1, 1, 3, 3)
    y = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.3, 1.0, 1.0, 0.0, 1.0]).reshape(1, 1, 3, 3)
    loss = ExpectedBCE(pos_weight)
    targets = torch.cat([y, v], 1)
    dense = _hessian(lambda m: loss.value(m, targets), mu)
    torch.testing.assert_close(dense, torch.diag(dense.diagonal()), rtol=0, atol=1e-14)
    torch.testing.assert_close(
        loss.hessian_diag(mu, targets).flatten(), dense.diagonal(), rtol=1e-9, atol=1e-14
    )


@pytest.mark.parametrize(
    ("mu", "v"),
    [
        pytest.param(0.0, 0.3, id="narrow"),
        pytest.param(3.0, 1.0, id="v=1"),
        pytest.param(-8.0, 4.0, id="wide-tail"),
        pytest.param(2.0, 100.0, id="v=100"),
        pytest.param(-20.0, 1e4, id="v=1e4"),
    ],
)
def test_expected_quadrature_against_adaptive_quadrature(mu, v):
    s = math.sqrt(v)

    def density(e):
        return np.exp(-((e - mu) ** 2) / (2 * v)) / math.sqrt(2 * math.pi * v)

    lo, hi = min(mu - 40 * s, 0.0) - 50, max(mu + 40 * s, 0.0) + 50
    opts = {"points": sorted({mu, 0.0}), "limit": 2000, "epsabs": 0, "epsrel": 1e-13}
    curv = quad(lambda e: expit(e) * expit(-e) * density(e), lo, hi, **opts)[0]
    nll = quad(lambda e: np.logaddexp(0, e) * density(e), lo, hi, **opts)[0]
    targets = torch.tensor([0.0, v]).reshape(1, 2, 1, 1)
    f = torch.tensor(mu).reshape(1, 1, 1, 1)
    loss = ExpectedBCE()
    assert abs(loss.hessian_diag(f, targets).item() - curv) <= 1e-12 * curv
    assert abs(loss.value(f, targets).item() - nll) <= 1e-12 * nll


def test_expected_curvature_against_many_fixed_draws():
    out, y = _output(N=1, scale=3.0, seed=10), _mask(N=1, seed=11)
    M = 20000
    eps = LogsumexpBCE(n_samples=M).targets(out, y, generator=torch.Generator().manual_seed(12))
    eps = eps[:, 1:]
    bce = BCEWithLogits(pos_weight=2.0)

    def mc_expected_nll(mu):
        return bce.value(mu + eps, y.expand_as(eps)) / M

    dense = _hessian(mc_expected_nll, out.mean)
    p = torch.sigmoid(out.mean + eps)
    per_draw = (2 * y + 1 - y) * p * (1 - p)
    stderr = per_draw.std(1) / math.sqrt(M)
    loss = ExpectedBCE(pos_weight=2.0)
    got = loss.hessian_diag(out.mean, loss.targets(out, y))
    assert float(((got - dense.diagonal().reshape_as(got)).abs() / stderr).max()) < 5


# -- zero covariance: every curvature is the BCE one at μ -------------------------------------


@pytest.mark.parametrize("pos_weight", POS_WEIGHTS)
def test_zero_covariance_gives_the_bce_curvature_at_the_mean(pos_weight):
    out, y = _output(scale=0.0), _mask()
    out = SSNOutput(out.mean, torch.zeros_like(out.cov_diag), out.cov_factor)
    bce = BCEWithLogits(pos_weight=pos_weight)
    h = bce.hessian_diag(out.mean, y)
    expected, logsumexp = ExpectedBCE(pos_weight), LogsumexpBCE(pos_weight, n_samples=4)
    t_e, t_l = expected.targets(out, y), logsumexp.targets(out, y)
    for got in (
        expected.hessian_diag(out.mean, t_e),
        logsumexp.hessian_diag(out.mean, t_l),
        logsumexp.exact_hessian_diag(out.mean, t_l),
    ):
        torch.testing.assert_close(got, h, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(expected.value(out.mean, t_e), bce.value(out.mean, y))
    torch.testing.assert_close(logsumexp.value(out.mean, t_l), bce.value(out.mean, y))


def test_marginal_variance_is_the_covariance_diagonal():
    out = _output(rank=3)
    dense = out.covariance().diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(marginal_variance(out).flatten(1), dense)


# -- fit_lsn(curvature=...) against a dense Jᵀ H J ----------------------------------------------


def _ssn(backbone: str, zero_covariance: bool = False) -> SSN:
    torch.manual_seed(0)
    if backbone == "identity":  # the mean network is one 1×1 convolution: DB is exact
        ssn = SSN(nn.Identity(), 2, rank=2, eps=1e-4)
    else:
        # Two spatial layers: DB drops cross-pixel terms, so it is not exact.
        backbone = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 3, 3, padding=1), nn.Tanh()
        )
        ssn = SSN(backbone, 3, rank=2, eps=1e-4)
    with torch.no_grad():
        ssn.log_diag_head.bias.add_(0.5)
        if zero_covariance:
            ssn.eps = 0.0
            ssn.log_diag_head.bias.fill_(-200.0)
            ssn.factor_head.weight.zero_()
            ssn.factor_head.bias.zero_()
    return ssn


def _data(N=3):
    g = torch.Generator().manual_seed(13)
    return torch.randn(N, 2, 3, 3, generator=g), (
        torch.rand(N, 1, 3, 3, generator=g) > 0.5
    ).double()


def _dense_reference(ssn: SSN, loss, x, targets) -> torch.Tensor:
    """``Σ_n diag(J_nᵀ diag(h_n) J_n)`` with the loss's Hessian diagonal ``h``, as a vector."""
    from lsn_ext.lsn import MeanNetwork

    net = MeanNetwork(ssn)
    params = {n: p.detach() for n, p in net.named_parameters()}
    f = functional_call(net, params, (x,)).detach()
    h = loss.hessian_diag(f, targets).flatten()
    jac = jacrev(lambda p: functional_call(net, p, (x,)))(params)
    return torch.cat([(jac[n].reshape(f.numel(), -1).square() * h[:, None]).sum(0) for n in params])


def _targets(ssn: SSN, curvature, x, y, n_samples=None, seed=0, pos_weight=1.0, batch=2):
    """The loss and the targets fit_lsn packs (same generator, same batches, concatenated)."""
    if curvature == "ce":
        return BCEWithLogits(pos_weight=pos_weight), y
    if curvature == "expected":
        loss = ExpectedBCE(pos_weight)

        def pack(out, y, _):
            return ExpectedBCE.targets(out, y)
    else:
        loss = LogsumexpBCE(pos_weight, n_samples=n_samples)

        def pack(out, y, i):
            g = torch.Generator().manual_seed(hash((seed, 0, i)) & (2**63 - 1))
            return loss.targets(out, y, generator=g)

    with torch.no_grad():
        parts = [
            pack(ssn.distribution(x[i : i + batch]), y[i : i + batch], i // batch)
            for i in range(0, len(x), batch)
        ]
    return loss, torch.cat(parts)


@pytest.mark.parametrize("pos_weight", [pytest.param(1.0, id="plain"), pytest.param(3.0, id="pw3")])
@pytest.mark.parametrize("curvature", CURVATURES)
def test_fit_lsn_db_equals_the_dense_ggn_where_db_is_exact(curvature, pos_weight):
    ssn = _ssn("identity")
    x, y = _data()
    n_samples = 4 if curvature == "logsumexp" else None
    la = fit_lsn(
        ssn,
        DataLoader(TensorDataset(x, y), batch_size=2),
        estimator="db",
        curvature=curvature,
        n_samples=n_samples,
        pos_weight=pos_weight,
    )
    loss, targets = _targets(ssn, curvature, x, y, n_samples, pos_weight=pos_weight)
    torch.testing.assert_close(la.H, _dense_reference(ssn, loss, x, targets), rtol=1e-10, atol=0)
    torch.testing.assert_close(la.loss, loss.value(ssn(x).detach(), targets))


@pytest.mark.parametrize("curvature", ["expected", "logsumexp"])
def test_fit_lsn_mc_agrees_with_the_dense_ggn_in_expectation(curvature):
    # One logit per image (1×1 images): the Rademacher estimate has no variance, so MC must
    # equal its expectation, the dense diagonal, exactly; DB drops the cross-channel terms
    # between the two convolutions and does not.
    ssn = _ssn("conv-tanh")
    x, y = _data(N=3)
    x, y = x[..., 1:2, 1:2], y[..., 1:2, 1:2]
    n_samples = 4 if curvature == "logsumexp" else None
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    fits = {
        estimator: fit_lsn(
            ssn,
            loader,
            estimator=estimator,
            mc_samples=mc,
            curvature=curvature,
            n_samples=n_samples,
        ).H
        for estimator, mc in (("mc", 2), ("db", 1))
    }
    loss, targets = _targets(ssn, curvature, x, y, n_samples)
    dense = _dense_reference(ssn, loss, x, targets)
    torch.testing.assert_close(fits["mc"], dense, rtol=1e-10, atol=1e-15)
    backbone = sum(p.numel() for p in ssn.backbone.parameters())
    off = (fits["db"] - dense)[:backbone].norm() / dense[:backbone].norm()
    assert float(off) > 0.03


@pytest.mark.parametrize("curvature", ["expected", "logsumexp"])
def test_fit_lsn_with_zero_covariance_is_the_ce_fit(curvature):
    ssn = _ssn("conv-tanh", zero_covariance=True)
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    ce = fit_lsn(ssn, loader, estimator="db")
    other = fit_lsn(
        ssn,
        loader,
        estimator="db",
        curvature=curvature,
        n_samples=4 if curvature == "logsumexp" else None,
    )
    torch.testing.assert_close(other.H, ce.H, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(other.loss, ce.loss)


def test_fit_lsn_noisy_curvatures_differ_from_ce():
    ssn = _ssn("conv-tanh")
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=3)
    ce = fit_lsn(ssn, loader, estimator="db").H
    for curvature in ("expected", "logsumexp"):
        H = fit_lsn(ssn, loader, estimator="db", curvature=curvature).H
        assert float((H - ce).norm() / ce.norm()) > 0.01


@pytest.mark.parametrize("curvature", CURVATURES)
@pytest.mark.parametrize("estimator", ["db", "mc"])
def test_fit_lsn_leaves_the_ssn_unchanged_and_refits_reproduce(curvature, estimator):
    ssn = _ssn("conv-tanh").train()
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    snap = snapshot(ssn)
    kwargs = {"estimator": estimator, "curvature": curvature}
    if curvature == "logsumexp":
        kwargs["n_samples"] = 4
    first = fit_lsn(ssn, loader, **kwargs)
    assert_unchanged(ssn, snap)
    torch.testing.assert_close(fit_lsn(ssn, loader, **kwargs).H, first.H, rtol=0, atol=0)


# -- bad inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(
            {"curvature": "fisher"}, r"unknown curvature 'fisher'.*'ce', 'expected'", id="unknown"
        ),
        pytest.param(
            {"curvature": "expected", "n_samples": 4},
            "draws no logit noise",
            id="n_samples-expected",
        ),
        pytest.param({"n_samples": 4}, "draws no logit noise", id="n_samples-ce"),
        pytest.param({"curvature": "logsumexp", "n_samples": 3}, "even", id="odd-n_samples"),
        pytest.param(
            {"curvature": "logsumexp", "n_samples": 0}, "positive int", id="zero-n_samples"
        ),
    ],
)
def test_fit_lsn_refuses_bad_curvature_options(kwargs, match):
    ssn = _ssn("identity")
    x, y = _data()
    with pytest.raises(ValueError, match=match):
        fit_lsn(ssn, DataLoader(TensorDataset(x, y), batch_size=3), **kwargs)


@pytest.mark.parametrize("curvature", ["expected", "logsumexp"])
def test_fit_lsn_refuses_noisy_curvatures_for_multiclass_ssns(curvature):
    ssn = SSN(nn.Identity(), 2, num_classes=3, rank=1)
    x = torch.randn(2, 2, 3, 3)
    y = torch.randint(0, 3, (2, 3, 3))
    with pytest.raises(ValueError, match=r"binary SSNs.*curvature='ce'"):
        fit_lsn(ssn, DataLoader(TensorDataset(x, y), batch_size=2), curvature=curvature)


def _bad(targets_fn, logits_shape=(2, 1, 3, 3)):
    return lambda loss: loss.hessian_diag(torch.zeros(logits_shape), targets_fn())


@pytest.mark.parametrize(
    ("loss", "call", "error", "match"),
    [
        pytest.param(
            ExpectedBCE(),
            _bad(lambda: torch.zeros(2, 1, 3, 3)),
            ValueError,
            r"\(2, 2, 3, 3\)",
            id="expected-no-variance",
        ),
        pytest.param(
            ExpectedBCE(),
            _bad(lambda: torch.cat([torch.zeros(2, 1, 3, 3), -torch.ones(2, 1, 3, 3)], 1)),
            ValueError,
            ">= 0",
            id="negative-variance",
        ),
        pytest.param(
            ExpectedBCE(),
            _bad(lambda: torch.cat([2 * torch.ones(2, 1, 3, 3), torch.ones(2, 1, 3, 3)], 1)),
            ValueError,
            r"\[0, 1\]",
            id="mask-outside",
        ),
        pytest.param(
            ExpectedBCE(),
            _bad(lambda: torch.zeros(2, 2, 3, 3), (2, 2, 3, 3)),
            ValueError,
            r"\[N, 1, \*\]",
            id="two-channels",
        ),
        pytest.param(
            LogsumexpBCE(n_samples=4),
            _bad(lambda: torch.zeros(2, 3, 3, 3)),
            ValueError,
            r"\(2, 5, 3, 3\)",
            id="logsumexp-wrong-M",
        ),
        pytest.param(
            LogsumexpBCE(n_samples=2),
            _bad(lambda: torch.full((2, 3, 3, 3), float("nan"))),
            ValueError,
            r"\[0, 1\]",
            id="nan-mask",
        ),
        pytest.param(
            ExpectedBCE(),
            lambda loss: loss.targets(_output(), torch.zeros(2, 4, 4)),
            ValueError,
            "do not match",
            id="mask-shape",
        ),
        pytest.param(
            ExpectedBCE(),
            lambda loss: loss.targets(torch.zeros(2, 1, 3, 3), _mask()),
            TypeError,
            "SSNOutput",
            id="not-an-output",
        ),
    ],
)
def test_losses_refuse_bad_targets(loss, call, error, match):
    with pytest.raises(error, match=match):
        call(loss)


def test_logsumexp_refuses_bad_sample_counts():
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="n_samples"):
            LogsumexpBCE(n_samples=bad)
    assert LogsumexpBCE(n_samples=3, antithetic=False).n_samples == 3
