"""``hessian_structure="kron"`` over all weights through ``backend=DiagBackprop``.

The backend's ``kron`` is :func:`lsn_ext.kron.kron_curvature` per batch (tested against dense
factors in ``tests/kron``); here: laplace-torch's ``KronLaplace`` sums exactly those batches,
prior tuning and serialisation work, and :func:`lsn_ext.predict`'s linearised variance per pixel
matches the dense ``diag(J Σ Jᵀ)`` with ``Σ`` the Kron posterior's own covariance, in 2-D and 3-D.
"""

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext._laplace import laplace
from lsn_ext.kron import KronLaplaceND, kron_curvature
from lsn_ext.models import UNet

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
    pytest.mark.usefixtures("one_thread"),  # tiny networks: extra threads only contend
]


def _net_2d() -> nn.Module:
    torch.manual_seed(0)
    return UNet(1, 2, (2, 4)).double().eval()


def _net_3d() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv3d(2, 2, 1)
    ).double()  # fmt: skip


def _kron_laplace(net: nn.Module, **kwargs):
    return laplace.Laplace(
        net, "classification", subset_of_weights="all", hessian_structure="kron",
        backend=lsn_ext.DiagBackprop, **kwargs,
    )  # fmt: skip


def _data(spatial: tuple[int, ...], n: int = 4):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1, *spatial, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (n, *spatial), generator=g)
    return x, y


def _covariance(la) -> torch.Tensor:
    """The Kron posterior's dense covariance, ``(H + P₀)⁻¹`` from its eigendecomposition."""
    return la.posterior_precision.to_matrix(exponent=-1)


def _dense_variance(la, x: torch.Tensor) -> torch.Tensor:
    """``diag(J Σ Jᵀ)`` per output entry, ``Σ`` the posterior's dense covariance."""
    model = la.model
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    shapes = [p.shape for _, p in model.named_parameters() if p.requires_grad]
    sizes = [s.numel() for s in shapes]

    def f(theta: torch.Tensor) -> torch.Tensor:
        parts = [t.view(s) for t, s in zip(theta.split(sizes), shapes, strict=True)]
        return functional_call(model, dict(zip(names, parts, strict=True)), (x,))

    J = jacrev(f)(la.mean.detach().clone()).reshape(-1, la.n_params)
    Sigma = _covariance(la)
    return torch.einsum("ip,pq,iq->i", J, Sigma, J).view(f(la.mean).shape)


def test_kron_fit_is_the_sum_of_the_batches_kron_curvature():
    net = _net_2d()
    x, y = _data((8, 8))
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    la = _kron_laplace(net, backend_kwargs={"estimator": "db"})
    la.fit(loader)
    backend = la.backend
    expected = None
    for xb, yb in loader:
        r = kron_curvature(net, xb, yb, "ce", N=len(x), generator=backend._batch_generator(xb, yb))
        expected = r.kron if expected is None else expected + r.kron
    # KronLaplace keeps the summed factors eigendecomposed
    torch.testing.assert_close(la.H.to_matrix(), expected.to_matrix(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    ("make", "spatial", "cls"),
    [(_net_2d, (8, 8), "KronLaplace"), (_net_3d, (4, 4, 4), "KronLaplaceND")],
    ids=["unet-2d", "conv-3d"],
)
def test_glm_predictive_variance_matches_dense_kron_covariance(make, spatial, cls):
    net = make()
    x, y = _data(spatial)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    if cls == "KronLaplace":
        la = _kron_laplace(net, prior_precision=3.0)
    else:
        la = KronLaplaceND(net, "classification", backend=lsn_ext.DiagBackprop, prior_precision=3.0)
    la.fit(loader)
    dense = _dense_variance(la, x[:1])
    n = 1000
    pred = lsn_ext.predict(
        la, x[:1], n_samples=n, pred_type="glm", generator=torch.Generator().manual_seed(0)
    )
    # a sample variance of n Gaussian draws has relative standard deviation √(2/n) ≈ 4.5 %
    rel = (pred.logit_variance - dense).abs() / dense
    assert float(rel.mean()) < 0.06
    assert float(rel.max()) < 6 * (2 / n) ** 0.5


def test_kron_prior_tuning_and_state_dict_round_trip():
    net = _net_2d()
    x, y = _data((8, 8))
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    la = laplace.Laplace(
        net,
        "classification",
        subset_of_weights="all",
        hessian_structure="kron",
        backend=lsn_ext.DiagBackprop,
    )
    la.fit(loader)
    before = float(la.log_marginal_likelihood())
    la.optimize_prior_precision(method="marglik", n_steps=30)
    assert float(la.log_marginal_likelihood()) > before
    again = laplace.Laplace(
        _net_2d(),
        "classification",
        subset_of_weights="all",
        hessian_structure="kron",
        backend=lsn_ext.DiagBackprop,
    )
    again.load_state_dict(la.state_dict())
    torch.testing.assert_close(_covariance(again), _covariance(la))


def test_kron_mode_is_checked_and_reduce_differs_from_expand():
    net = _net_2d()
    x, y = _data((8, 8), n=2)
    with pytest.raises(ValueError, match="kron_mode must be 'expand' or 'reduce', got 'both'"):
        lsn_ext.DiagBackprop(net, "classification", kron_mode="both")
    H = {}
    for mode in ("expand", "reduce"):
        backend = lsn_ext.DiagBackprop(net, "classification", kron_mode=mode)
        H[mode] = backend.kron(x, y, N=2)[1]
    pairs = zip(H["expand"].kfacs, H["reduce"].kfacs, strict=True)
    assert max(float(torch.linalg.norm(a[0] - b[0])) for a, b in pairs) > 0


def test_kron_refuses_a_subnetwork():
    net = _net_2d()
    x, y = _data((8, 8), n=2)
    backend = lsn_ext.DiagBackprop(
        net, "classification", subnetwork_indices=torch.tensor([0, 1])
    )  # fmt: skip
    with pytest.raises(ValueError, match="covers all weights of a single-process fit"):
        backend.kron(x, y, N=2)


@pytest.mark.parametrize("structure", ["kron", "lowrank"])
def test_drop_in_laplace_over_all_weights_predicts_per_pixel(structure):
    net = _net_2d()
    x, y = _data((8, 8))
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    la = lsn_ext.Laplace(net, "classification", "all", structure, prior_precision=3.0)
    assert isinstance(la.backend, lsn_ext.DiagBackprop)
    la.fit(loader)
    probs = la(x[:2], pred_type="glm", link_approx="probit", n_samples=20)
    assert probs.shape == (2, 2, 8, 8)
    torch.testing.assert_close(probs.sum(1), torch.ones(2, 8, 8, dtype=probs.dtype))
    samples = la.predictive_samples(x[:2], n_samples=3)
    assert samples.shape == (3, 2, 2, 8, 8)
    torch.testing.assert_close(samples.sum(2), torch.ones(3, 2, 8, 8, dtype=probs.dtype))


def test_kron_refuses_curvature_options_as_diag_does():
    net = _net_2d()
    x, y = _data((8, 8), n=2)
    backend = lsn_ext.DiagBackprop(net, "classification")
    for call in (backend.kron, backend.diag):
        with pytest.raises(TypeError, match=r"curvature options \['foo'\].*asdl_fisher_kwargs"):
            call(x, y, N=2, foo=1)
