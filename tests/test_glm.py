"""The GLM predictive of ``lsn_ext.predict`` and ``predict_lsn`` against dense Jacobians.

Reference: ``J = ∂f/∂θ`` at the posterior mean from ``torch.func.jacrev`` (all ``N·C·H·W``
outputs against all ``P`` parameters), the exact linearised variance ``diag(J Σ Jᵀ)`` and the
linearised samples ``f* ± J δ_s`` rebuilt from the same posterior draws.
"""

import math

import pytest
import torch
from laplace import Laplace
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext import predict
from lsn_ext.lsn import fit_lsn, predict_lsn
from lsn_ext.models import SSN, UNet
from lsn_ext.models.ssn import SSNOutput
from lsn_ext.vi import VariationalPosterior
from tests.model_state import assert_unchanged, snapshot


def _loader(x: Tensor, y: Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=2)


def _laplace(model: nn.Module, x: Tensor, y: Tensor, loss: str, prior: float = 2.0) -> Laplace:
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
        backend_kwargs={"loss": loss},
    )
    la.fit(_loader(x, y))
    la.prior_precision = prior
    return la


def _dense_jacobian(model: nn.Module, mean: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """``f(x; θ*)`` and ``J`` ``[outputs, P]`` over the trainable parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for _, p in named]

    def f(theta: Tensor) -> Tensor:
        params = {n: t.view_as(p) for (n, p), t in zip(named, theta.split(sizes), strict=True)}
        return torch.func.functional_call(model, params, (x,))

    f_map = f(mean)
    return f_map, torch.func.jacrev(f)(mean).reshape(f_map.numel(), -1)


def _bce_unet() -> tuple[nn.Module, Tensor, Tensor]:
    net = UNet(3, 1, widths=(3, 4)).eval()
    x = torch.randn(4, 3, 8, 8)
    return net, x, (torch.rand(4, 1, 8, 8) > 0.6).double()


def _ce_unet() -> tuple[nn.Module, Tensor, Tensor]:
    net = UNet(2, 3, widths=(3, 4)).eval()
    return net, torch.randn(4, 2, 8, 8), torch.randint(0, 3, (4, 8, 8))


def _volume_net() -> tuple[nn.Module, Tensor, Tensor]:
    net = nn.Sequential(
        nn.Conv3d(1, 3, 3, padding=1), nn.Tanh(), nn.Conv3d(3, 2, 3, padding=1)
    ).eval()
    return net, torch.randn(2, 1, 4, 5, 6), torch.randint(0, 2, (2, 4, 5, 6))


NETWORKS = {"bce-unet-2d": (_bce_unet, "bce"), "ce-unet-2d": (_ce_unet, "ce")}
NETWORKS["ce-conv-3d"] = (_volume_net, "ce")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(NETWORKS), ids=list(NETWORKS))
def test_logit_variance_is_the_dense_linearised_variance_diag_posterior(case):
    make, loss = NETWORKS[case]
    net, x, y = make()
    la = _laplace(net, x, y, loss)
    snap = snapshot(net)
    n = 2000  # was 4000; the tolerances below are in units of the estimate's sd at this n
    pred = predict(la, x[:2], n, pred_type="glm", generator=torch.Generator().manual_seed(3))
    assert_unchanged(net, snap)
    f_map, J = _dense_jacobian(net, la.mean, x[:2])
    exact = (J.square() @ la.posterior_variance).view_as(f_map)
    torch.testing.assert_close(pred.logit_mean, f_map, rtol=1e-12, atol=1e-12)
    # (J δ)² is exact·χ²₁: the mean over S = n/2 products has relative sd √(2/S).
    z = (pred.logit_variance - exact) / (exact * math.sqrt(2 / (n // 2)))
    assert z.abs().max() < 5, float(z.abs().max())
    assert abs(float(z.mean())) < 5 / math.sqrt(z.numel()) * 3
    assert (pred.pred_type, pred.link_approx, pred.n_samples) == ("glm", "mc", n)


@pytest.mark.slow
def test_logit_variance_is_the_dense_linearised_variance_low_rank_vi_posterior():
    net, x, _ = _bce_unet()
    post = VariationalPosterior(net, "bce", rank=3, init_std=0.05)
    with torch.no_grad():  # a non-trivial low-rank factor and mean
        post.q.factor.normal_(0, 0.02)
        post.q.loc.add_(0.1 * torch.randn_like(post.q.loc))
    n = 2000  # was 4000; z is in units of the estimate's sd at this n
    pred = predict(post, x[:2], n, pred_type="glm", generator=torch.Generator().manual_seed(0))
    f_map, J = _dense_jacobian(net, post.mean, x[:2])
    exact = ((J @ post.q.dense_covariance().detach()) * J).sum(1).view_as(f_map)
    torch.testing.assert_close(pred.logit_mean, f_map, rtol=1e-12, atol=1e-12)
    z = (pred.logit_variance - exact) / (exact * math.sqrt(2 / (n // 2)))
    assert z.abs().max() < 5, float(z.abs().max())


def _linearised_samples(la: Laplace, x: Tensor, n: int, seed: int) -> tuple[Tensor, Tensor]:
    """``f*`` and the ``n`` logit samples ``f* ± J δ_s`` from the same draws as ``predict``."""
    f_map, J = _dense_jacobian(la.model, la.mean, x)
    deltas = la.sample((n + 1) // 2, generator=torch.Generator().manual_seed(seed)) - la.mean
    tangents = (deltas @ J.T).view(-1, *f_map.shape)
    samples = torch.stack([f_map + s * t for t in tangents for s in (1, -1)])[:n]
    return f_map, samples


@pytest.mark.parametrize("n", [6, 7], ids=["even-n", "odd-n"])
@pytest.mark.parametrize("case", ["bce-unet-2d", "ce-unet-2d"])
def test_mc_link_averages_the_linearised_samples(case, n):
    make, loss = NETWORKS[case]
    net, x, y = make()
    la = _laplace(net, x, y, loss, prior=0.5)
    pred = predict(la, x[:2], n, pred_type="glm", generator=torch.Generator().manual_seed(5))
    _, samples = _linearised_samples(la, x[:2], n, 5)
    p = torch.sigmoid(samples) if loss == "bce" else torch.softmax(samples, 2)
    torch.testing.assert_close(pred.mean, p.mean(0), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(pred.variance, p.var(0), rtol=1e-10, atol=1e-12)
    if loss == "bce":
        q = p.clamp_min(1e-300)
        h = -(q * q.log() + (1 - q) * (1 - q).clamp_min(1e-300).log()).sum(2)
        mean = pred.mean
        entropy = -(mean * mean.log() + (1 - mean) * (1 - mean).log()).sum(1)
    else:
        h = -(p * p.clamp_min(1e-300).log()).sum(2)
        entropy = -(pred.mean * pred.mean.log()).sum(1)
    torch.testing.assert_close(pred.entropy, entropy)
    torch.testing.assert_close(pred.mutual_information, (entropy - h.mean(0)).clamp_min(0))


@pytest.mark.parametrize("case", ["bce-unet-2d", "ce-unet-2d"])
def test_probit_and_bridge_links_use_the_linearised_moments(case):
    make, loss = NETWORKS[case]
    net, x, y = make()
    la = _laplace(net, x, y, loss, prior=0.5)
    n, seed = 8, 2
    f_map, samples = _linearised_samples(la, x[:2], n, seed)
    tangents = samples[0::2] - f_map
    var = tangents.square().mean(0)

    def run(link):
        g = torch.Generator().manual_seed(seed)
        return predict(la, x[:2], n, pred_type="glm", link_approx=link, generator=g)

    probit, bridge = run("probit"), run("bridge")
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * var)
    expected = torch.sigmoid(kappa * f_map) if loss == "bce" else torch.softmax(kappa * f_map, 1)
    torch.testing.assert_close(probit.mean, expected)
    torch.testing.assert_close(probit.logit_variance, var)
    if loss == "bce":
        d = lsn_ext.laplace_bridge(
            torch.cat([-f_map / 2, f_map / 2], 1), torch.cat([var, var], 1) / 4, project=False
        )
        torch.testing.assert_close(bridge.mean, d.probs[:, 1:])
        torch.testing.assert_close(bridge.variance, d.probs_variance[:, 1:])
    else:  # per-pixel covariance over the classes, estimated from the same products
        K = f_map.shape[1]
        cov = torch.einsum("sn...,sm...->nm...", tangents.movedim(2, 1), tangents.movedim(2, 1))
        cov = cov.movedim(0, -1).movedim(0, -1).reshape(-1, K, K) / len(tangents)
        mu = f_map.movedim(1, -1).reshape(-1, K)
        d = lsn_ext.laplace_bridge(mu, cov)
        torch.testing.assert_close(bridge.mean.movedim(1, -1).reshape(-1, K), d.probs)
    assert torch.isfinite(bridge.mutual_information).all()
    assert (bridge.mutual_information >= 0).all()


def test_bridge_expected_entropy_matches_dirichlet_samples():
    net, x, y = _ce_unet()
    la = _laplace(net, x, y, "ce", prior=0.3)
    pred = predict(la, x[:1], 16, pred_type="glm", link_approx="bridge")
    # E_Dir H[p] by sampling the Dirichlet that the bridge gives (same mean and variance).
    mean, var = pred.mean.movedim(1, -1).reshape(-1, 3), pred.variance.movedim(1, -1)
    alpha0 = (mean * (1 - mean) / var.reshape(-1, 3) - 1)[:, 0]
    alpha = mean * alpha0[:, None]
    p = torch.distributions.Dirichlet(alpha).sample((4000,)).clamp_min(1e-300)
    expected_entropy = -(p * p.log()).sum(-1).mean(0)
    entropy = -(mean * mean.log()).sum(-1)
    mi = pred.mutual_information.reshape(-1)
    torch.testing.assert_close(mi, (entropy - expected_entropy).clamp_min(0), atol=3e-3, rtol=0.05)


class _Doubling(torch.autograd.Function):
    """``2x`` as an old-style Function: no forward-mode AD, a differentiable backward."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class _NoForwardAD(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Conv2d(3, 1, 1)

    def forward(self, x):
        return self.head(_Doubling.apply(torch.tanh(self.conv(x))))


def test_an_operation_without_forward_ad_falls_back_to_double_backward_with_a_warning():
    net = _NoForwardAD().eval()
    x = torch.randn(2, 2, 6, 6)
    post = VariationalPosterior(net, "bce", init_std=0.1)
    snap = snapshot(net)
    with pytest.warns(RuntimeWarning, match="without forward-mode AD.*double backward"):
        pred = predict(post, x, 6, pred_type="glm", generator=torch.Generator().manual_seed(1))
    assert_unchanged(net, snap)
    mean = post.mean
    params = list(net.parameters())
    sizes = [p.numel() for p in params]

    def f(theta):
        named = dict(zip([n for n, _ in net.named_parameters()], theta.split(sizes), strict=True))
        named = {n: t.view_as(p) for (n, t), p in zip(named.items(), params, strict=True)}
        return torch.func.functional_call(net, named, (x,))

    J = torch.autograd.functional.jacobian(f, mean).reshape(-1, mean.numel())
    deltas = post.sample(3, generator=torch.Generator().manual_seed(1)) - mean
    f_map = f(mean)
    samples = torch.stack([f_map + s * (J @ d).view_as(f_map) for d in deltas for s in (1, -1)])
    torch.testing.assert_close(pred.mean, torch.sigmoid(samples).mean(0))
    torch.testing.assert_close(pred.logit_variance, (deltas @ J.T).square().mean(0).view_as(f_map))


def test_predict_lsn_glm_is_the_ssn_distribution_around_the_linearised_mean():
    ssn = SSN.with_unet(3, widths=(3, 4), rank=2).eval()
    x, y = torch.randn(4, 3, 8, 8), (torch.rand(4, 1, 8, 8) > 0.6).double()
    la = fit_lsn(ssn, _loader(x, y))
    la.prior_precision = 1.0
    snap = snapshot(ssn)
    n_e, n_a, seed = 5, 3, 4
    pred = predict_lsn(la, ssn, x[:2], n_e, n_a, seed=seed, pred_type="glm")
    assert_unchanged(ssn, snap)
    assert pred.epistemic.pred_type == "glm"
    _, samples = _linearised_samples(la, x[:2], n_e, seed)
    at_map = ssn.distribution(x[:2])
    gen = torch.Generator().manual_seed(seed + 2)
    probs = [
        torch.sigmoid(
            SSNOutput(f, at_map.cov_diag, at_map.cov_factor).rsample(
                n_a, antithetic=False, generator=gen
            )
        )
        for f in samples
    ]
    total = torch.cat(probs)
    torch.testing.assert_close(pred.total_mean, total.mean(0))
    torch.testing.assert_close(pred.total, total.var(0))
    nn_pred = predict_lsn(la, ssn, x[:2], n_e, n_a, seed=seed)
    assert nn_pred.epistemic.pred_type == "nn"
    torch.testing.assert_close(nn_pred.aleatoric, pred.aleatoric)
    with pytest.raises(ValueError, match="pred_type must be one of"):
        predict_lsn(la, ssn, x[:2], pred_type="linear")


def test_nn_predictive_reports_the_sample_moments_of_the_logits():
    net, x, y = _bce_unet()
    la = _laplace(net, x, y, "bce", prior=1.0)
    n = 5
    pred = predict(la, x[:2], n, generator=torch.Generator().manual_seed(7))
    thetas = la.sample(n, generator=torch.Generator().manual_seed(7))
    named = [(k, p) for k, p in net.named_parameters()]
    sizes = [p.numel() for _, p in named]
    logits = torch.stack(
        [
            torch.func.functional_call(
                net,
                {k: t.view_as(p) for (k, p), t in zip(named, th.split(sizes), strict=True)},
                x[:2],
            )
            for th in thetas
        ]
    )
    torch.testing.assert_close(pred.logit_mean, logits.mean(0))
    torch.testing.assert_close(pred.logit_variance, logits.var(0))
    torch.testing.assert_close(pred.mean, torch.sigmoid(logits).mean(0))
    assert pred.pred_type == "nn"


def test_glm_regression_maps_are_the_output_mean_and_linearised_variance():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(6, 3)
    loader = DataLoader(TensorDataset(x, torch.randn(6, 2)), batch_size=3)
    la = Laplace(net, "regression", subset_of_weights="all", hessian_structure="diag")
    la.fit(loader)
    n = 4000
    pred = predict(la, x, n, pred_type="glm", generator=torch.Generator().manual_seed(0))
    f_map, J = _dense_jacobian(net, la.mean, x)
    exact = (J.square() @ la.posterior_variance).view_as(f_map)
    torch.testing.assert_close(pred.mean, f_map)
    z = (pred.variance - exact) / (exact * math.sqrt(2 / (n // 2)))
    assert z.abs().max() < 5
    assert pred.entropy is None
    with pytest.raises(ValueError, match=r"regression posterior's maps .* use link_approx='mc'"):
        predict(la, x, 4, pred_type="glm", link_approx="probit")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pred_type": "linear"}, r"pred_type must be one of \('glm', 'nn'\), got 'linear'"),
        ({"link_approx": "bridge_norm"}, r"link_approx must be one of .* got 'bridge_norm'"),
    ],
    ids=["unknown-pred-type", "unknown-link-approx"],
)
def test_unknown_predictive_names_are_refused(kwargs, match):
    net, x, y = _bce_unet()
    la = _laplace(net, x, y, "bce")
    with pytest.raises(ValueError, match=match):
        predict(la, x, 4, **kwargs)


def test_glm_refuses_a_mixture_posterior():
    net, x, _ = _bce_unet()
    post = VariationalPosterior(net, "bce", n_components=2)
    with pytest.raises(ValueError, match=r"Gaussian mixture .* pred_type='nn'"):
        predict(post, x, 4, pred_type="glm")
    assert predict(post, x, 4).mean.shape == (4, 1, 8, 8)


def test_non_finite_maps_are_refused_with_the_cause():
    # No curvature and a tiny prior: posterior sd 1e15, and the product of three such
    # layers' weights overflows float32 (as marglik's prior 0.024 did on MONAI's FlexibleUNet).
    torch.set_default_dtype(torch.float32)  # a float32 model end to end (conftest restores)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 1, 3, padding=1)
    ).float()
    x, y = torch.randn(2, 2, 6, 6).float(), (torch.rand(2, 1, 6, 6) > 0.5).float()
    la = _laplace(net, x, y, "bce")
    la.H = torch.zeros_like(la.H)
    la.prior_precision = 1e-30
    snap = snapshot(net)
    with pytest.raises(ValueError, match=r"non-finite values in torch.float32.*prior"):
        predict(la, x, 4)
    # The linearised network never multiplies two sampled weights: it stays finite here.
    glm = predict(la, x, 4, pred_type="glm")
    assert torch.isfinite(glm.logit_variance).all()
    assert glm.logit_variance.min() > 1e25
    assert_unchanged(net, snap)


@pytest.mark.parametrize("pred_type", ["nn", "glm"])
def test_chunked_draws_give_the_same_maps_as_one_chunk(monkeypatch, pred_type):
    net, x, y = _bce_unet()
    la = _laplace(net, x, y, "bce", prior=0.5)

    def run():
        g = torch.Generator().manual_seed(11)
        return predict(la, x[:2], 37, pred_type=pred_type, generator=g)

    whole = run()
    calls = []
    sample = la.sample
    monkeypatch.setattr(lsn_ext.glm, "_DRAW_BUDGET", 3 * la.n_params)
    monkeypatch.setattr(
        la, "sample", lambda k, generator=None: calls.append(k) or sample(k, generator)
    )
    chunked = run()
    assert len(calls) > 1
    assert max(calls) <= 16 * 3
    torch.testing.assert_close(chunked.mean, whole.mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(chunked.logit_variance, whole.logit_variance, rtol=1e-12, atol=0)


def test_grid_search_scores_the_predictive_it_is_given():
    net, x, y = _bce_unet()
    la = _laplace(net, x, y, "bce")
    grid = [0.1, 1.0, 10.0]
    result = lsn_ext.gridsearch_prior_precision(
        la, _loader(x, y), grid=grid, n_samples=4, pred_type="glm", seed=3
    )
    for value, score in zip(grid, result.scores, strict=True):
        la.prior_precision = value
        nll = 0.0
        for batch, (xb, yb) in enumerate(_loader(x, y)):
            g = torch.Generator().manual_seed(3 + batch)
            p = predict(la, xb, 4, pred_type="glm", generator=g).mean
            nll -= float((yb * p.log() + (1 - yb) * (1 - p).log()).sum())
        assert score == pytest.approx(nll / y.numel(), rel=1e-10)
    assert result.prior_precision == grid[min(range(3), key=result.scores.__getitem__)]


def test_grid_search_scores_an_overflowing_candidate_as_infinite():
    torch.set_default_dtype(torch.float32)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 1, 3, padding=1)
    )
    x, y = torch.randn(4, 2, 6, 6), (torch.rand(4, 1, 6, 6) > 0.5).float()
    la = _laplace(net, x, y, "bce")
    la.H = torch.zeros_like(la.H)
    result = lsn_ext.gridsearch_prior_precision(la, _loader(x, y), grid=[1e-30, 1.0], n_samples=4)
    assert result.scores[0] == math.inf
    assert math.isfinite(result.scores[1])
    assert result.prior_precision == 1.0


class _Attention(nn.Module):
    """Self-attention over the pixels (``nn.MultiheadAttention``), optionally then ``_Doubling``."""

    def __init__(self, forward_ad: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 1)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Conv2d(4, 3, 1)
        self.forward_ad = forward_ad

    def forward(self, x):
        h = self.conv(x)
        tokens = h.flatten(2).transpose(1, 2)  # [N, H·W, C]
        tokens = self.attention(tokens, tokens, tokens, need_weights=False)[0]
        h = tokens.transpose(1, 2).reshape(h.shape)
        return self.head(h if self.forward_ad else _Doubling.apply(h))


@pytest.mark.parametrize("forward_ad", [True, False], ids=["jvp", "double-backward"])
def test_glm_runs_through_multihead_attention(forward_ad):
    """MHA's fast path has no forward-mode AD and CPU flash attention no double backward.

    Both used to fail (the second with ``derivative for
    aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented``); the
    tangents now run attention through its math kernel.
    """
    net = _Attention(forward_ad).eval()
    x = torch.randn(2, 2, 3, 3)
    post = VariationalPosterior(net, "ce", init_std=0.1)
    snap = snapshot(net)
    g = torch.Generator().manual_seed(1)
    if forward_ad:
        pred = predict(post, x, 6, pred_type="glm", generator=g)
    else:
        with pytest.warns(RuntimeWarning, match="without forward-mode AD.*double backward"):
            pred = predict(post, x, 6, pred_type="glm", generator=g)
    assert_unchanged(net, snap)
    mean = post.mean
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]

    def f(theta):  # reverse mode, first order: any kernel and any Function serve
        pieces = theta.split([s.numel() for s in shapes])
        named = {n: t.view(s) for n, t, s in zip(names, pieces, shapes, strict=True)}
        return torch.func.functional_call(net, named, (x,))

    J = torch.autograd.functional.jacobian(f, mean).reshape(-1, mean.numel())
    f_map = f(mean).detach()
    deltas = post.sample(3, generator=torch.Generator().manual_seed(1)) - mean
    samples = torch.stack([f_map + s * (J @ d).view_as(f_map) for d in deltas for s in (1, -1)])
    torch.testing.assert_close(pred.logit_mean, f_map, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pred.mean, torch.softmax(samples, 2).mean(0))
    torch.testing.assert_close(pred.logit_variance, (deltas @ J.T).square().mean(0).view_as(f_map))
