"""``lsn_ext.bridge``: the Laplace Bridge against independent references and Monte Carlo.

Its laplace-torch glue, ``bridge_predictive``, is tested in
``tests/laplace_ext/test_bridge_predictive.py``.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from lsn_ext.bridge import (
    BridgeDirichlet,
    LaplaceBridge,
    dirichlet_to_gaussian,
    laplace_bridge,
)

TOL = {"rtol": 1e-11, "atol": 1e-13}


def reference_alpha(mu: np.ndarray, cov: np.ndarray) -> np.ndarray:
    """Eq. 19 after the zero-sum projection, naive float64 numpy, one Gaussian ``[K], [K, K]``."""
    K = mu.shape[0]
    one = np.ones(K)
    s = cov @ one
    t = one @ cov @ one
    mu = mu - s * (one @ mu) / t
    cov = cov - np.outer(s, s) / t
    var = np.diag(cov)
    return (1 - 2 / K + np.exp(mu) / K**2 * np.exp(-mu).sum()) / var


def random_gaussian(N: int, K: int, full: bool, scale: float = 1.0):
    mu = 2 * torch.randn(N, K)
    if full:
        A = torch.randn(N, K, K)
        return mu, scale * (A @ A.transpose(1, 2) / K + 0.1 * torch.eye(K))
    return mu, scale * (torch.rand(N, K) + 0.1)


CASES = {f"K{K}-{'full' if full else 'diag'}": (K, full) for K in (2, 3, 10) for full in (0, 1)}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_alpha_matches_independent_float64_reference(case):
    K, full = case
    mu, var = random_gaussian(5, K, bool(full))
    alpha = laplace_bridge(mu, var).alpha
    for n in range(5):
        cov = var[n].numpy() if full else np.diag(var[n].numpy())
        ref = torch.from_numpy(reference_alpha(mu[n].numpy(), cov))
        torch.testing.assert_close(alpha[n], ref, **TOL)


@pytest.mark.parametrize("K", [2, 3, 10, 100], ids=lambda K: f"K{K}")
def test_round_trip_dirichlet_gaussian_dirichlet_is_exact(K):
    alpha = torch.exp(3 * torch.randn(4, K))  # from 1e-4 to 1e4
    mu, cov = dirichlet_to_gaussian(alpha, full=True)
    torch.testing.assert_close(mu.sum(1), torch.zeros(4), atol=1e-10, rtol=0)
    torch.testing.assert_close(cov.sum(2), torch.zeros(4, K), atol=1e-6 * cov.abs().max(), rtol=0)
    torch.testing.assert_close(laplace_bridge(mu, cov).alpha, alpha, rtol=1e-10, atol=0)
    mu_d, var_d = dirichlet_to_gaussian(alpha)
    torch.testing.assert_close(var_d, cov.diagonal(dim1=1, dim2=2), rtol=1e-12, atol=0)
    torch.testing.assert_close(
        laplace_bridge(mu_d, var_d, project=False).alpha, alpha, rtol=1e-10, atol=0
    )
    torch.testing.assert_close(BridgeDirichlet(alpha.log()).to_gaussian()[1], var_d, **TOL)


def test_round_trip_per_pixel():
    alpha = torch.exp(torch.randn(2, 4, 3, 5))
    mu, var = dirichlet_to_gaussian(alpha)
    torch.testing.assert_close(laplace_bridge(mu, var, project=False).alpha, alpha, **TOL)


def test_per_pixel_equals_rows_of_the_flat_computation():
    mu, var = torch.randn(2, 5, 3, 4), torch.rand(2, 5, 3, 4) + 0.01
    d = laplace_bridge(mu, var)
    flat = laplace_bridge(mu.movedim(1, -1).reshape(-1, 5), var.movedim(1, -1).reshape(-1, 5))
    assert d.alpha.shape == (2, 5, 3, 4)
    assert d.batch_shape == (2, 3, 4)
    assert d.event_shape == (5,)
    torch.testing.assert_close(d.alpha.movedim(1, -1).reshape(-1, 5), flat.alpha, **TOL)
    torch.testing.assert_close(d.entropy().reshape(-1), flat.entropy(), **TOL)


def test_norm_variants_follow_their_formulas():
    mu, var = torch.randn(3, 6), torch.rand(3, 6) + 0.1
    m0, v0 = LaplaceBridge().gaussian(mu, var)
    for norm, reduce in (("mean", torch.mean), ("sum", torch.sum)):
        c = reduce(v0, -1, keepdim=True) * math.sqrt(2 / 6)
        m, v = LaplaceBridge(norm=norm).gaussian(mu, var)
        torch.testing.assert_close(m, m0 / c.sqrt(), **TOL)
        torch.testing.assert_close(v, v0 / c, **TOL)
    with pytest.raises(ValueError, match="norm must be one of"):
        LaplaceBridge(norm="max")


finite = st.floats(-1e4, 1e4, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 12).flatmap(
        lambda K: st.tuples(
            st.lists(finite, min_size=K, max_size=K),
            st.lists(st.floats(0, 1e6), min_size=K, max_size=K),
        )
    ),
    st.sampled_from([torch.float32, torch.float64]),
    st.sampled_from([None, "mean", "sum"]),
)
def test_simplex_and_positivity_on_extreme_inputs(data, dtype, norm):
    mu = torch.tensor([data[0]], dtype=dtype)
    var = torch.tensor([data[1]], dtype=dtype)
    mu0, var0 = mu.clone(), var.clone()
    d = laplace_bridge(mu, var, norm=norm)
    assert torch.isfinite(d.concentration).all()
    assert (d.concentration > 0).all()
    assert torch.isfinite(d.log_concentration).all()
    p = d.probs
    assert ((p >= 0) & (p <= 1)).all()
    assert abs(p.sum().item() - 1) < 10 * torch.finfo(dtype).eps
    assert torch.isfinite(d.variance).all()
    assert torch.equal(mu, mu0)
    assert torch.equal(var, var0)


def test_extreme_logits_and_zero_variance():
    mu = torch.tensor([[1e4, -1e4, 0.0], [0.0, 0.0, 0.0]])
    d = laplace_bridge(mu, torch.zeros(2, 3))
    assert torch.isfinite(d.alpha).all()
    torch.testing.assert_close(d.probs[0], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(d.probs[1], torch.full((3,), 1 / 3))
    # a single class with variance: the projection removes all of it, the floor applies
    _, v = LaplaceBridge(min_var=1e-3).gaussian(torch.zeros(1, 3), torch.tensor([[1.0, 0, 0]]))
    torch.testing.assert_close(v, torch.full((1, 3), 1e-3))


ERRORS = {
    "negative-variance": (
        torch.zeros(2, 3),
        torch.tensor([[1.0, -1e-3, 1.0], [1.0, 1.0, 1.0]]),
        ValueError,
        "non-negative",
    ),
    "nan-mean": (torch.tensor([[0.0, float("nan")]]), torch.ones(1, 2), ValueError, "non-finite"),
    "inf-variance": (torch.zeros(1, 2), torch.tensor([[1.0, math.inf]]), ValueError, "finite"),
    "shape": (torch.zeros(2, 3), torch.ones(2, 4), ValueError, "shaped like f_mu"),
    "one-class": (torch.zeros(2, 1), torch.ones(2, 1), ValueError, "K >= 2"),
    "indefinite-covariance-projection": (  # 2×2 minors fine, 1ᵀΣ1 < 0
        torch.zeros(1, 3),
        torch.tensor([[[1.0, -0.9, -0.9], [-0.9, 1.0, -0.9], [-0.9, -0.9, 1.0]]]),
        ValueError,
        r"1ᵀΣ1 or a variance after conditioning on zero-sum logits is negative",
    ),
    "asymmetric-covariance": (
        torch.zeros(2, 3),
        torch.stack([torch.eye(3), torch.eye(3) + torch.triu(torch.ones(3, 3), 1) * 0.5]),
        ValueError,
        r"f_var\[1\] is not symmetric",
    ),
    "indefinite-covariance-minor": (  # the case that gave α of 1.3e7 before
        torch.zeros(1, 3),
        torch.tensor([[[1.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]]]),
        ValueError,
        r"f_var\[0\] is not positive semi-definite: an off-diagonal entry",
    ),
    "dtype": (
        torch.zeros(2, 3, dtype=torch.float64),
        torch.ones(2, 3, dtype=torch.float32),
        TypeError,
        "dtype",
    ),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_invalid_inputs_are_refused(case):
    mu, var, error, match = case
    with pytest.raises(error, match=match):
        laplace_bridge(mu, var)


def test_behaves_like_torch_dirichlet():
    d = laplace_bridge(*random_gaussian(4, 5, full=True))
    ref = torch.distributions.Dirichlet(d.concentration)
    a, a0 = d.concentration, d.concentration.sum(-1, keepdim=True)
    torch.testing.assert_close(d.mean, a / a0, **TOL)
    torch.testing.assert_close(d.variance, ref.variance, **TOL)
    torch.testing.assert_close(d.variance, a * (a0 - a) / (a0**2 * (a0 + 1)), **TOL)
    torch.testing.assert_close(d.entropy(), ref.entropy(), **TOL)
    value = ref.sample((3,))
    torch.testing.assert_close(d.log_prob(value), ref.log_prob(value), **TOL)
    s = d.sample((7,))
    assert s.shape == (7, 4, 5)
    torch.testing.assert_close(s.sum(-1), torch.ones(7, 4), **TOL)


def test_beta_marginal_and_aggregation_match_dirichlet_moments():
    d = laplace_bridge(torch.randn(3, 6), torch.rand(3, 6) + 0.2)
    for k in (0, 4, -1):
        beta = d.marginal(k)
        torch.testing.assert_close(beta.mean, d.mean[:, k], **TOL)
        torch.testing.assert_close(beta.variance, d.variance[:, k], **TOL)
    agg = d.aggregate([[0, 2], [5]])  # the rest [1, 3, 4] becomes the last group
    assert agg.num_classes == 3
    torch.testing.assert_close(agg.alpha[:, 0], d.alpha[:, 0] + d.alpha[:, 2], **TOL)
    torch.testing.assert_close(agg.alpha[:, 2], d.alpha[:, [1, 3, 4]].sum(1), **TOL)
    torch.testing.assert_close(agg.mean.sum(-1), torch.ones(3), **TOL)
    # aggregation property: the merged component of samples has the merged Beta's mean
    s = d.sample((20000,))
    merged = s[..., 0] + s[..., 2]
    se = merged.std(0) / math.sqrt(20000)
    assert ((merged.mean(0) - agg.marginal(0).mean).abs() < 5 * se).all()
    with pytest.raises(ValueError, match="disjoint"):
        d.aggregate([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="out of range"):
        d.marginal(6)


def reference_topk(alpha: np.ndarray, T: float, max_k: int) -> list[int]:
    """Algorithm 1, literally, with scipy.stats.beta."""
    order = np.argsort(-alpha, kind="stable")
    a0 = alpha.sum()
    chosen = [int(order[0])]
    for i in range(1, min(max_k, len(alpha))):
        prev, cur = alpha[order[i - 1]], alpha[order[i]]
        left = stats.beta.ppf(T / 2, prev, a0 - prev)
        right = stats.beta.ppf(1 - T / 2, cur, a0 - cur)
        if right > left:
            chosen.append(int(order[i]))
        else:
            break
    return chosen


@pytest.mark.parametrize(
    ("T", "max_k"), [(0.05, 10), (0.3, 3), (0.01, 6)], ids=["T0.05-k10", "T0.3-k3", "T0.01-k6"]
)
def test_topk_matches_literal_algorithm_1(T, max_k):
    alpha = torch.exp(2 * torch.randn(40, 6)) * torch.exp(3 * torch.rand(40, 1))
    top = BridgeDirichlet(alpha.log()).topk(T, max_k)
    sets = top.sets()
    for n in range(40):
        assert sets[n].tolist() == reference_topk(alpha[n].numpy(), T, max_k)
    assert set(top.count.tolist()) != {1}  # the cases are not all trivial
    assert (top.mask.sum(1) == top.count).all()


def test_topk_extremes_and_per_pixel_count_map():
    confident = BridgeDirichlet(torch.tensor([[9.0, 0.0, 0.0, 0.0]]))
    assert confident.topk().count.tolist() == [1]
    flat = BridgeDirichlet(torch.zeros(1, 5))
    assert flat.topk(max_k=3).count.tolist() == [3]
    assert flat.topk(max_k=None).count.tolist() == [5]
    d = laplace_bridge(torch.randn(2, 5, 4, 3), torch.rand(2, 5, 4, 3) + 0.1)
    top = d.topk(0.05, 4)
    assert top.count.shape == (2, 4, 3)
    assert top.mask.shape == (2, 5, 4, 3)
    assert top.indices.shape == (2, 4, 4, 3)
    direct = BridgeDirichlet(d.log_concentration.reshape(-1, 5)).topk(0.05, 4)
    assert torch.equal(top.count.reshape(-1), direct.count)
    with pytest.raises(ValueError, match="for \\[N, K\\] predictions"):
        top.sets()


def test_proposition1_condition():
    d = BridgeDirichlet(torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 0.0]]).log1p())
    holds = d.proposition1()
    a = d.alpha
    rest = a.sum(1, keepdim=True) - a
    expected = a > 0.25 * (torch.sqrt(9 * rest**2 + 10 * rest + 1) - rest - 1)
    assert torch.equal(holds, expected)
    assert holds[0, 0]
    assert not holds[0, 1]


def mc_moments(mu: torch.Tensor, var: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(mu + var.sqrt() * torch.randn(S, mu.shape[-1], generator=g), -1)
    return p.mean(0), p.var(0)


def test_two_classes_small_variance_agrees_with_monte_carlo():
    # the regime where the bridge is good (integration/benchmarks/bench_bridge.py: the full table)
    mu, var = torch.tensor([1.5, -1.5]), torch.tensor([0.1, 0.1])
    m, v = mc_moments(mu, var, 200_000)
    d = laplace_bridge(mu[None], var[None])
    assert (d.probs[0] - m).abs().max() < 5e-3
    torch.testing.assert_close(d.probs_variance[0], v, rtol=0.35, atol=0)
    # larger variance: mean within 0.06, variance within 5 %
    mu, var = torch.tensor([0.5, -0.5]), torch.tensor([1.0, 1.0])
    m, v = mc_moments(mu, var, 200_000)
    d = laplace_bridge(mu[None], var[None])
    assert (d.probs[0] - m).abs().max() < 0.06
    torch.testing.assert_close(d.probs_variance[0], v, rtol=0.05, atol=0)


def test_ten_classes_top_class_is_kept_and_mean_is_softer_than_monte_carlo():
    mu, var = torch.tensor([3.0, 1.0, 0.5, 0, 0, -0.5, -1, -1, -2, -2]), torch.full((10,), 0.5)
    m, _ = mc_moments(mu, var, 200_000)
    p = laplace_bridge(mu[None], var[None]).probs[0]
    assert p.argmax() == m.argmax()
    assert p.max() < m.max()  # the bridge's mean is less confident than MC here
    assert (p - m).abs().max() < 0.3


@pytest.mark.parametrize("scale", [3.0, 30.0, 300.0], ids=["moderate", "near-limit", "extreme"])
def test_float32_inputs_match_float64_to_float32_accuracy(scale):
    g = torch.Generator().manual_seed(0)
    mu = (torch.rand(200, 10, generator=g, dtype=torch.float64) * 2 - 1) * scale
    var = torch.rand(200, 10, generator=g, dtype=torch.float64) * 5 + 1e-3
    mu, var = mu.float().double(), var.float().double()  # the same inputs in both dtypes
    exact = laplace_bridge(mu, var)
    single = laplace_bridge(mu.float(), var.float())
    assert single.log_concentration.dtype == torch.float32
    # log α to a few 1e-6 absolute (α to a few 1e-6 relative), also past the float32 limit of
    # 32, where the computation switches to float64
    err = (single.log_concentration.double() - exact.log_concentration).abs().max()
    assert err < 2e-5 * max(1.0, scale / 32), float(err)
    # probs = softmax(log α) of a float32 log α: its rounding grows with |log α| ~ |μ|
    tol = 1e-5 * max(1.0, scale / 32)
    torch.testing.assert_close(single.probs.double(), exact.probs, rtol=tol, atol=tol / 100)


def _float32_cases():
    """``(μ, v, kwargs, fallback)``: inputs in float32 and whether float64 must be used."""
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    mu = (rand(100, 10) * 2 - 1) * 3
    dominant = rand(100, 10) * 1e-6
    dominant[:, 0] = 1.0
    spread = 10 ** (rand(100, 10) * 24 - 12)  # variances from 1e-12 to 1e12 side by side
    pixel_mu = (rand(2, 10, 8, 8) * 2 - 1) * 5
    pixel_var = rand(2, 10, 8, 8) ** 8  # per pixel, some classes hold most of the variance
    floor = {"min_var": 1e-37}  # the float64 reference's floor, not below float32's tiny
    return {
        "moderate": (mu, rand(100, 10) * 5, {}, False),
        "dominant-variance": (mu, dominant, floor, False),
        "spread-variances": (mu, spread, floor, False),
        "tiny-variances": (mu, rand(100, 10) * 1e-30, floor, False),
        "subnormal-variances": (mu, rand(100, 10) * 1e-43, floor, False),
        "zero-variances": (mu, torch.zeros(100, 10), {"min_var": 1e-6}, False),
        "huge-variances": (mu, rand(100, 10) * 1e25, {}, False),
        "huge-variances-fallback": (mu, rand(100, 10) * 1e35, {}, True),
        "extreme-logits-fallback": (mu * 1e3, rand(100, 10), {}, True),
        "norm-mean-fallback": (mu, rand(100, 10) * 1e-6 + 1e-7, {"norm": "mean"}, True),
        "norm-sum": (mu, rand(100, 10) + 0.1, {"norm": "sum"}, False),
        "per-pixel": (pixel_mu, pixel_var, floor, False),
        "per-pixel-fallback": (pixel_mu * 10, pixel_var, floor, True),
    }


FLOAT32_CASES = _float32_cases()


@pytest.mark.parametrize("case", FLOAT32_CASES.values(), ids=FLOAT32_CASES.keys())
def test_float32_path_agrees_with_float64_and_falls_back_where_needed(case):
    mu, var, kwargs, fallback = case
    mu, var = mu.float(), var.float()  # the same inputs in both dtypes
    exact = laplace_bridge(mu.double(), var.double(), **kwargs)
    single = laplace_bridge(mu, var, **kwargs)
    la = single.log_concentration
    assert la.dtype == single.probs.dtype == single.alpha.dtype == torch.float32
    assert single.probs.shape == mu.shape
    assert not la.isnan().any()
    assert not single.probs.isnan().any()
    assert not single.concentration.isnan().any()
    ref = exact.log_concentration
    if fallback:  # computed in float64, then rounded: the reference's rounding, bit for bit
        assert torch.equal(la, ref.float())
    # stated tolerance of the float32 path: |Δ log α| ≤ 1e-5 · max(1, |log α|)
    err = ((la.double() - ref).abs() / ref.abs().clamp_min(1)).max()
    assert err <= 1e-5, float(err)
    # probs = softmax(log α): the float32 rounding of log α, eps·|log α|, carries over
    tol = 1e-6 * max(1.0, float(ref.abs().max()))
    torch.testing.assert_close(single.probs.double(), exact.probs, rtol=1e-5, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_float32_results_like_float64(dtype):
    g = torch.Generator().manual_seed(2)
    mu = ((torch.rand(50, 10, 4, 4, generator=g) * 2 - 1) * 8).to(dtype)
    var = (torch.rand(50, 10, 4, 4, generator=g) * 3).to(dtype)
    single = laplace_bridge(mu, var)
    exact = laplace_bridge(mu.double(), var.double(), min_var=torch.finfo(torch.float32).eps)
    assert single.log_concentration.dtype == single.probs.dtype == torch.float32
    assert single.probs.shape == mu.shape
    err = (single.log_concentration.double() - exact.log_concentration).abs().max()
    assert err <= 1e-5, float(err)
