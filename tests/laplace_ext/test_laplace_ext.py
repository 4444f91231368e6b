import math

import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import BCEWithLogits, CrossEntropy, diag_backprop, ggn_diagonal
from lsn_ext.data import synthetic_lesions
from lsn_ext.laplace_ext.backend import DiagBackprop
from lsn_ext.laplace_ext.gridsearch import gridsearch_prior_precision
from lsn_ext.laplace_ext.predictive import predict
from lsn_ext.models import UNet
from tests.model_state import assert_unchanged, snapshot

TOL = {"rtol": 1e-10, "atol": 1e-12}


def lesions(n=8, size=16):
    x, m = synthetic_lesions(n, size, generator=torch.Generator().manual_seed(0))
    return x.double(), m.double()


def make_laplace(model, likelihood="classification", **backend_kwargs):
    """A DiagBackprop Laplace; diagonal backprop unless another estimator is asked for."""
    backend_kwargs.setdefault("estimator", "db")
    return Laplace(
        model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="diag",
        backend=DiagBackprop,
        backend_kwargs=backend_kwargs,
    )


def engine_sum(model, loader, loss, **kwargs):
    total_h, total_loss = 0, 0
    for xb, yb in loader:
        res = diag_backprop(model, xb, yb, loss, **kwargs)
        total_h, total_loss = total_h + res.vector, total_loss + res.loss
    return total_loss, total_h


CASES = {
    "binary-bce-pos-weight": (1, lambda m: m, BCEWithLogits(pos_weight=3.0), "classification"),
    "multiclass-ce": (
        3,
        lambda m: (m[:, 0] > 0).long() + (torch.arange(16) > 7).long(),
        CrossEntropy(),
        "classification",
    ),
    # Dense regression goes through laplace-torch flattened (its normaliser counts y.shape[-1]).
    "dense-regression-flat": (
        2,
        lambda m: (m.expand(-1, 2, -1, -1) * 2 - 1).flatten(1),
        "mse",
        "regression",
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fit_sums_engine_diagonal_over_loader(case):
    out, target, loss, likelihood = case
    x, m = lesions()
    y = target(m)
    net = UNet(3, out, widths=(2, 3, 4), upsampling="bilinear")
    if likelihood == "regression":
        net = nn.Sequential(net, nn.Flatten())
    loader = DataLoader(TensorDataset(x, y), batch_size=3)
    la = make_laplace(net, likelihood, loss=loss)
    la.fit(loader)
    expected_loss, expected_h = engine_sum(net, loader, loss)
    torch.testing.assert_close(la.H, expected_h, **TOL)
    torch.testing.assert_close(torch.as_tensor(la.loss), expected_loss, **TOL)
    assert la.n_data == len(x)


@pytest.mark.parametrize(
    "options",
    [
        {"estimator": "mc", "mc_samples": 2},
        {"estimator": "db_calibrated"},
        {"estimator": "db_calibrated", "shrinkage": 0.3},
    ],
    ids=["mc", "db-calibrated", "db-calibrated-shrinkage"],
)
def test_fit_with_another_estimator_sums_its_batches(options):
    x, m = lesions()
    net = UNet(3, 1, widths=(2, 3, 4), upsampling="bilinear")
    loader = DataLoader(TensorDataset(x, m), batch_size=3)
    loss = BCEWithLogits(pos_weight=3.0)
    la = make_laplace(net, loss=loss, seed=7, **options)
    la.fit(loader)
    expected = sum(
        ggn_diagonal(
            net, xb, yb, loss, generator=la.backend._batch_generator(xb, yb), **options
        ).vector
        for xb, yb in loader
    )
    torch.testing.assert_close(la.H, expected, **TOL)
    db = engine_sum(net, loader, loss)[1]
    assert not torch.allclose(la.H, db)
    other = make_laplace(net, loss=loss, seed=8, **options)
    other.fit(loader)  # another seed draws other vectors
    assert not torch.allclose(other.H, expected)


def test_default_estimator_is_monte_carlo():
    x, m = lesions(4)
    net = UNet(3, 1, widths=(2, 3, 4))
    loader = DataLoader(TensorDataset(x, m), batch_size=2)
    la = Laplace(
        net,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=DiagBackprop,
        backend_kwargs={"loss": "bce", "seed": 3},
    )
    la.fit(loader)
    assert la.backend.estimator == "mc"
    assert la.backend.stochastic
    assert la.backend.num_samples == la.backend.mc_samples == 1
    expected = sum(
        ggn_diagonal(
            net, xb, yb, "bce", estimator="mc", generator=la.backend._batch_generator(xb, yb)
        ).vector
        for xb, yb in loader
    )
    torch.testing.assert_close(la.H, expected, **TOL)


def test_single_linear_layer_matches_laplace_torch_exact_backend():
    x, y = torch.randn(20, 5), torch.randint(0, 3, (20,))
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    net = nn.Linear(5, 3)
    ours = make_laplace(net)
    ours.fit(loader)
    theirs = Laplace(
        net, "classification", subset_of_weights="all", hessian_structure="diag",
        backend=CurvlinopsGGN,
    )  # fmt: skip
    theirs.fit(loader)
    torch.testing.assert_close(ours.H, theirs.H, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.as_tensor(ours.loss), torch.as_tensor(theirs.loss), **TOL)


def test_nk_classifier_is_a_drop_in_with_laplace_predictive():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 14 * 14, 3))
    x = torch.randn(12, 3, 16, 16)
    y = torch.randint(0, 3, (12,))
    la = make_laplace(net)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=4))
    la.optimize_prior_precision(method="marglik", n_steps=20)
    probs = la(x[:5], pred_type="glm", link_approx="probit")
    assert probs.shape == (5, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=probs.dtype))


def test_binary_segmentation_workflow_end_to_end(capsys):
    x, m = lesions(12)
    net = UNet(3, 1, widths=(2, 3, 4))
    la = make_laplace(net, loss=BCEWithLogits(pos_weight=2.0))
    la.fit(DataLoader(TensorDataset(x, m), batch_size=4), progress_bar=True)
    assert "Computing Hessian" in capsys.readouterr().err
    before = la.log_marginal_likelihood().item()
    la.optimize_prior_precision(method="marglik", n_steps=100)
    assert la.log_marginal_likelihood().item() >= before
    torch.testing.assert_close(la.posterior_variance, 1 / (la.H + la.prior_precision))
    assert la.sample(7).shape == (7, la.n_params)

    params_before = [p.clone() for p in net.parameters()]
    pred = predict(la, x[:3], n_samples=20, generator=torch.Generator().manual_seed(0))
    for p, q in zip(net.parameters(), params_before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert pred.mean.shape == pred.variance.shape == (3, 1, 16, 16)
    assert pred.entropy.shape == pred.mutual_information.shape == (3, 16, 16)
    assert ((pred.mean >= 0) & (pred.mean <= 1)).all()
    assert (pred.variance >= 0).all()
    assert (pred.mutual_information >= 0).all()
    assert (pred.mutual_information <= pred.entropy + 1e-12).all()
    assert pred.variance.max() > 0

    val = DataLoader(TensorDataset(x[:4], m[:4]), batch_size=2)
    result = gridsearch_prior_precision(la, val, grid=[1e-2, 1.0, 1e2], n_samples=4)
    assert result.grid == [1e-2, 1.0, 1e2]
    assert result.prior_precision == result.grid[result.scores.index(min(result.scores))]
    assert float(la.prior_precision) == result.prior_precision


def test_predictive_collapses_to_map_for_a_sharp_posterior():
    x, y = lesions(6)
    net = UNet(3, 3, widths=(2, 3, 4))
    target = (y[:, 0] > 0).long()
    la = make_laplace(net)
    la.fit(DataLoader(TensorDataset(x, target), batch_size=3))
    la.prior_precision = 1e12
    pred = predict(la, x[:2], n_samples=4)
    with torch.no_grad():
        expected = torch.softmax(net(x[:2]), 1)
    torch.testing.assert_close(pred.mean, expected, rtol=1e-4, atol=1e-5)
    assert pred.variance.max() < 1e-8
    torch.testing.assert_close(pred.mean.sum(1), torch.ones(2, 16, 16, dtype=x.dtype))


@pytest.mark.slow
def test_sampling_variance_matches_analytic_variance_of_a_linear_model():
    # f = w·x + b under a diagonal Gaussian posterior: Var f = Σ x_i² σ²_wi + σ²_b exactly.
    net = nn.Linear(4, 1)
    x, y = torch.randn(30, 4), torch.randn(30, 1)
    la = make_laplace(net, "regression")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=10))
    la.prior_precision = 3.0
    pred = predict(la, x[:5], n_samples=20000, generator=torch.Generator().manual_seed(1))
    var = la.posterior_variance
    expected = x[:5].square() @ var[:4] + var[4]
    torch.testing.assert_close(pred.variance[:, 0], expected, rtol=0.05, atol=0)
    assert pred.entropy is None


def test_volumetric_segmentation():
    class Net3d(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Tanh())
            self.down = nn.MaxPool3d(2)
            self.mid = nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.Tanh())
            self.up = nn.Upsample(scale_factor=2, mode="trilinear")
            self.head = nn.Conv3d(4, 2, 1)

        def forward(self, x):
            s = self.enc(x)
            return self.head(torch.cat([s, self.up(self.mid(self.down(s)))], 1))

    x = torch.randn(4, 1, 4, 4, 4)
    y = torch.randint(0, 2, (4, 4, 4, 4))
    net = Net3d()
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    la = make_laplace(net)
    la.fit(loader)
    torch.testing.assert_close(la.H, engine_sum(net, loader, "ce")[1], **TOL)
    assert predict(la, x[:1], n_samples=3).mean.shape == (1, 2, 4, 4, 4)


def test_subnetwork_laplace_uses_the_indices():
    x, m = lesions(6)
    net = UNet(3, 1, widths=(2, 3, 4))
    loader = DataLoader(TensorDataset(x, m), batch_size=3)
    n = sum(p.numel() for p in net.parameters())
    idx = torch.arange(n - 40, n)
    la = Laplace(
        net, "classification", subset_of_weights="subnetwork", hessian_structure="diag",
        backend=DiagBackprop, backend_kwargs={"loss": "bce", "estimator": "db"},
        subnetwork_indices=idx,
    )  # fmt: skip
    la.fit(loader)
    torch.testing.assert_close(la.H, engine_sum(net, loader, "bce")[1][idx], **TOL)


def test_frozen_parameters_are_supported():
    x, m = lesions(6)
    net = UNet(3, 1, widths=(2, 3, 4))
    for p in net.encoders.parameters():
        p.requires_grad_(False)
    la = make_laplace(net, loss="bce")
    la.fit(DataLoader(TensorDataset(x, m), batch_size=3))
    assert la.H.numel() == sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert predict(la, x[:1], n_samples=2).mean.shape == (1, 1, 16, 16)


def test_backend_name_avoids_laplace_torch_backpack_special_case():
    # laplace-torch switches behaviour when a backend's class name contains "backpack".
    assert "backpack" not in DiagBackprop.__name__.lower()


@pytest.mark.parametrize(
    ("build", "err", "pattern"),
    [
        (
            lambda net: Laplace(
                net, "classification", subset_of_weights="all", hessian_structure="full",
                backend=DiagBackprop,
            ),
            NotImplementedError,
            "hessian_structure='diag' or 'kron'",
        ),
        (lambda net: make_laplace(net, "regression", loss="bce"), ValueError, "does not fit"),
        (
            lambda net: make_laplace(net, loss=nn.BCEWithLogitsLoss()),
            ValueError,
            "reduction='sum'",
        ),
        (lambda net: make_laplace(net, estimator="kfac"), ValueError, "unknown estimator 'kfac'"),
        (
            lambda net: make_laplace(net, estimator="mc", mc_samples=0),
            ValueError,
            "mc_samples must be a positive int",
        ),
    ],
    ids=[
        "full", "loss-likelihood-mismatch", "mean-reduction", "unknown-estimator",
        "zero-mc-samples",
    ],
)  # fmt: skip
def test_unsupported_configurations_are_refused(build, err, pattern):
    x, m = lesions(4)
    net = UNet(3, 1, widths=(2, 3, 4))
    with pytest.raises(err, match=pattern):
        build(net).fit(DataLoader(TensorDataset(x, m), batch_size=2))


def test_laplace_predictive_on_spatial_outputs_points_to_predict():
    x, m = lesions(4)
    la = make_laplace(UNet(3, 2, widths=(2, 3, 4)))
    la.fit(DataLoader(TensorDataset(x, m[:, 0].long()), batch_size=2))
    with pytest.raises(ValueError, match=r"\[N, 2, 16, 16\].*lsn_ext.predict"):
        la(x[:1])


def test_predict_needs_a_fitted_laplace():
    la = make_laplace(UNet(3, 1, widths=(2, 3, 4)), loss="bce")
    with pytest.raises(ValueError, match="not fitted"):
        predict(la, torch.randn(1, 3, 16, 16))
    with pytest.raises(TypeError, match="laplace-torch Laplace object or a posterior"):
        predict(object(), torch.randn(1, 3, 16, 16))


def test_predict_accepts_any_posterior_with_the_protocol():
    net = nn.Linear(3, 1)

    class PointMass:
        model, n_params, link = net, 4, "identity"

        def sample(self, n, generator=None):
            theta = torch.cat([net.weight.detach().flatten(), net.bias.detach()])
            return theta.expand(n, -1)

    x = torch.randn(5, 3)
    pred = predict(PointMass(), x, n_samples=3)
    torch.testing.assert_close(pred.mean, net(x).detach())
    assert pred.variance.abs().max() == 0
    PointMass.link = "logistic"
    with pytest.raises(ValueError, match="link must be one of"):
        predict(PointMass(), x, n_samples=3)


@pytest.mark.parametrize("spatial", [False, True], ids=["bce-N1", "bce-N1HW"])
def test_laplace_torch_predictive_of_a_bce_model_is_refused(spatial):
    # laplace-torch's GLM predictive takes a softmax over one logit: 1 for every input.
    if spatial:
        net, (x, y) = UNet(3, 1, widths=(2, 3, 4)), lesions(4)
    else:
        net, x = nn.Linear(3, 1), torch.randn(8, 3)
        y = (x[:, :1] > 0).double()
    la = make_laplace(net, loss="bce")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=4))
    with pytest.raises(ValueError, match=r"1 for every input.*lsn_ext\.predict"):
        la(x[:2])
    with pytest.raises(ValueError, match=r"1 for every input"):
        la.optimize_prior_precision(method="gridsearch", val_loader=[(x, y)], grid_size=2)
    pred = predict(la, x[:2], n_samples=3)  # the sigmoid predictive
    assert pred.mean.min() > 0
    assert pred.mean.max() < 1


def test_state_dict_roundtrip_needs_the_loss_and_refuses_a_silent_mismatch():
    x, m = lesions(4)
    net = UNet(3, 1, widths=(2, 3, 4))
    la = make_laplace(net, loss="bce")
    la.fit(DataLoader(TensorDataset(x, m), batch_size=2))
    state = la.state_dict()
    expected = predict(la, x[:2], 4, generator=torch.Generator().manual_seed(0))

    right = make_laplace(net, loss="bce")
    right.load_state_dict(state)
    got = predict(right, x[:2], 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got.mean, expected.mean, rtol=0, atol=0)
    torch.testing.assert_close(got.variance, expected.variance, rtol=0, atol=0)

    wrong = make_laplace(net)  # no loss: cross-entropy, softmax over one channel
    wrong.load_state_dict(state)
    with pytest.raises(ValueError, match=r"one logit channel.*'loss': 'bce'.*state_dict"):
        predict(wrong, x[:2], 4)
    with pytest.raises(ValueError, match=r"one logit channel"):
        gridsearch_prior_precision(wrong, [(x[:2], m[:2])], grid=[1.0], n_samples=2)


def test_cross_entropy_on_one_channel_is_refused_at_fit():
    x, m = lesions(4)
    la = make_laplace(UNet(3, 1, widths=(2, 3, 4)))
    with pytest.raises(ValueError, match=r"one logit channel.*'loss': 'bce'"):
        la.fit(DataLoader(TensorDataset(x, m[:, 0].long()), batch_size=2))


class _FirstChannel(nn.Module):
    def forward(self, x):
        return x[:, :1]


def test_a_head_swapped_to_one_channel_after_a_fit_is_refused_at_the_next_fit():
    # The output check ran once per backend: a second fit after the head was swapped for a
    # one-channel one summed the zero curvature of a constant softmax, silently.
    x, m = lesions(4)
    net = UNet(3, 2, widths=(2, 3, 4))
    la = make_laplace(net)
    loader = DataLoader(TensorDataset(x, m[:, 0].long()), batch_size=2)
    la.fit(loader)
    net.head = nn.Sequential(net.head, _FirstChannel())  # the same parameters, one channel out
    with pytest.raises(ValueError, match=r"one logit channel.*'loss': 'bce'"):
        la.fit(loader, override=False)


def test_dense_regression_is_refused_and_flat_outputs_get_the_gaussian_normaliser():
    x, m = lesions(4)
    y = m.expand(-1, 2, -1, -1) * 2 - 1
    net = UNet(3, 2, widths=(2, 3, 4))
    la = make_laplace(net, "regression", estimator="mc")
    with pytest.raises(ValueError, match=r"n_outputs=16.*nn\.Flatten\(\)"):
        la.fit(DataLoader(TensorDataset(x, y), batch_size=2))

    flat = nn.Sequential(net, nn.Flatten())
    la = make_laplace(flat, "regression", estimator="mc")
    la.fit(DataLoader(TensorDataset(x, y.flatten(1)), batch_size=2))
    assert la.n_outputs == 2 * 16 * 16
    sigma = 1.7
    la.sigma_noise = sigma
    with torch.no_grad():
        residual = (net(x) - y).square().sum()
    n_values = y.numel()  # N · C · H · W
    hand = -0.5 * residual / sigma**2 - n_values * math.log(sigma * math.sqrt(2 * math.pi))
    torch.testing.assert_close(la.log_likelihood, hand, rtol=1e-12, atol=1e-9)
    pred = predict(la, x[:1], n_samples=3)
    assert pred.mean.shape == (1, 2 * 16 * 16)


def test_default_seed_refit_reproduces_h_and_online_fits_add_up():
    x, m = lesions(6)
    net = UNet(3, 1, widths=(2, 3, 4))
    loader = DataLoader(TensorDataset(x, m), batch_size=2)
    la = Laplace(
        net, "classification", subset_of_weights="all", hessian_structure="diag",
        backend=DiagBackprop, backend_kwargs={"loss": "bce"},
    )  # fmt: skip
    la.fit(loader)
    first = la.H.clone()
    torch.manual_seed(1234)  # the global random state does not matter
    la.fit(loader)
    torch.testing.assert_close(la.H, first, rtol=0, atol=0)
    online = Laplace(
        net, "classification", subset_of_weights="all", hessian_structure="diag",
        backend=DiagBackprop, backend_kwargs={"loss": "bce"},
    )  # fmt: skip
    for _ in range(3):
        online.fit(loader, override=False)
    torch.testing.assert_close(online.H, 3 * first, **TOL)
    assert online.n_data == 3 * len(x)
    # Different batches get different vectors; so does another seed.
    seeds = {la.backend._batch_generator(xb, yb).initial_seed() for xb, yb in loader}
    assert len(seeds) == len(loader)
    other = make_laplace(net, loss="bce", estimator="mc", seed=1)
    other.fit(loader)
    assert not torch.allclose(other.H, first)
    # seed=None: torch's global generator, a refit differs.
    unseeded = make_laplace(net, loss="bce", estimator="mc", seed=None)
    unseeded.fit(loader)
    h = unseeded.H.clone()
    unseeded.fit(loader)
    assert not torch.allclose(unseeded.H, h)


@pytest.mark.parametrize(
    ("kwargs", "estimator", "mc_samples", "stochastic"),
    [
        ({}, "mc", 1, True),
        ({"stochastic": True}, "mc", 1, True),
        ({"stochastic": True, "num_samples": 3}, "mc", 3, True),
        ({"num_samples": 2, "mc_samples": 2}, "mc", 2, True),
        ({"estimator": "db"}, "db", 1, False),
        ({"stochastic": False, "estimator": "db"}, "db", 1, False),
        ({"stochastic": True, "estimator": "db_calibrated"}, "db_calibrated", 1, True),
    ],
    ids=[
        "default", "stochastic", "stochastic-num-samples", "both-sample-names", "db",
        "not-stochastic-db", "stochastic-db-calibrated",
    ],
)  # fmt: skip
def test_laplace_torch_backend_kwargs_map_to_the_estimator(
    kwargs, estimator, mc_samples, stochastic
):
    x, m = lesions(2)
    la = Laplace(
        UNet(3, 1, widths=(2, 3, 4)), "classification", subset_of_weights="all",
        hessian_structure="diag", backend=DiagBackprop, backend_kwargs={"loss": "bce", **kwargs},
    )  # fmt: skip
    la.fit(DataLoader(TensorDataset(x, m), batch_size=2))
    backend = la.backend
    assert (backend.estimator, backend.mc_samples) == (estimator, mc_samples)
    assert backend.stochastic is stochastic
    assert backend.num_samples == mc_samples


def test_gradients_are_per_sample_and_leave_grad_alone():
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 1))
    x, y = torch.randn(3, 2, 5, 5), torch.randint(0, 2, (3, 5, 5))
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    la = make_laplace(net)
    Gs, loss = la.backend.gradients(x, y)
    assert Gs.shape == (3, la.n_params)
    for i in range(3):
        value = nn.functional.cross_entropy(net(x[i : i + 1]), y[i : i + 1], reduction="sum")
        expected = torch.cat([g.flatten() for g in torch.autograd.grad(value, net.parameters())])
        torch.testing.assert_close(Gs[i], expected, **TOL)
    torch.testing.assert_close(
        loss, nn.functional.cross_entropy(net(x), y, reduction="sum").detach(), **TOL
    )
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in net.parameters())


@pytest.mark.parametrize("ignore", [255, -100], ids=["ignore-255", "ignore-minus-100"])
def test_gridsearch_skips_ignore_index_targets(ignore):
    x, m = lesions(4)
    net = UNet(3, 2, widths=(2, 3, 4))
    y = m[:, 0].long()
    la = make_laplace(net, loss=CrossEntropy(ignore_index=ignore))
    la.fit(DataLoader(TensorDataset(x, y), batch_size=2))
    masked = y.clone()
    masked[:, :4] = ignore
    result = gridsearch_prior_precision(la, [(x, masked)], grid=[0.1, 10.0], n_samples=3)
    # The score is the mean NLL over the labelled pixels only.
    la.prior_precision = 0.1
    pred = predict(la, x, 3, generator=torch.Generator().manual_seed(0))
    picked = pred.mean.gather(1, y.unsqueeze(1)).squeeze(1)[:, 4:]
    torch.testing.assert_close(
        torch.tensor(result.scores[0]), -picked.log().mean(), rtol=1e-10, atol=0
    )
    assert math.isfinite(result.scores[1])


def test_gridsearch_options_follow_optimize_prior_precision():
    x, m = lesions(4)
    net = UNet(3, 1, widths=(2, 3, 4))
    la = make_laplace(net, loss="bce")
    la.fit(DataLoader(TensorDataset(x, m), batch_size=2))
    result = gridsearch_prior_precision(
        la, [(x, m)], log_prior_prec_min=-1, log_prior_prec_max=1, grid_size=3,
        prior_structure="layerwise", n_samples=2,
    )  # fmt: skip
    torch.testing.assert_close(torch.tensor(result.grid), torch.tensor([0.1, 1.0, 10.0]))
    assert la.prior_precision.shape == (la.n_layers,)
    assert (la.prior_precision == result.prior_precision).all()
    gridsearch_prior_precision(la, [(x, m)], grid=[2.0], prior_structure="diag", n_samples=2)
    assert la.prior_precision.shape == (la.n_params,)


def test_predict_refuses_training_mode_batch_norm_and_keeps_buffers():
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 2, (4, 6, 6))
    la = make_laplace(net)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=2))
    net.train()
    before = snapshot(net)
    with pytest.raises(ValueError, match=r"1 \(BatchNorm2d\) is in training mode.*model\.eval"):
        predict(la, x, 3)
    assert_unchanged(net, before)
    net.eval()
    before = snapshot(net)
    predict(la, x, 3)
    assert_unchanged(net, before)
