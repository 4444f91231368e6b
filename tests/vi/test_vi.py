"""Structured VI: densities against torch.distributions, sampling modes, ELBO, predictive glue."""

import math

import pytest
import torch
from torch import nn
from torch.distributions import LowRankMultivariateNormal, MultivariateNormal

import lsn_ext
from lsn_ext.models import UNet
from lsn_ext.rules.losses import MSE, Loss
from lsn_ext.vi import (
    GaussianMixture,
    StructuredGaussian,
    VariationalPosterior,
    elbo,
    gaussian_kl,
)

RANKS = [pytest.param(r, id=f"rank{r}") for r in (0, 1, 3)]


# Tiny problems: MKL's LAPACK (r×r Cholesky, QR) with several OpenMP threads on busy cores
# spends milliseconds per call synchronising, which made the fit test take ~10-20 s.
pytestmark = pytest.mark.usefixtures("one_thread")


MODES = [pytest.param(m, id=m) for m in ("single", "paired", "unscented")]


def _gaussian(P=7, rank=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = StructuredGaussian(torch.randn(P, generator=g), rank, init_std=0.7, generator=g)
    with torch.no_grad():
        q.raw_diag.add_(torch.randn(P, generator=g))
        if q.factor is not None:
            q.factor.mul_(3)
    return q


def _reference(q):
    if q.factor is None:
        return MultivariateNormal(q.loc, torch.diag(q.diag))
    return LowRankMultivariateNormal(q.loc, q.factor, q.diag)


@pytest.mark.parametrize("rank", RANKS)
def test_log_prob_and_entropy_match_torch(rank):
    q = _gaussian(rank=rank)
    ref = _reference(q)
    theta = torch.randn(5, 3, q.n_params)
    torch.testing.assert_close(q.log_prob(theta), ref.log_prob(theta))
    torch.testing.assert_close(q.entropy(), ref.entropy())
    torch.testing.assert_close(q.logdet(), torch.logdet(q.dense_covariance()))
    torch.testing.assert_close(q.variance, q.dense_covariance().diagonal())


@pytest.mark.parametrize("rank", RANKS)
def test_solve_is_the_inverse_covariance(rank):
    q = _gaussian(rank=rank)
    rhs = torch.randn(q.n_params, 4)
    torch.testing.assert_close(q.solve(rhs), torch.linalg.solve(q.dense_covariance(), rhs))
    torch.testing.assert_close(q.solve(rhs[:, 0]), q.solve(rhs)[:, 0])


def test_gaussian_kl_matches_torch():
    q = _gaussian(rank=2)
    A = torch.randn(q.n_params, q.n_params)
    p = MultivariateNormal(torch.randn(q.n_params), A @ A.T + torch.eye(q.n_params))
    expected = torch.distributions.kl_divergence(p, _reference(q))
    torch.testing.assert_close(gaussian_kl(p.loc, p.covariance_matrix, q), expected)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("mode", MODES)
def test_samples_have_the_moments_of_q(rank, mode):
    q = _gaussian(rank=rank)
    g = torch.Generator().manual_seed(1)
    n = 2 * max(rank, 1) * 6000
    theta = q.sample(n, generator=g, mode=mode)
    cov = q.dense_covariance().detach()
    se = cov.diagonal().sqrt() / math.sqrt(n)
    assert ((theta.mean(0) - q.loc).abs() < 5 * se).all()
    torch.testing.assert_close(torch.cov(theta.T), cov, atol=float(0.08 * cov.abs().max()), rtol=0)


@pytest.mark.parametrize("rank", [pytest.param(r, id=f"rank{r}") for r in (1, 3)])
def test_unscented_groups_are_mirrored_and_orthogonal(rank):
    q = _gaussian(rank=rank)
    eps, z = q._noise(4 * rank, "unscented", torch.Generator().manual_seed(0))
    z = z.reshape(2, 2 * rank, rank)  # [group, draw, r]
    eps = eps.reshape(2, 2 * rank, -1)
    torch.testing.assert_close(z[:, rank:], -z[:, :rank])  # mirrors
    torch.testing.assert_close(eps[:, rank:], -eps[:, :rank])
    for group in z[:, :rank]:
        gram = group @ group.T  # orthogonal directions of common length ρ
        torch.testing.assert_close(gram, gram[0, 0] * torch.eye(rank))
    theta = q.sample(2 * rank, mode="unscented").reshape(2, rank, -1)
    torch.testing.assert_close(theta.mean((0, 1)), q.loc)  # each group is centred on μ


def test_paired_samples_are_antithetic():
    q = _gaussian(rank=2)
    theta = q.sample(8, mode="paired").reshape(4, 2, -1)
    torch.testing.assert_close(theta.sum(1) / 2, q.loc.expand(4, -1))


@pytest.mark.parametrize(
    ("mode", "n"), [pytest.param("paired", 3, id="paired-odd"), pytest.param("x", 2, id="bad")]
)
def test_sampling_rejects_bad_requests(mode, n):
    with pytest.raises(ValueError, match=r"mode|multiple"):
        _gaussian().sample(n, mode=mode)


def test_mixture_density_moments_and_entropy():
    g = torch.Generator().manual_seed(0)
    mix = GaussianMixture(torch.zeros(4), 3, rank=1, init_std=0.5, jitter=2.0, generator=g)
    with torch.no_grad():
        mix.logits.copy_(torch.tensor([0.3, -1.0, 0.5]))
    pi = mix.weights
    theta = torch.randn(6, 4)
    ref = torch.logsumexp(
        torch.stack([_reference(c).log_prob(theta) for c in mix.components], -1) + pi.log(), -1
    )
    torch.testing.assert_close(mix.log_prob(theta), ref)
    draws = mix.sample(60000, generator=g)
    torch.testing.assert_close(draws.mean(0), mix.mean, atol=0.05, rtol=0)
    torch.testing.assert_close(draws.var(0), mix.variance, atol=0.1, rtol=0.03)
    H = mix.entropy(4000, generator=g)
    Hc = sum(p * c.entropy() for p, c in zip(pi, mix.components, strict=True))
    assert Hc - 0.05 < H < Hc - (pi * pi.log()).sum() + 0.05
    mc = -mix.log_prob(draws).mean()
    torch.testing.assert_close(H, mc, atol=0.05, rtol=0)


def test_elbo_fit_recovers_a_gaussian_target():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(3, 3, generator=g)
    cov = A @ A.T + 0.5 * torch.eye(3)
    mu = torch.randn(3, generator=g)
    prec = torch.linalg.inv(cov)

    def log_joint(theta):
        r = theta - mu
        return -0.5 * torch.einsum("si,ij,sj->s", r, prec, r)

    q = StructuredGaussian(torch.zeros(3), 3, init_std=0.5, generator=g)
    opt = torch.optim.Adam(q.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 250, eta_min=5e-4)
    for _ in range(250):
        opt.zero_grad()
        (-elbo(q, log_joint, 6, "unscented", generator=g)).backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        assert gaussian_kl(mu, cov, q) < 0.02


def _linear_regression(seed=0, n=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3 * torch.randn(n, 1, generator=g)
    return x, y


@pytest.mark.parametrize(
    "n_components", [pytest.param(1, id="gaussian"), pytest.param(2, id="mixture")]
)
def test_posterior_elbo_is_exact_at_the_true_posterior(n_components):
    """For Bayesian linear regression the ELBO at q = p(θ|D) equals log p(D) + const."""
    x, y = _linear_regression()
    sigma = 0.3
    vi = VariationalPosterior(
        nn.Linear(3, 1, bias=False),
        MSE(factor=1 / (2 * sigma**2)),
        rank=3,
        n_components=n_components,
        prior_precision=2.0,
    )
    cov = torch.linalg.inv(x.T @ x / sigma**2 + 2.0 * torch.eye(3))
    mean = cov @ x.T @ y[:, 0] / sigma**2
    a = 0.5 * torch.linalg.eigvalsh(cov).min()
    L = torch.linalg.cholesky(cov - a * torch.eye(3))  # Σ = a I + L Lᵀ is the exact posterior
    comps = vi.q.components if n_components > 1 else [vi.q]
    with torch.no_grad():
        for c in comps:
            c.loc.copy_(mean)
            c.raw_diag.fill_(float(a + torch.log(-torch.expm1(-a))))
            c.factor.copy_(L)
    values = torch.stack([vi.elbo(x, y, n_samples=4) for _ in range(3)])
    # log Z = log ∫ exp(−loss) N(θ; 0, λ⁻¹I) dθ: the ELBO has zero variance at the optimum.
    torch.testing.assert_close(values, values[:1].expand(3), atol=1e-6, rtol=0)
    quad = -0.5 * sigma**-2 * (y[:, 0] @ y[:, 0]) + 0.5 * mean @ torch.linalg.solve(cov, mean)
    log_z = quad + 0.5 * (torch.logdet(cov) + 3 * math.log(2.0))
    torch.testing.assert_close(values[0], log_z, atol=1e-6, rtol=0)


def test_minibatch_elbo_scales_the_data_term():
    x, y = _linear_regression(n=8)
    vi = VariationalPosterior(nn.Linear(3, 1, bias=False), "mse", rank=1, init_std=0.1)
    value = vi.elbo(x[:4], y[:4], n_data=8, n_samples=2, generator=torch.Generator().manual_seed(3))
    theta = vi.q.rsample(2, "paired", torch.Generator().manual_seed(3))
    terms = [2 * vi.log_likelihood(t, x[:4], y[:4]) + vi.log_prior(t) - vi.log_q(t) for t in theta]
    torch.testing.assert_close(value, torch.stack(terms).mean())
    prior = torch.distributions.Normal(0.0, 1.0).log_prob(theta).sum(-1)
    torch.testing.assert_close(vi.log_prior(theta), prior)


def test_vmapped_and_looped_data_terms_agree():
    x, y = _linear_regression(n=12)
    for model, loss, xb, yb in [
        (nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), "mse", x, y),
        (UNet(1, 1, widths=(2, 3)).eval(), "bce", torch.randn(2, 1, 8, 8), None),
    ]:
        if yb is None:
            yb = (torch.rand(2, 1, 8, 8) > 0.5).double()
        vi = VariationalPosterior(model, loss, rank=2, init_std=0.1)
        values, grads = [], []
        for vectorize in (True, False):
            vi.q.zero_grad()
            gen = torch.Generator().manual_seed(5)
            value = vi.elbo(xb, yb, n_data=20, n_samples=8, generator=gen, vectorize=vectorize)
            value.backward()
            values.append(value.detach())
            grads.append(torch.cat([p.grad.reshape(-1) for p in vi.parameters()]))
        torch.testing.assert_close(values[0], values[1])
        torch.testing.assert_close(grads[0], grads[1])
        theta = vi.sample(6)
        torch.testing.assert_close(
            vi.batched_log_likelihood(theta, xb, yb, vectorize=True),
            torch.stack([vi.log_likelihood(t, xb, yb) for t in theta]),
        )
        assert vi._vectorize


class _InPlace(nn.Module):
    """Writes its output into a buffer in place: ``vmap`` cannot batch that write."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("last", torch.zeros(40, 1))

    def forward(self, x):
        out = self.lin(x)
        self.last.copy_(out.detach())
        return out


def test_data_term_falls_back_to_a_loop_when_vmap_fails():
    x, y = _linear_regression()
    vi = VariationalPosterior(_InPlace(), "mse", rank=1, init_std=0.1)
    with pytest.raises(RuntimeError):
        vi.elbo(x, y, n_samples=4, vectorize=True)
    assert vi._vectorize  # a forced attempt does not change the default
    looped = vi.elbo(x, y, n_samples=4, generator=torch.Generator().manual_seed(2), vectorize=False)
    auto = vi.elbo(x, y, n_samples=4, generator=torch.Generator().manual_seed(2))
    assert not vi._vectorize  # remembered: the loop from now on
    torch.testing.assert_close(auto, looped)
    auto.backward()
    assert vi.q.factor.grad.abs().sum() > 0


def test_fit_increases_the_elbo_and_reports_progress():
    x, y = _linear_regression()
    vi = VariationalPosterior(nn.Linear(3, 1), "mse", rank=2, init_std=0.05)
    seen = []
    vi.fit([(x, y)], epochs=60, lr=0.05, progress=lambda s, v: seen.append(s))
    assert seen == list(range(60))
    assert len(vi.history) == 60
    assert sum(vi.history[-10:]) / 10 > sum(vi.history[:10]) / 10 + 10


def test_posterior_interface_on_a_unet_with_bce():
    torch.manual_seed(0)
    model = UNet(1, 1, widths=(2, 3)).eval()
    vi = VariationalPosterior(model, "bce", rank=2, init_std=0.05)
    assert vi.link == "sigmoid"
    assert vi.n_params == sum(p.numel() for p in model.parameters())
    x = torch.randn(2, 1, 8, 8)
    y = (torch.rand(2, 1, 8, 8) > 0.5).double()
    value = vi.elbo(x, y, n_data=10, n_samples=4, mode="unscented")
    value.backward()
    assert vi.q.factor.grad.abs().sum() > 0
    torch.testing.assert_close(vi.mean, torch.cat([p.reshape(-1) for p in model.parameters()]))
    pred = lsn_ext.predict(vi, x, n_samples=8, generator=torch.Generator().manual_seed(0))
    assert pred.mean.shape == (2, 1, 8, 8)
    assert pred.entropy.shape == (2, 8, 8)
    assert ((pred.mean > 0) & (pred.mean < 1)).all()
    assert (pred.variance > 0).any()
    mean, var = lsn_ext.linearized_variance(model, x, vi.posterior_variance)
    assert var.shape == (2, 1, 8, 8)
    assert (var > 0).all()
    torch.testing.assert_close(mean, model(x))


def test_posterior_variance_is_diag_plus_rowsum():
    vi = VariationalPosterior(nn.Linear(3, 2), "ce", rank=2, init_std=0.3)
    q = vi.q
    torch.testing.assert_close(vi.posterior_variance, q.diag + q.factor.pow(2).sum(1))
    assert vi.link == "softmax"
    assert vi.sample(3).shape == (3, vi.n_params)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        pytest.param({"likelihood": nn.MSELoss()}, ValueError, id="mean-reduction"),
        pytest.param({"prior_precision": 0.0}, ValueError, id="zero-prior"),
        pytest.param({"rank": -1}, ValueError, id="negative-rank"),
        pytest.param({"n_components": 0}, ValueError, id="no-components"),
    ],
)
def test_posterior_rejects_bad_arguments(kwargs, error):
    kwargs = {"likelihood": "mse", **kwargs}
    with pytest.raises(error):
        VariationalPosterior(nn.Linear(2, 1), **kwargs)


def test_a_bad_batch_does_not_switch_the_posterior_to_the_slow_path():
    x, y = _linear_regression()
    vi = VariationalPosterior(nn.Linear(3, 1), "mse", rank=1, init_std=0.1)
    with pytest.raises(ValueError, match="do not match"):
        vi.elbo(x, y[:, :0], n_samples=4)  # a target of the wrong shape fails either way
    assert vi._vectorize  # still vmap for the next, good batch
    vi.elbo(x, y, n_samples=4)
    assert vi._vectorize


def test_a_rank_above_the_parameter_count_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"rank 1000000000 exceeds the number of parameters P = 4"):
        VariationalPosterior(nn.Linear(3, 1), "mse", rank=10**9)


class _NoLink(Loss):
    """A custom likelihood that names no predictive link (the base class's ``link = None``)."""


LINKS = {
    "bce": ("bce", "sigmoid"),
    "ce": ("ce", "softmax"),
    "mse-factor": (MSE(factor=0.5), "identity"),
    "torch-bce": (nn.BCEWithLogitsLoss(reduction="sum"), "sigmoid"),
}


@pytest.mark.parametrize("case", LINKS.values(), ids=LINKS.keys())
def test_link_comes_from_the_loss(case):
    likelihood, link = case
    assert VariationalPosterior(nn.Linear(3, 2), likelihood).link == link


def test_a_loss_without_a_link_is_refused_as_before():
    # A TypeError, as the posterior has always raised (lsn_ext.links.NoLinkError is also a
    # ValueError, the predictives' type).
    with pytest.raises(TypeError, match="no predictive link for loss _NoLink"):
        VariationalPosterior(nn.Linear(3, 2), _NoLink())
