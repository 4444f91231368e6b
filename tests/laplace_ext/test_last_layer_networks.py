"""``lsn_ext.Laplace`` (the factory) and last-layer Laplace on real segmentation networks.

MONAI's BasicUNet (2-D, ``1×1`` convolution head) and MONAI's UNet (3-D, a stride-2
``ConvTranspose3d`` head) from ``tests/real_networks.py``: the fitted curvature against the
dense GGN of the head (``torch.func.jacfwd`` Jacobians, the softmax / sigmoid Hessians written
out here), the closed-form predictive variance against dense ``diag(J Σ Jᵀ)``, marglik and
``la(x)`` per pixel.
"""

from __future__ import annotations

import laplace
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext.laplace_ext import (
    LAPLACE_CLASSES,
    DiagBackprop,
    DiagSegmentationLaplace,
    FullLastLayerLaplace,
    HeadFeatureExtractor,
    KronLastLayerLaplace,
    head_logit_moments,
    register_laplace,
)
from tests.laplace_ext.test_last_layer import dense_jacobian
from tests.model_state import assert_unchanged, snapshot
from tests.real_networks import REAL_NETWORKS


def _case(key):
    case = REAL_NETWORKS[key]
    reason = case.available()
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    net = case.build().double()
    x, y = case.batch(2)
    return case, net, x.double(), y


def _loss_hessian(f, binary):
    """``Λ [N·C·P, N·C·P]`` of the summed loss, block-diagonal over positions."""
    N, C = f.shape[:2]
    logits = f.reshape(N, C, -1).transpose(1, 2).reshape(-1, C)  # [N·P, C]
    if binary:
        p = torch.sigmoid(logits)
        blocks = torch.diag_embed(p * (1 - p))
    else:
        p = torch.softmax(logits, 1)
        blocks = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)
    dense = torch.block_diag(*blocks)  # in (n, p, c) order
    P = logits.shape[0] // N
    order = torch.arange(N * C * P).reshape(N, C, P).transpose(1, 2).reshape(-1)
    inverse = torch.argsort(order)
    return dense[inverse][:, inverse]  # in (n, c, p) order, as f.flatten()


@pytest.mark.parametrize("key", ["monai-basicunet-2d", "monai-unet-3d"])
def test_full_last_layer_on_a_real_network(key):
    case, net, x, y = _case(key)
    before = snapshot(net)
    la = lsn_ext.Laplace(
        net, "classification", "last_layer", "full", backend_kwargs={"loss": case.loss}
    )
    assert isinstance(la, FullLastLayerLaplace)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=1))
    assert_unchanged(net, before)
    name = la.model._last_layer_name
    head = net.get_submodule(name)
    dense = 0
    for i in range(x.shape[0]):
        J = dense_jacobian(net, name, head, x[i : i + 1])
        dense = dense + J.T @ _loss_hessian(net(x[i : i + 1]).detach(), case.classes == 1) @ J
    torch.testing.assert_close(la.H, dense, rtol=1e-9, atol=1e-10)
    la.optimize_prior_precision(method="marglik", n_steps=20)
    J = dense_jacobian(net, name, head, x[:1])
    expected = (J @ la.posterior_covariance @ J.T).diagonal().reshape(net(x[:1]).shape)
    torch.testing.assert_close(head_logit_moments(la, x[:1])[1], expected, rtol=1e-9, atol=1e-12)
    p = la(x)
    assert p.shape == net(x).shape
    if case.classes == 1:
        assert bool(((p > 0) & (p < 1)).all())
    else:
        torch.testing.assert_close(p.sum(1), torch.ones_like(p[:, 0]))


def test_default_call_is_last_layer_kron_through_diag_backprop():
    _, net, x, y = _case("monai-basicunet-2d")
    la = lsn_ext.Laplace(net, "classification")
    assert type(la) is KronLastLayerLaplace
    assert la._backend_cls is DiagBackprop
    la.fit(DataLoader(TensorDataset(x, y), batch_size=1))
    assert la.model._last_layer_name == "final_conv"
    la.optimize_prior_precision(method="marglik", n_steps=20)
    p = la(x)
    torch.testing.assert_close(p.sum(1), torch.ones_like(p[:, 0]))


def test_laplace_torch_with_a_generalised_feature_extractor_fits_the_unet(monkeypatch):
    """What integration/checks/upstream/laplace/0002 enables: laplace-torch's own default call
    ``laplace.Laplace(unet, "classification", backend=DiagBackprop)``, refused by 0.3's
    ``FeatureExtractor`` ("Use model with a linear last layer."), fits when the extractor
    accepts convolution heads, with the same curvature as ``lsn_ext.Laplace``."""
    _, net, x, y = _case("monai-basicunet-2d")
    loader = DataLoader(TensorDataset(x, y), batch_size=1)
    with pytest.raises(ValueError, match=r"Use model with a linear last layer\."):
        laplace.Laplace(net, "classification", backend=DiagBackprop).fit(loader)
    monkeypatch.setattr(laplace.lllaplace, "FeatureExtractor", HeadFeatureExtractor)
    upstream = laplace.Laplace(net, "classification", backend=DiagBackprop)
    assert type(upstream) is laplace.KronLLLaplace
    upstream.fit(loader)
    ours = lsn_ext.Laplace(net, "classification")
    ours.fit(loader)
    for a, b in zip(upstream.H_facs.kfacs, ours.H_facs.kfacs, strict=True):
        for fa, fb in zip(a, b, strict=True):
            torch.testing.assert_close(fa, fb)
    torch.testing.assert_close(upstream.log_marginal_likelihood(), ours.log_marginal_likelihood())


def test_factory_dispatch_and_registry():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1))
    from laplace.utils.enums import HessianStructure, SubsetOfWeights

    la = lsn_ext.Laplace(net, "classification", SubsetOfWeights.ALL, HessianStructure.DIAG)
    assert type(la) is DiagSegmentationLaplace
    assert la._backend_cls is DiagBackprop
    with pytest.raises(ValueError, match=r"no class for subset_of_weights='all' with "):
        lsn_ext.Laplace(net, "classification", "all", "gp")
    with pytest.raises(ValueError, match="functional_approximation"):
        lsn_ext.Laplace(net, "classification", functional_approximation="sod")
    # laplace-torch's own factory still builds its own classes
    assert type(laplace.Laplace(net, "classification", "all", "diag")) is laplace.DiagLaplace
    assert type(laplace.Laplace(net, "classification")) is laplace.KronLLLaplace

    class Custom(DiagSegmentationLaplace):
        _key = ("all", "custom (test)")

    register_laplace("all", "custom", Custom)
    try:
        assert type(lsn_ext.Laplace(net, "classification", "all", "custom")) is Custom
    finally:
        del LAPLACE_CLASSES[("all", "custom")]


def test_all_weights_diag_predicts_per_pixel():
    """Through the factory, la(x, pred_type="nn") takes the softmax over the classes (dim 1);
    laplace-torch's own DiagLaplace takes it over the image width."""
    net = lsn_ext.models.UNet(1, 3, widths=(2, 3, 4)).double().eval()
    x = torch.randn(2, 1, 8, 12)
    y = torch.randint(0, 3, (2, 8, 12))
    loader = DataLoader(TensorDataset(x, y), batch_size=1)
    la = lsn_ext.Laplace(net, "classification", "all", "diag")
    la.fit(loader)
    p = la(x, pred_type="nn", link_approx="mc", n_samples=3)
    torch.testing.assert_close(p.sum(1), torch.ones(2, 8, 12))
    samples = la.predictive_samples(x, pred_type="nn", n_samples=3)
    torch.testing.assert_close(samples.sum(2), torch.ones(3, 2, 8, 12))
    upstream = laplace.Laplace(net, "classification", "all", "diag", backend=DiagBackprop)
    upstream.fit(loader)
    q = upstream(x, pred_type="nn", link_approx="mc", n_samples=3)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3, 8))  # the documented upstream trap
