""":class:`LowRankGGNLaplace` end to end against dense references: fit, marginal likelihood,
prior optimisation, sampling, the per-pixel GLM predictive, serialisation and the errors.

Dense references (float64): the GGN's eigenpairs by ``torch.linalg.eigh``, the posterior
covariance ``(U Λ Uᵀ + D)⁻¹`` by ``torch.linalg.inv``, its log-determinant by ``torch.logdet``,
the logit variance ``diag(J Σ Jᵀ)`` with ``J`` from ``torch.func.jacrev``.
"""

from __future__ import annotations

import math

import pytest
import torch
from laplace import Laplace
from laplace.baselaplace import LowRankLaplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import DiagBackprop, SelectInput, predict
from lsn_ext.lowrank import LowRankGGNLaplace, lowrank_ggn
from lsn_ext.rules.losses import BCEWithLogits
from tests.lowrank.dense import dense_ggn, dense_precision, jacobian
from tests.lowrank.test_products import Net3d
from tests.networks import classifier, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore:By default `link_approx` is `probit`")


def _data(shape, classes, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=gen)
    if classes == 1:
        y = (torch.rand(n, 1, *shape[1:], generator=gen) > 0.6).double()
    else:
        y = torch.randint(0, classes, (n, *shape[1:]), generator=gen)
    return x, y


SEGMENTATION = {
    "unet-2d-bce": (lambda: tiny_unet(1), (2, 8, 8), 1, "bce"),
    "net-3d-ce": (Net3d, (1, 4, 4, 4), 2, "ce"),
}


def _fitted(name, diagonal="ggn", rank=4, prior=1.0, batch_size=2):
    build, shape, classes, loss = SEGMENTATION[name]
    torch.manual_seed(0)
    model = build().eval()
    x, y = _data(shape, classes)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    la = LowRankGGNLaplace(
        model, "classification", backend=DiagBackprop, backend_kwargs={"loss": loss},
        prior_precision=prior, rank=rank, steps=40, diagonal=diagonal,
    )  # fmt: skip
    la.fit(loader)
    return la, model, loader, x


@pytest.mark.parametrize("name", SEGMENTATION, ids=str)
def test_fit_uses_the_whole_loader_and_the_diagonal_remainder(name):
    la, model, loader, _ = _fitted(name)
    loss = la.backend.loss_fn
    G = dense_ggn(model, loader, loss)
    values, vectors = torch.linalg.eigh(G)
    values, vectors = values.flip(0)[:4], vectors.flip(1)[:, :4]
    U, lam = la.H
    torch.testing.assert_close(lam, values, rtol=1e-9, atol=0)
    torch.testing.assert_close((U * lam) @ U.T, (vectors * values) @ vectors.T)
    assert la.lowrank_result.steps == 40
    assert la.n_data == 4
    torch.testing.assert_close(la.loss, sum(loss.value(model(x), y) for x, y in loader))
    # The remainder: the backend's (Monte-Carlo) GGN diagonal summed over the loader, minus the
    # low rank's diagonal, clamped at zero.
    diag = sum(la.backend.diag(x, y, N=4)[1] for x, y in loader)
    torch.testing.assert_close(
        la.diagonal_remainder, (diag - (U.square() * lam).sum(1)).clamp_min(0)
    )
    first_batch = lowrank_ggn(model, [next(iter(loader))], loss, rank=4, steps=40)
    assert not torch.allclose(first_batch.eigenvalues, lam)


@pytest.mark.parametrize("diagonal", ["ggn", "prior"])
@pytest.mark.parametrize("prior", ["scalar", "per-parameter"])
def test_marginal_likelihood_and_log_det_match_the_dense_posterior(diagonal, prior):
    la, _, _, _ = _fitted("unet-2d-bce", diagonal=diagonal)
    if prior == "per-parameter":
        la.prior_precision = torch.rand(la.n_params, generator=torch.Generator().manual_seed(3))
    P = dense_precision(la)
    P0 = la.prior_precision_diag
    if diagonal == "prior":
        assert la.diagonal_remainder is None
        torch.testing.assert_close(P - torch.diag(P0), (la.H[0] * la.H[1]) @ la.H[0].T)
    torch.testing.assert_close(la.log_det_posterior_precision, torch.logdet(P))
    delta = la.mean - la.prior_mean
    expected = -la.loss - 0.5 * (torch.logdet(P) - P0.log().sum() + (delta * P0) @ delta)
    torch.testing.assert_close(la.log_marginal_likelihood(), expected)
    torch.testing.assert_close(la.posterior_variance, torch.linalg.inv(P).diagonal())


def test_marglik_prior_optimisation_finds_the_dense_optimum():
    la, _, _, _ = _fitted("unet-2d-bce")
    la.optimize_prior_precision(method="marglik", pred_type="glm", n_steps=300, lr=0.1)
    found = float(la.prior_precision)
    grid = torch.logspace(-2, 3, 501)
    values = [float(la.log_marginal_likelihood(torch.tensor([g]))) for g in grid]
    best = float(grid[max(range(len(grid)), key=values.__getitem__)])
    assert math.isclose(found, best, rel_tol=0.03)


def test_samples_have_the_dense_posterior_covariance():
    # A network of 23 parameters, so that 200 000 draws pin the covariance down.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 1, 1)).eval()
    x, y = _data((1, 6, 6), 1, n=3)
    la = LowRankGGNLaplace(
        model, "classification", backend=DiagBackprop, backend_kwargs={"loss": "bce"},
        prior_precision=0.5, rank=3,
    )  # fmt: skip
    la.fit(DataLoader(TensorDataset(x, y), batch_size=3))
    sigma = torch.linalg.inv(dense_precision(la))
    n = 200_000
    draws = la.sample(n, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        draws.mean(0), la.mean, atol=5 * sigma.diagonal().max().sqrt() / n**0.5, rtol=0
    )
    error = (torch.cov(draws.T) - sigma).norm() / sigma.norm()
    assert float(error) < 4 * math.sqrt(23 / n)


@pytest.mark.slow
@pytest.mark.parametrize("name", SEGMENTATION, ids=str)
def test_glm_predictive_variance_matches_dense_diag_j_sigma_jt(name):
    la, model, _, x = _fitted(name, prior=4.0)
    sigma = torch.linalg.inv(dense_precision(la))
    f, J = jacobian(model, x[:1])
    cov = J @ sigma @ J.T  # of the logits, C = J Σ Jᵀ
    expected = cov.diagonal().reshape(f.shape)
    # S = n/2 JVPs u = J δ ~ N(0, C) (was 3000). A pixel's estimate, the mean of u_p² = v·χ²₁,
    # has relative sd √(2/S) = 4.5 %; the sum over the pixels, the mean of uᵀu, has variance
    # 2 tr(C²)/S (0.95 % and 1.2 % of the sum for these two networks). Both within 5 sd.
    n = 2000
    pred = predict(la, x[:1], n, pred_type="glm", generator=torch.Generator().manual_seed(0))
    z = (pred.logit_variance - expected) / (expected * math.sqrt(2 / (n // 2)))
    assert z.abs().max() < 5, float(z.abs().max())
    se_sum = torch.sqrt(2 * cov.square().sum() / (n // 2))
    assert abs(pred.logit_variance.sum() - expected.sum()) < 5 * se_sum
    with torch.no_grad():
        torch.testing.assert_close(pred.logit_mean, model(x[:1]))


def test_nn_predictive_collapses_to_the_map_for_a_sharp_posterior():
    la, model, _, x = _fitted("net-3d-ce")
    la.prior_precision = 1e12
    pred = predict(la, x[:2], n_samples=4, pred_type="nn")
    with torch.no_grad():
        torch.testing.assert_close(pred.mean, torch.softmax(model(x[:2]), 1), rtol=1e-4, atol=1e-6)
    assert pred.variance.max() < 1e-8


def test_laplace_torch_glm_predictive_of_a_classifier_uses_the_low_rank_covariance():
    torch.manual_seed(0)
    model = classifier().eval()
    x, y = torch.randn(6, 2, 5, 5), torch.randint(0, 3, (6,))
    la = LowRankGGNLaplace(model, "classification", backend=DiagBackprop, rank=3)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=3))
    sigma = torch.linalg.inv(dense_precision(la))
    _, J = jacobian(model, x[:2])
    Js = J.reshape(2, 3, -1)
    _, f_var = la._glm_predictive_distribution(x[:2])
    torch.testing.assert_close(f_var, Js @ sigma @ Js.transpose(1, 2))
    probs = la(x[:2], pred_type="glm", link_approx="probit")
    torch.testing.assert_close(probs.sum(1), torch.ones(2))


def test_state_dict_roundtrip_keeps_the_remainder_and_refuses_another_diagonal():
    la, model, _, _ = _fitted("unet-2d-bce")
    state = la.state_dict()
    again = LowRankGGNLaplace(
        model, "classification", backend=DiagBackprop, backend_kwargs={"loss": "bce"}, rank=4
    )
    again.load_state_dict(state)
    torch.testing.assert_close(again.log_marginal_likelihood(), la.log_marginal_likelihood())
    torch.testing.assert_close(again.diagonal_remainder, la.diagonal_remainder)
    other = LowRankGGNLaplace(model, "classification", backend=DiagBackprop, diagonal="prior")
    with pytest.raises(ValueError, match="saved with diagonal='ggn'"):
        other.load_state_dict(state)


def test_dictionary_batches_through_select_input():
    torch.manual_seed(0)
    net = tiny_unet(1).eval()
    x, y = _data((2, 8, 8), 1)
    batches = [{"image": x[i], "label": y[i]} for i in range(4)]
    la = LowRankGGNLaplace(
        SelectInput(net, "image"), "classification", backend=DiagBackprop,
        backend_kwargs={"loss": "bce"}, dict_key_x="image", dict_key_y="label", rank=3, steps=30,
    )  # fmt: skip
    la.fit(DataLoader(batches, batch_size=2))
    G = dense_ggn(net, DataLoader(TensorDataset(x, y), batch_size=2), BCEWithLogits())
    torch.testing.assert_close(la.H[1], torch.linalg.eigvalsh(G).flip(0)[:3], rtol=1e-8, atol=0)


def test_regression_scales_curvature_by_the_noise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(10, 3), torch.randn(10, 2)
    la = LowRankGGNLaplace(model, "regression", backend=DiagBackprop, sigma_noise=0.5, rank=3)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=5))
    (_, lam), d = la.posterior_precision
    torch.testing.assert_close(lam, 4 * la.H[1])
    torch.testing.assert_close(d, la.prior_precision_diag + 4 * la.diagonal_remainder)


def test_errors_are_clear():
    model = tiny_unet(1).eval()
    with pytest.raises(ValueError, match=r"pass backend=lsn_ext\.DiagBackprop"):
        LowRankGGNLaplace(model, "classification")
    with pytest.raises(ValueError, match="got CurvlinopsGGN"):
        LowRankGGNLaplace(model, "classification", backend=CurvlinopsGGN)
    with pytest.raises(ValueError, match=r"diagonal must be one of \('ggn', 'prior'\)"):
        LowRankGGNLaplace(model, "classification", backend=DiagBackprop, diagonal="full")
    with pytest.raises(ValueError, match="rank must be an int"):
        LowRankGGNLaplace(model, "classification", backend=DiagBackprop, rank=0)
    la, _, loader, _ = _fitted("unet-2d-bce")
    with pytest.raises(ValueError, match="cannot be updated"):
        la.fit(loader, override=False)


def test_laplace_torch_factory_keeps_its_own_lowrank_class():
    # laplace-torch's Laplace(..., "lowrank") still builds its LowRankLaplace (which refuses to
    # start without asdfghjkl: upstream's message, before any backend exists).
    model = tiny_unet(1).eval()
    with pytest.raises(ImportError, match="asdfghjkl"):
        Laplace(model, "classification", "all", "lowrank", backend=DiagBackprop)
    assert LowRankGGNLaplace._key != LowRankLaplace._key
    la = Laplace(model, "classification", "all", LowRankGGNLaplace._key[1], backend=DiagBackprop)
    assert type(la) is LowRankGGNLaplace
