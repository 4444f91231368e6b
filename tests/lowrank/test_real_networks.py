"""The low-rank Laplace on networks of ``tests/real_networks.py`` (MONAI, the LSN paper's U-Net).

The GGN of one batch has rank at most its number of outputs ``O``, so its nonzero eigenvalues
are those of the small ``O×O`` matrix ``S J Jᵀ S`` with ``S = H^{½}`` (dense ``J`` from
``torch.func.jacrev``, ``H`` from ``torch.func.hessian``): a dense reference without the
``P×P`` GGN. On the 3-D network (``P = 1911``) the predictive is checked against the dense
``diag(J Σ Jᵀ)``, ``Σ = (U Λ Uᵀ + D)⁻¹`` by ``torch.linalg.inv``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import DiagBackprop, predict
from lsn_ext.lowrank import LowRankGGNLaplace
from tests.lowrank.dense import dense_precision, jacobian, logit_variance
from tests.real_networks import REAL_NETWORKS
from tests.reference import loss_hessian_dense

pytestmark = pytest.mark.filterwarnings("ignore:By default `link_approx` is `probit`")

CASES = [
    "lsn-paper-unet",
    pytest.param("monai-segresnet-2d", marks=pytest.mark.slow),
    pytest.param("monai-unet-3d", marks=pytest.mark.slow),
]


def _fitted(name):
    case = REAL_NETWORKS[name]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    torch.manual_seed(0)
    model = case.build().double().eval()
    x, y = case.batch()
    la = LowRankGGNLaplace(
        model, "classification", backend=DiagBackprop, backend_kwargs={"loss": case.loss},
        rank=3, steps=30, prior_precision=10.0,
    )  # fmt: skip
    la.fit(DataLoader(TensorDataset(x, y), batch_size=len(x)))
    return la, model, x, y


def _top_eigenvalues(la, model, x, y, k):
    f, J = jacobian(model, x)
    H = loss_hessian_dense(lambda logits: la.backend.loss_fn.value(logits, y), f)
    w, V = torch.linalg.eigh(H)
    S = (V * w.clamp_min(0).sqrt()) @ V.T
    A = S @ J
    return torch.linalg.eigvalsh(A @ A.T).flip(0)[:k]


@pytest.mark.parametrize("name", CASES, ids=str)
def test_eigenpairs_marglik_and_predict_on_real_networks(name):
    la, model, x, y = _fitted(name)
    torch.testing.assert_close(la.H[1], _top_eigenvalues(la, model, x, y, 3), rtol=1e-7, atol=0)
    before = la.log_marginal_likelihood().item()
    la.optimize_prior_precision(method="marglik", pred_type="glm", n_steps=50)
    assert la.log_marginal_likelihood().item() >= before
    pred = predict(la, x[:1], n_samples=8, pred_type="glm")
    assert pred.mean.shape[2:] == x.shape[2:]
    assert bool(torch.isfinite(pred.logit_variance).all())


@pytest.mark.slow
def test_glm_predictive_on_a_3d_network_matches_dense():
    la, model, x, _ = _fitted("monai-unet-3d")
    sigma = torch.linalg.inv(dense_precision(la))
    expected = logit_variance(model, x[:1], sigma)
    gen = torch.Generator().manual_seed(0)
    pred = predict(la, x[:1], 2000, pred_type="glm", generator=gen)
    # 1000 JVPs: relative standard error √(2/1000) = 4.5 % per voxel
    torch.testing.assert_close(pred.logit_variance, expected, rtol=0.25, atol=0)
    assert abs(float(pred.logit_variance.sum() / expected.sum()) - 1) < 0.03
