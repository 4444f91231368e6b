"""``kron_curvature`` against laplace-torch + curvlinops ``kron``, and inside ``KronLaplace``.

laplace-torch's ``CurvlinopsGGN`` (its ``kron`` backend for ``Conv2d``) flattens the pixels
into the batch and, by default (``stochastic=False``, curvlinops' type-2 Fisher), backpropagates
column ``c`` of every pixel's Hessian square root at once: the draws ``z`` of all pixels of an
image are the same unit vector ``√C e_c``. That is our estimator with pixel-correlated draws,
``E[z zᵀ] = I_C ⊗ 11ᵀ`` instead of ``I``, so the factors of layers whose output gradients mix
pixels differ from the GGN's in expectation (integration/benchmarks/bench_kron_expand_reduce.py
measures by how much). With ``stochastic=True`` (labels sampled per pixel) both estimate the
same factors.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext._laplace import laplace
from lsn_ext.kron import KronLaplaceND, init_kron, kron_curvature
from tests.kron.kfac_reference import dense_entry

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CurvlinopsGGN = laplace.curvature.CurvlinopsGGN
KronLaplace = laplace.baselaplace.KronLaplace


def _conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 3, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 2, 1),
    )


def _data():
    return torch.randn(2, 2, 4, 4), torch.randint(0, 2, (2, 2, 2))


@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_same_factors_as_curvlinops_type2_with_its_draws(mode):
    net, (x, y) = _conv_net(), _data()
    with torch.no_grad():
        f = net(x)
    C = f.shape[1]
    z = torch.zeros(C, *f.shape)
    for c in range(C):
        z[c, :, c] = C**0.5  # every pixel of every image draws the same unit vector
    loss, theirs = CurvlinopsGGN(net, "classification").kron(x, y, N=5, kfac_approx=mode)
    ours = kron_curvature(net, x, y, "ce", N=5, mode=mode, noise=z, bias_block="kfac")
    torch.testing.assert_close(ours.loss, loss.to(ours.loss))
    assert len(ours.kron.kfacs) == len(theirs.kfacs)
    for name, a, b in zip(ours.names, ours.kron.kfacs, theirs.kfacs, strict=True):
        assert [t.shape for t in a] == [t.shape for t in b], name
        for u, v in zip(a, b, strict=True):
            torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_same_expectation_as_curvlinops_sampled_labels(mode):
    """1000 sampled labels per pixel: within 0.004–0.036 (seed 0) of our expectation."""
    torch.manual_seed(0)
    net, (x, y) = _conv_net(), _data()
    ours = kron_curvature(net, x, y, "ce", N=5, mode=mode, mc_samples="exact", bias_block="kfac")
    backend = CurvlinopsGGN(net, "classification", stochastic=True)
    _, theirs = backend.kron(x, y, N=5, kfac_approx=mode, mc_samples=1000)
    for name, a, b in zip(ours.names, ours.kron.kfacs, theirs.kfacs, strict=True):
        A, B = dense_entry(a), dense_entry(b)
        assert float((A - B).norm() / A.norm()) < 0.15, name


class KronBackend(laplace.curvature.CurvatureInterface):
    """A minimal laplace-torch backend around kron_curvature (exact expectation)."""

    def kron(self, x, y, N, **kwargs):
        result = kron_curvature(self.model, x, y, "ce", N=N, mc_samples="exact")
        return result.loss, result.kron


def _net_3d() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 2, 3, padding=1),
        nn.GroupNorm(1, 2),
        nn.Tanh(),
        nn.ConvTranspose3d(2, 2, 2, stride=2),
        nn.Tanh(),
        nn.Conv3d(2, 2, 1),
    )


def test_laplace_torch_refuses_3d_weights_and_the_adapter_takes_them():
    net = _net_3d()
    with pytest.raises(ValueError, match="Invalid parameter shape"):
        KronLaplace(net, "classification", backend=KronBackend)
    zero = init_kron(net, torch.device("cpu"), torch.float64)
    assert [t.shape for t in zero.kfacs[0]] == [(2, 2), (27, 27)]


@pytest.mark.slow
def test_kron_laplace_fits_sums_batches_and_samples_in_3d():
    """Two batches summed by KronLaplace.fit equal one batch of all data with the same N."""
    net = _net_3d()
    x = torch.randn(4, 1, 2, 2, 2)
    y = torch.randint(0, 2, (4, 4, 4, 4))
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    la = KronLaplaceND(net, "classification", backend=KronBackend, prior_precision=0.5)
    la.fit(loader)
    whole = kron_curvature(net, x, y, "ce", N=4, mc_samples="exact")
    for name, a, b in zip(whole.names, whole.kron.kfacs, la.H_facs.kfacs, strict=True):
        for u, v in zip(a, b, strict=True):
            torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-12, msg=name)
    torch.testing.assert_close(la.loss, whole.loss)
    P = sum(p.numel() for p in net.parameters())
    precision = la.posterior_precision.to_matrix()
    dense = torch.block_diag(*[dense_entry(e) for e in whole.kron.kfacs])
    torch.testing.assert_close(precision, dense + 0.5 * torch.eye(P), rtol=1e-8, atol=1e-10)
    assert torch.isfinite(la.log_marginal_likelihood())
    samples = la.sample(3, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (3, P)
    state = la.state_dict()
    again = KronLaplaceND(net, "classification", backend=KronBackend, prior_precision=0.5)
    again.load_state_dict(state)
    torch.testing.assert_close(again.log_marginal_likelihood(), la.log_marginal_likelihood())


def test_the_adapter_leaves_laplace_torch_factory_alone():
    """KronLaplaceND has a key of its own: laplace.Laplace(..., "kron") stays laplace-torch's."""
    for _ in range(5):  # the factory reads the subclasses from a set
        la = laplace.Laplace(
            _conv_net(), "classification", subset_of_weights="all", hessian_structure="kron"
        )
        assert type(la) is KronLaplace
