"""``bridge_predictive``: the Laplace Bridge of a laplace-torch posterior, per input or pixel.

Against laplace-torch's own ``link_approx="bridge"`` for ``[N, K]`` classifiers, and against
:func:`lsn_ext.laplace_bridge` of the logit moments (linearised or sampled) for segmentation.
"""

import math

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext.bridge import laplace_bridge
from lsn_ext.forward import linearized_variance
from lsn_ext.laplace_ext.predictive import bridge_predictive

TOL = {"rtol": 1e-11, "atol": 1e-13}


def fitted_classifier(K: int = 4, backend=lsn_ext.DiagBackprop):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, K))
    x, y = torch.randn(32, 3), torch.randint(0, K, (32,))
    la = Laplace(
        net, "classification", subset_of_weights="all", hessian_structure="diag", backend=backend
    )
    la.fit(DataLoader(TensorDataset(x, y), batch_size=16))
    la.prior_precision = 0.5
    return la, torch.randn(6, 3)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    ("norm", "link"), [(None, "bridge"), ("mean", "bridge_norm")], ids=["plain", "norm-mean"]
)
def test_mean_agrees_with_laplace_torch_bridge(norm, link):
    la, x = fitted_classifier()
    ours = bridge_predictive(la, x, norm=norm).probs
    theirs = la(x, link_approx=link)
    assert not torch.allclose(ours, torch.softmax(la.model(x), -1), atol=1e-3)  # non-trivial
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


def segmentation_la(loss: str = "ce", C: int = 3, layers: int = 2):
    torch.manual_seed(2)
    mods = [nn.Conv2d(1, C, 3, padding=1)]
    if layers == 2:
        mods = [nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, C, 1)]
    net = nn.Sequential(*mods)
    x = torch.randn(4, 1, 6, 6)
    y = torch.randint(0, C, (4, 6, 6)) if loss == "ce" else (torch.rand(4, 1, 6, 6) > 0.5).double()
    la = Laplace(
        net,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
        backend_kwargs={"loss": loss},
    )
    la.fit(DataLoader(TensorDataset(x, y), batch_size=2))
    return la, x


def test_segmentation_glue_uses_linearized_variance():
    la, x = segmentation_la()
    d = bridge_predictive(la, x)
    f_mu, f_var = linearized_variance(la.model, x, la.posterior_variance)
    torch.testing.assert_close(d.alpha, laplace_bridge(f_mu, f_var).alpha, **TOL)
    assert d.probs.shape == (4, 3, 6, 6)
    torch.testing.assert_close(d.probs.sum(1), torch.ones(4, 6, 6), **TOL)
    assert d.topk().count.shape == (4, 6, 6)


def test_segmentation_mc_variance_matches_linearized_for_a_linear_model():
    la, x = segmentation_la(layers=1)  # logits linear in the parameters: both are exact
    d = bridge_predictive(
        la, x, variance="mc", n_samples=200, generator=torch.Generator().manual_seed(0)
    )
    moments = lsn_ext.predict(la, x, 200, generator=torch.Generator().manual_seed(0))
    f_mu, f_var = moments.logit_mean, moments.logit_variance
    torch.testing.assert_close(d.alpha, laplace_bridge(f_mu, f_var).alpha, **TOL)
    lin_mu, lin_var = linearized_variance(la.model, x, la.posterior_variance)
    torch.testing.assert_close(f_var, lin_var, rtol=0.5, atol=0)  # 200 samples: 10 % s.e.
    assert abs(f_var.mean() / lin_var.mean() - 1) < 0.08
    assert (f_mu - lin_mu).abs().max() < 5 * lin_var.max().sqrt() / math.sqrt(200)


def test_binary_segmentation_uses_two_symmetric_logits():
    la, x = segmentation_la("bce", C=1, layers=1)
    d = bridge_predictive(la, x)
    f, v = linearized_variance(la.model, x, la.posterior_variance)
    ref = laplace_bridge(torch.cat([-f / 2, f / 2], 1), torch.cat([v, v], 1) / 4, project=False)
    torch.testing.assert_close(d.alpha, ref.alpha, **TOL)
    assert d.probs.shape == (4, 2, 6, 6)
    assert torch.equal(d.probs[:, 1] > 0.5, f[:, 0] > 0)  # foreground is class 1


def test_glue_refuses_regression_and_unknown_variance():
    la, x = segmentation_la()
    with pytest.raises(ValueError, match="'linearized' or 'mc'"):
        bridge_predictive(la, x, variance="exact")
    net = nn.Linear(2, 2)
    reg = Laplace(
        net,
        "regression",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
    )
    reg.fit(DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 2)), batch_size=2))
    with pytest.raises(ValueError, match="classification likelihood"):
        bridge_predictive(reg, torch.randn(3, 2))


@pytest.mark.parametrize("call", ["linearized", "mc", "predict"])
@pytest.mark.parametrize("change", ["frozen", "unfrozen"])
def test_a_parameter_frozen_or_unfrozen_after_the_fit_is_named(change, call):
    """The error spoke of a flat ``param_variance`` length, which the caller never passed."""
    la, x = segmentation_la()
    bias = la.model[0].bias
    if change == "unfrozen":  # fitted without the bias, which is trainable again
        bias.requires_grad_(False)
        la = Laplace(
            la.model,
            "classification",
            subset_of_weights="all",
            hessian_structure="diag",
            backend=lsn_ext.DiagBackprop,
        )
        la.fit(DataLoader(TensorDataset(x, torch.randint(0, 3, (4, 6, 6))), batch_size=2))
    bias.requires_grad_(change == "unfrozen")
    what = "requires_grad=False" if change == "frozen" else "requires_grad=True"
    match = rf"parameter '0.bias' has {what} now.*when the posterior was fitted.*requires_grad"
    if call == "predict":
        run = lambda: lsn_ext.predict(la, x, 4)  # noqa: E731
    else:
        run = lambda: bridge_predictive(la, x, variance=call, n_samples=4)  # noqa: E731
    with pytest.raises(ValueError, match=match):
        run()
