"""MONAI and nnU-Net networks in their default configurations, end to end.

For each network of :data:`tests.real_networks.REAL_NETWORKS` (small sizes, random init, eval
mode, float64):

- diagonal backprop runs, gives finite non-negative diagonals, and is exact for the output layer
  against the exact GGN diagonal;
- the Monte-Carlo estimator is unbiased against the exact GGN diagonal (z-tests over seeds per
  parameter tensor and in total; a tensor with curvature never reads 0 in a seed's estimate);
- the laplace-torch workflow (fit, marginal-likelihood and validation prior tuning, per-pixel
  predictive) runs with both estimators;
- the model is bit-identical after every call (:mod:`tests.model_state`).

The exact diagonal is :func:`lsn_ext.exact.exact_ggn_diagonal`: one vector-Jacobian product of
the whole functional model per loss-Hessian factor, independent of both estimators' machinery.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from laplace import Laplace
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext.exact import exact_ggn_diagonal
from tests.model_state import assert_unchanged, differences, snapshot
from tests.real_networks import REAL_NETWORKS, RealNetwork

# 25 seeds of 4 Monte-Carlo vectors each: the 100 draws of 100 one-vector calls (as before) at
# less than half the CPU (the fixed cost of a call is paid 25 times). The standard errors come
# from the 25 replicates (t with 24 degrees of freedom); a mean of 4 draws is less skewed than
# one draw, which keeps the tails of z near the t distribution's.
SEEDS, VECTORS = 25, 4
# The 32² networks cost most (their exact diagonal above all): the slow tier runs them.
NAMES = [
    pytest.param(n, marks=pytest.mark.slow) if math.prod(c.in_shape[1:]) >= 32 * 32 else n
    for n, c in REAL_NETWORKS.items()
]
# laplace-torch's constructor warns about its own predictive's default, which is not used here.
pytestmark = pytest.mark.filterwarnings("ignore:By default `link_approx` is `probit`")


def _case(name: str) -> RealNetwork:
    case = REAL_NETWORKS[name]
    reason = case.available()
    if reason is not None:
        pytest.skip(reason)
    return case


@functools.cache
def _setting(name: str) -> tuple[nn.Module, Tensor, Tensor, dict[str, Tensor]]:
    """Model, batch and exact GGN diagonal of a case (float64; built once per session)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        case = REAL_NETWORKS[name]
        torch.manual_seed(0)
        model = case.build().double()
        x, y = case.batch()
        exact = exact_ggn_diagonal(model, x, y, case.loss)
    finally:
        torch.set_default_dtype(dtype)
    return model, x, y, exact


def _output_layer(model: nn.Module, x: Tensor) -> str:
    """Dotted path of the last parametric module called in the forward pass."""
    paths = {id(m): p for p, m in model.named_modules()}
    called: list[str] = []
    hooks = [
        m.register_forward_hook(lambda mod, i, o: called.append(paths[id(mod)]))
        for m in model.modules()
        if not m._modules and any(True for _ in m.parameters(recurse=False))
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return called[-1]


@pytest.mark.parametrize("name", NAMES)
def test_diag_backprop_runs_and_is_exact_for_the_output_layer(name):
    case = _case(name)
    model, x, y, exact = _setting(name)
    before = snapshot(model)
    res = lsn_ext.diag_backprop(model, x, y, case.loss)
    assert_unchanged(model, before)
    assert list(res.diagonals) == list(exact)
    for k, d in res.diagonals.items():
        assert d.shape == exact[k].shape, k
        assert torch.isfinite(d).all(), k
        assert (d >= 0).all(), k
    head = _output_layer(model, x)
    head_params = [k for k in exact if k.rsplit(".", 1)[0] == head]
    assert head_params, head
    for k in head_params:
        torch.testing.assert_close(res.diagonals[k], exact[k], rtol=1e-9, atol=1e-12, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL_NETWORKS)
def test_monte_carlo_is_unbiased_against_the_exact_diagonal(name):
    case = _case(name)
    model, x, y, exact = _setting(name)
    before = snapshot(model)
    traces = {k: [] for k in exact}
    for seed in range(SEEDS):
        gen = torch.Generator().manual_seed(seed)
        res = lsn_ext.ggn_diagonal(
            model, x, y, case.loss, estimator="mc", mc_samples=VECTORS, generator=gen
        )
        for k, d in res.diagonals.items():
            traces[k].append(d.sum())
    assert_unchanged(model, before)
    top = max(float(e.sum()) for e in exact.values())
    draws = torch.stack([torch.stack(t) for t in traces.values()], 1)  # [SEEDS, tensors]
    for k, t in zip(exact, draws.T, strict=True):
        want = exact[k].sum()
        if want > 1e-10 * top:
            assert (t > 0).all(), f"{k}: exact trace {want:.3g}, a seed estimated 0"
        se = t.std() / SEEDS**0.5
        assert (t.mean() - want).abs() <= 5 * se + 1e-10 * top, (k, t.mean(), want, se)
    total, want = draws.sum(1), sum(e.sum() for e in exact.values())
    assert (total.mean() - want).abs() <= 5 * total.std() / SEEDS**0.5


def _only_laplace_output_size(model: nn.Module, before) -> None:
    """laplace-torch's ``fit`` sets ``model.output_size``; nothing else may change."""
    diffs = [d for d in differences(model, before) if "added ['output_size']" not in d]
    assert not diffs, "the model was modified:\n  " + "\n  ".join(diffs)


@pytest.mark.parametrize("estimator", ["mc", "db"])
@pytest.mark.parametrize("name", NAMES)
def test_laplace_workflow(name, estimator):
    case = _case(name)
    torch.manual_seed(0)
    model = case.build().double()
    x, y = case.batch(4, seed=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    before = snapshot(model)
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
        backend_kwargs={"loss": case.loss, "estimator": estimator, "seed": 0},
    )
    la.fit(loader)
    _only_laplace_output_size(model, before)
    n_params = sum(p.numel() for p in model.parameters())
    assert la.H.shape == (n_params,)
    assert torch.isfinite(la.H).all()
    assert (la.H >= 0).all()
    assert la.H.sum() > 0
    la.optimize_prior_precision(method="marglik", n_steps=20)
    prior = float(la.prior_precision)
    assert 0 < prior < float("inf")
    result = lsn_ext.gridsearch_prior_precision(la, loader, grid=[1.0, 1e2, 1e4], n_samples=3)
    assert result.prior_precision in result.grid
    assert all(torch.isfinite(torch.tensor(result.scores)))
    pred = lsn_ext.predict(la, x[:2], n_samples=4, generator=torch.Generator().manual_seed(0))
    channels = max(case.classes, 1)
    assert pred.mean.shape == (2, channels, *case.in_shape[1:])
    assert ((pred.mean >= 0) & (pred.mean <= 1)).all()
    assert (pred.variance >= 0).all()
    assert pred.variance.sum() > 0
    _only_laplace_output_size(model, before)
