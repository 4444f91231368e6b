"""Last-layer Laplace: the closed-form per-pixel predictive and laplace-torch's API.

References: dense ``diag(J Σ Jᵀ)`` blocks from ``torch.func.jacfwd`` and laplace-torch's dense
posterior covariances (``to_matrix`` for Kron), Monte Carlo over head weights set into the
network with ``functional_call``, and laplace-torch + curvlinops' exact last-layer GGN.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext.laplace_ext import (
    DiagBackprop,
    DiagLastLayerLaplace,
    FullLastLayerLaplace,
    KronLastLayerLaplace,
    head_logit_moments,
    predict,
)
from lsn_ext.laplace_ext.head_curvature import head_curvature
from lsn_ext.rules.losses import CrossEntropy
from tests.laplace_ext.test_last_layer import (
    NETS,
    build_net,
    dense_ggn,
    dense_jacobian,
    targets,
)
from tests.model_state import assert_unchanged, snapshot

STRUCTURES = {
    "full": FullLastLayerLaplace,
    "kron": KronLastLayerLaplace,
    "diag": DiagLastLayerLaplace,
}


def _fitted(name, structure, loss="ce", prior=0.5, **kwargs):
    net, x, _ = build_net(name)
    y = targets(net(x), loss)
    la = STRUCTURES[structure](
        net, "classification", prior_precision=prior, backend_kwargs={"loss": loss}, **kwargs
    )
    la.fit(DataLoader(TensorDataset(x, y), batch_size=1))
    return la, net, x, y


def _dense_covariance(la):
    if isinstance(la, KronLastLayerLaplace):
        return la.posterior_precision.to_matrix(exponent=-1)
    if isinstance(la, DiagLastLayerLaplace):
        return torch.diag(la.posterior_variance)
    return la.posterior_covariance


def network_logits(la, net, x, draws):
    """``net(x)`` with the head's parameters set to each draw ``[S, P]``: ``[S, N, C, *]``."""
    name = la.model._last_layer_name
    shapes = [(n, p.shape) for n, p in net.get_submodule(name).named_parameters()]

    def logits(theta):
        params, start = {}, 0
        for n, shape in shapes:
            params[f"{name}.{n}"] = theta[start : start + math.prod(shape)].reshape(shape)
            start += math.prod(shape)
        return functional_call(net, params, (x,))

    return torch.vmap(logits)(draws)


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
@pytest.mark.parametrize("name", sorted(NETS))
def test_predictive_covariance_is_dense_j_sigma_jt(name, structure):
    la, net, x, _ = _fitted(name, structure, **({"damping": True} if structure == "kron" else {}))
    head_name = la.model._last_layer_name
    head = net.get_submodule(head_name)
    J = dense_jacobian(net, head_name, head, x)  # [N·C·P, params]
    f = net(x)
    N, C, P = f.shape[0], f.shape[1], f[0, 0].numel()
    cov = (J @ _dense_covariance(la) @ J.T).reshape(N, C, P, N, C, P)
    n, p = torch.arange(N), torch.arange(cov.shape[2])
    per_position = cov[n[:, None], :, p[None, :], n[:, None], :, p[None, :]]  # [N, P, C, C]
    expected = per_position.permute(0, 2, 3, 1).reshape(N, C, C, *f.shape[2:])
    mean, covariance = head_logit_moments(la, x, covariance=True)
    _, variance = head_logit_moments(la, x)
    torch.testing.assert_close(mean, f.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(covariance, expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(variance, expected.diagonal(dim1=1, dim2=2).movedim(-1, 1))


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_predictive_matches_monte_carlo_over_head_weights(structure):
    """Logit mean and covariance from 40000 head draws set into the network (5σ bounds)."""
    la, net, x, _ = _fitted("conv2d-3x3-reflect-stride2", structure, prior=2.0)
    draws = la.sample(40000, generator=torch.Generator().manual_seed(3))
    samples = network_logits(la, net, x, draws)
    mean, variance = head_logit_moments(la, x)
    sd = variance.sqrt()
    assert ((samples.mean(0) - mean).abs() <= 5 * sd / math.sqrt(len(draws))).all()
    ratio = samples.var(0) / variance
    assert ((ratio - 1).abs() <= 5 * math.sqrt(2 / len(draws))).all()


def test_glm_and_nn_predictives_use_the_closed_form_and_agree():
    la, _, x, _ = _fitted("conv2d-1x1", "full")
    gen = torch.Generator().manual_seed(0)
    glm = predict(la, x, 4, pred_type="glm", link_approx="probit", generator=gen)
    _, variance = head_logit_moments(la, x)
    assert torch.equal(glm.logit_variance, variance)  # exact, not the 2 draws' estimate
    kappa = torch.rsqrt(1 + math.pi / 8 * variance)
    torch.testing.assert_close(glm.mean, torch.softmax(kappa * glm.logit_mean, 1))
    nn_maps = predict(la, x, 20, pred_type="nn", generator=torch.Generator().manual_seed(1))
    draws = la.sample(20, generator=torch.Generator().manual_seed(1))
    reference = network_logits(la, la.model.model, x, draws)  # the same draws, whole network
    torch.testing.assert_close(nn_maps.logit_mean, reference.mean(0))
    torch.testing.assert_close(nn_maps.mean, torch.softmax(reference, 2).mean(0))
    bridge = predict(la, x, 2, pred_type="glm", link_approx="bridge")
    torch.testing.assert_close(bridge.mean.sum(1), torch.ones_like(bridge.mean[:, 0]))
    with pytest.raises(ValueError, match="window= is not supported for last-layer"):
        predict(la, x, 2, window=(4, 4))


# -- laplace-torch's API ----------------------------------------------------------------------
@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_fit_marglik_sample_and_state_dict_round_trip(structure):
    net, x, _ = build_net("convtranspose2d-stride2")
    y = targets(net(x), "ce")
    loader = DataLoader(TensorDataset(x, y), batch_size=1)
    before = snapshot(net)
    la = STRUCTURES[structure](net, "classification")
    assert la._backend_cls is DiagBackprop
    la.fit(loader)
    assert_unchanged(net, before)
    dense = dense_ggn(net, "2", net[2], x, y, CrossEntropy())
    if structure == "full":
        torch.testing.assert_close(la.H, dense)
    elif structure == "diag":
        torch.testing.assert_close(la.H, dense.diagonal())
    else:  # the sum over batches of each batch's factors (laplace-torch's KronLaplace.fit)
        batches = [head_curvature(net, net[2], xb, yb, CrossEntropy(), "kron", N=2)[1]
                   for xb, yb in loader]  # fmt: skip
        torch.testing.assert_close(la.H_facs.to_matrix(), sum(batches[1:], batches[0]).to_matrix())
    start = la.log_marginal_likelihood().item()
    la.optimize_prior_precision(method="marglik", n_steps=50, lr=0.1)
    assert la.log_marginal_likelihood().item() > start
    assert la.n_outputs == 3
    samples = la.sample(3, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (3, la.n_params)
    again = STRUCTURES[structure](net, "classification")
    again.load_state_dict(la.state_dict())
    torch.testing.assert_close(again.log_marginal_likelihood(), la.log_marginal_likelihood())
    torch.testing.assert_close(again.log_det_posterior_precision, la.log_det_posterior_precision)
    torch.testing.assert_close(again.sample(3, generator=torch.Generator().manual_seed(0)), samples)
    torch.testing.assert_close(again(x), la(x))


@pytest.mark.parametrize(
    ("pred_type", "link_approx"), [("glm", "probit"), ("glm", "mc"), ("nn", "mc")]
)
def test_la_of_x_is_per_pixel_over_dim_1(pred_type, link_approx):
    la, net, x, _ = _fitted("conv2d-1x1", "kron")
    p = la(x, pred_type=pred_type, link_approx=link_approx, n_samples=20)
    assert p.shape == net(x).shape == (2, 3, 5, 6)
    torch.testing.assert_close(p.sum(1), torch.ones(2, 5, 6))
    assert (p.sum(-1) - 1).abs().max() > 0.1  # not normalised over the width
    samples = la.predictive_samples(x, pred_type=pred_type, n_samples=7)
    assert samples.shape == (7, 2, 3, 5, 6)
    torch.testing.assert_close(samples.sum(2), torch.ones(7, 2, 5, 6))
    assert la.functional_samples(x, n_samples=2).shape == (2, 2, 3, 5, 6)


def test_binary_and_regression_heads():
    la, net, x, y = _fitted("conv3d-3x3x3-nobias", "full", loss="bce")
    p = la(x)
    assert p.shape == net(x).shape
    assert bool(((p > 0) & (p < 1)).all())
    net, x, _ = build_net("conv2d-1x1")
    y = targets(net(x), "mse")
    la = FullLastLayerLaplace(net, "regression", sigma_noise=0.5)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=2))
    assert la.n_outputs == 3 * 5 * 6  # every output of a sample, not the width
    manual = -la.loss / 0.25 - x.shape[0] * 90 * math.log(0.5 * math.sqrt(2 * math.pi))
    torch.testing.assert_close(la.log_likelihood, manual)
    mean, variance = la(x)
    torch.testing.assert_close(variance, head_logit_moments(la, x)[1])
    torch.testing.assert_close(mean, net(x).detach())


def test_gridsearch_goes_per_pixel():
    la, _, x, y = _fitted("conv2d-1x1", "diag")
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    la.optimize_prior_precision(
        method="gridsearch", val_loader=loader, grid_size=3, n_samples=4, link_approx="mc"
    )
    assert float(la.prior_precision) in (1e-4, 1.0, 1e4)
    with pytest.raises(ValueError, match="custom loss is not supported"):
        la.optimize_prior_precision(method="gridsearch", val_loader=loader, loss=lambda p: p)


def test_laplace_torch_linear_last_layer_classes_with_diag_backprop_match_curvlinops():
    """laplace-torch's own FullLLLaplace: DiagBackprop's last-layer GGN is curvlinops' exact one."""
    from laplace import Laplace
    from laplace.curvature import CurvlinopsGGN

    net, x, _ = build_net("linear-classifier")
    y = torch.randint(0, 3, (x.shape[0],))
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    ours = Laplace(net, "classification", "last_layer", "full", backend=DiagBackprop)
    theirs = Laplace(net, "classification", "last_layer", "full", backend=CurvlinopsGGN)
    ours.fit(loader)
    theirs.fit(loader)
    assert type(ours).__name__ == "FullLLLaplace"
    torch.testing.assert_close(ours.H, theirs.H, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.loss, theirs.loss)
