import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import BCEWithLogits, CrossEntropy, diag_backprop, ggn_diagonal
from lsn_ext.data import synthetic_lesions
from lsn_ext.laplace_ext import DiagBackprop, gridsearch_prior_precision, predict
from lsn_ext.models import UNet

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
    "dense-regression": (2, lambda m: m.expand(-1, 2, -1, -1) * 2 - 1, "mse", "regression"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fit_sums_engine_diagonal_over_loader(case):
    out, target, loss, likelihood = case
    x, m = lesions()
    y = target(m)
    net = UNet(3, out, widths=(2, 3, 4), upsampling="bilinear")
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
    generator = torch.Generator().manual_seed(7)
    expected = sum(
        ggn_diagonal(net, xb, yb, loss, generator=generator, **options).vector for xb, yb in loader
    )
    torch.testing.assert_close(la.H, expected, **TOL)
    db = engine_sum(net, loader, loss)[1]
    assert not torch.allclose(la.H, db)
    la.fit(loader)  # the backend's generator goes on: a refit draws new vectors
    assert not torch.allclose(la.H, expected)


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
    g = torch.Generator().manual_seed(3)
    expected = sum(
        ggn_diagonal(net, xb, yb, "bce", estimator="mc", generator=g).vector for xb, yb in loader
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
    best, scores = gridsearch_prior_precision(la, val, grid=[1e-2, 1.0, 1e2], n_samples=4)
    assert best == min(scores, key=scores.get)
    assert float(la.prior_precision) == best


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
                net, "classification", subset_of_weights="all", hessian_structure="kron",
                backend=DiagBackprop,
            ),
            NotImplementedError,
            "hessian_structure='diag'",
        ),
        (
            lambda net: Laplace(
                net, "classification", subset_of_weights="all", hessian_structure="full",
                backend=DiagBackprop,
            ),
            NotImplementedError,
            "hessian_structure='diag'",
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
        "kron", "full", "loss-likelihood-mismatch", "mean-reduction", "unknown-estimator",
        "zero-mc-samples",
    ],
)  # fmt: skip
def test_unsupported_configurations_are_refused(build, err, pattern):
    x, m = lesions(4)
    net = UNet(3, 1, widths=(2, 3, 4))
    with pytest.raises(err, match=pattern):
        build(net).fit(DataLoader(TensorDataset(x, m), batch_size=2))


def test_last_layer_laplace_is_refused():
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    la = Laplace(
        net, "classification", subset_of_weights="last_layer", hessian_structure="diag",
        backend=DiagBackprop,
    )  # fmt: skip
    loader = DataLoader(TensorDataset(torch.randn(6, 4), torch.randint(0, 3, (6,))), batch_size=3)
    with pytest.raises(ValueError, match="subset_of_weights='last_layer'"):
        la.fit(loader)


def test_laplace_predictive_on_spatial_outputs_points_to_predict():
    x, m = lesions(4)
    la = make_laplace(UNet(3, 1, widths=(2, 3, 4)), loss="bce")
    la.fit(DataLoader(TensorDataset(x, m), batch_size=2))
    with pytest.raises(ValueError, match=r"\[N, 1, 16, 16\].*lsn_ext.predict"):
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
