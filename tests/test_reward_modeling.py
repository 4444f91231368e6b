"""laplace-torch's ``likelihood="reward_modeling"`` with DiagBackprop (issue 25).

laplace-torch fits a reward model with the classification likelihood (the backend is built with
``"classification"``: which of a pair ``[N, 2, d]`` is preferred, logits ``[N, 2]``) and predicts
rewards ``[N, 1]`` as a regression. The references are laplace-torch's default backend,
``CurvlinopsGGN`` (the exact GGN diagonal), and its own predictive.
"""

import math

import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import DiagBackprop, gridsearch_prior_precision, predict


class PairReward(nn.Module):
    """Rewards ``[N, 1]`` of items ``[N, d]``; logits ``[N, 2]`` of pairs ``[N, 2, d]``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))

    def forward(self, x):
        if x.dim() == 3:
            return self.net(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], 2)
        return self.net(x)


def _loader():
    g = torch.Generator().manual_seed(3)
    pairs, preferred = torch.randn(12, 2, 3, generator=g), torch.randint(2, (12,), generator=g)
    return DataLoader(TensorDataset(pairs, preferred), batch_size=4)


def _items():
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(5))


def _fit(backend, **backend_kwargs):
    la = Laplace(
        PairReward(),
        "reward_modeling",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=backend,
        backend_kwargs=backend_kwargs,
    )
    la.fit(_loader())
    return la


@pytest.fixture(scope="module")
def fits():
    """laplace-torch's exact fit and DiagBackprop's (2000 Monte-Carlo vectors), once per module.

    The tests only read them (predictions do not change a fitted Laplace). Float64, as
    conftest.py sets for each test (a module fixture is set up before it).
    """
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _fit(CurvlinopsGGN), _fit(DiagBackprop, mc_samples=2000)
    finally:
        torch.set_default_dtype(dtype)


@pytest.mark.slow
def test_fit_matches_the_exact_ggn_diagonal_of_laplace_torch(fits):
    ref, la = fits
    assert la.backend.likelihood == "classification"
    torch.testing.assert_close(la.loss, ref.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(la.H, ref.H, rtol=0.05, atol=1e-8)
    assert abs(float(ref.H[-1])) < 1e-12  # the last bias shifts both rewards of a pair alike


@pytest.mark.slow
def test_predictive_is_a_regression_over_rewards(fits):
    ref, la = fits
    x = _items()
    mean, var = la(x, pred_type="glm")
    ref_mean, ref_var = ref(x, pred_type="glm")
    assert mean.shape == (5, 1)
    assert var.shape == (5, 1, 1)
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(var, ref_var, rtol=0.05, atol=1e-8)
    n = 8000
    maps = predict(la, x, n, pred_type="glm", generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(maps.mean, ref_mean, rtol=0, atol=0.03)
    # The variance of each reward is the mean of (J δ)² over S = n/2 antithetic draws, J δ
    # Gaussian: relative sd √(2/S) = 2.2 %. Against la's own exact GLM variance (itself within
    # 5 % of laplace-torch's exact fit above): within 5 sd per reward.
    z = (maps.variance - var[:, :, 0]) / (var[:, :, 0] * math.sqrt(2 / (n // 2)))
    assert z.abs().max() < 5, z


def test_exact_first_step_of_diagonal_backprop_needs_the_head_last():
    with pytest.raises(ValueError, match=r"ce_first_step='diag'.*estimator='mc'"):
        _fit(DiagBackprop, estimator="db")


def test_validation_grid_search_points_to_marglik():
    la = _fit(DiagBackprop)
    with pytest.raises(ValueError, match=r"reward_modeling.*method='marglik'"):
        gridsearch_prior_precision(la, _loader())
