import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import diag_backprop, ggn_diagonal
from lsn_ext.data import synthetic_lesions
from lsn_ext.lsn import (
    MeanNetwork,
    aleatoric_maps,
    ensemble_predict,
    fit_lsn,
    mc_dropout_predict,
    predict_lsn,
)
from lsn_ext.models import SSN, UNet, ssn_loss


def n_params(*modules):
    return sum(p.numel() for m in modules for p in m.parameters())


@pytest.fixture(scope="module")
def trained():
    """A small SSN trained for a few steps on synthetic lesions (float64)."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    x, y = synthetic_lesions(16, 16, channels=1, generator=torch.Generator().manual_seed(0))
    ssn = SSN.with_unet(1, widths=(4, 6), rank=3, eps=1e-4)
    opt = torch.optim.Adam(ssn.parameters(), lr=1e-2)
    for _ in range(15):
        loss = ssn_loss(ssn.distribution(x), y, 4) / 256
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_default_dtype(torch.float32)
    return ssn.eval(), x, y


def test_mean_network_shares_the_backbone_and_mean_head(trained):
    ssn, x, _ = trained
    mean_net = MeanNetwork(ssn)
    assert mean_net.backbone is ssn.backbone
    assert mean_net.mean_head is ssn.mean_head
    assert n_params(mean_net) == n_params(ssn.backbone, ssn.mean_head) < n_params(ssn)
    names = {n for n, _ in mean_net.named_parameters()}
    assert names == {n for n, _ in ssn.named_parameters() if not n.startswith(("log_", "factor"))}
    torch.testing.assert_close(mean_net(x), ssn(x))
    with pytest.raises(TypeError, match="SSN"):
        MeanNetwork(UNet(1, 1, widths=(2,)))


def test_lsn_end_to_end_on_synthetic_lesions(trained):
    ssn, x, y = trained
    before = {n: p.clone() for n, p in ssn.named_parameters()}
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    la = fit_lsn(ssn, loader, prior_precision=10.0, estimator="db")

    # The posterior covers exactly backbone + mean head, with the DB curvature of the BCE.
    assert la.n_params == n_params(ssn.backbone, ssn.mean_head)
    H = sum(diag_backprop(MeanNetwork(ssn), xb, yb, "bce").vector for xb, yb in loader)
    torch.testing.assert_close(la.H, H)

    pred = predict_lsn(la, ssn, x[:3], n_epistemic=6, n_aleatoric=5, seed=1)
    shape = (3, 1, 16, 16)
    for t in (pred.aleatoric_mean, pred.aleatoric, pred.total_mean, pred.total):
        assert t.shape == shape
    assert pred.epistemic.variance.shape == shape
    assert pred.entropy.shape == (3, 16, 16)
    assert (pred.epistemic.variance > 0).all()
    assert (pred.aleatoric > 0).all()
    assert pred.epistemic.n_samples == 6
    # Nothing was modified: variance heads stay at θ_MAP, the mean network too.
    for n, p in ssn.named_parameters():
        torch.testing.assert_close(p, before[n], rtol=0, atol=0)
    # Same seed, same maps; a broader posterior gives larger epistemic variance.
    again = predict_lsn(la, ssn, x[:3], n_epistemic=6, n_aleatoric=5, seed=1)
    torch.testing.assert_close(again.total, pred.total)
    la.prior_precision = 0.1
    broad = predict_lsn(la, ssn, x[:3], n_epistemic=6, n_aleatoric=5, seed=1)
    assert broad.epistemic.variance.sum() > pred.epistemic.variance.sum()
    other = SSN.with_unet(1, widths=(4, 6), rank=3)
    with pytest.raises(ValueError, match="MeanNetwork"):
        predict_lsn(la, other, x[:1])


@pytest.mark.parametrize("estimator", ["mc", "db_calibrated"])
def test_lsn_with_another_estimator(trained, estimator):
    ssn, x, y = trained
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    la = fit_lsn(ssn, loader, estimator=estimator, mc_samples=3, seed=4)
    assert la.n_params == n_params(ssn.backbone, ssn.mean_head)
    H = sum(
        ggn_diagonal(
            MeanNetwork(ssn), xb, yb, "bce", estimator=estimator, mc_samples=3,
            generator=la.backend._batch_generator(xb, yb),
        ).vector
        for xb, yb in loader
    )  # fmt: skip
    torch.testing.assert_close(la.H, H)
    again = fit_lsn(ssn, loader, estimator=estimator, mc_samples=3, seed=4)
    torch.testing.assert_close(again.H, la.H, rtol=0, atol=0)  # a refit reproduces H


def test_total_variance_at_a_point_posterior_is_the_aleatoric_variance(trained):
    ssn, x, y = trained
    la = fit_lsn(ssn, DataLoader(TensorDataset(x, y), batch_size=8), prior_precision=1e12)
    pred = predict_lsn(la, ssn, x[:2], n_epistemic=20, n_aleatoric=50, seed=0)
    assert pred.epistemic.variance.max() < 1e-6
    torch.testing.assert_close(pred.total, pred.aleatoric, atol=0.02, rtol=0.3)


def test_multiclass_lsn_uses_softmax():
    ssn = SSN.with_unet(1, 3, widths=(3, 4), rank=2).eval()
    x = torch.randn(4, 1, 8, 8)
    y = torch.randint(0, 3, (4, 8, 8))
    la = fit_lsn(ssn, DataLoader(TensorDataset(x, y), batch_size=2))
    pred = predict_lsn(la, ssn, x[:2], n_epistemic=3, n_aleatoric=3)
    torch.testing.assert_close(pred.total_mean.sum(1), torch.ones(2, 8, 8))
    torch.testing.assert_close(pred.epistemic.mean.sum(1), torch.ones(2, 8, 8))


def test_aleatoric_maps_against_manual_samples(trained):
    ssn, x, _ = trained
    mean, var = aleatoric_maps(ssn, x[:2], 7, generator=torch.Generator().manual_seed(4))
    eta = ssn.distribution(x[:2]).rsample(
        7, antithetic=False, generator=torch.Generator().manual_seed(4)
    )
    p = torch.sigmoid(eta)
    torch.testing.assert_close(mean, p.mean(0))
    torch.testing.assert_close(var, p.var(0))


def test_mc_dropout_and_ensemble_predictives():
    net = UNet(1, 1, widths=(3, 4), dropout=0.3)
    x = torch.randn(2, 1, 8, 8)
    net.eval()
    pred = mc_dropout_predict(net, x, 10)
    assert (pred.variance > 0).any()
    assert not any(m.training for m in net.modules())  # modes restored
    with pytest.raises(ValueError, match="no dropout"):
        mc_dropout_predict(UNet(1, 1, widths=(3, 4)), x)

    members = [UNet(1, 1, widths=(3, 4)) for _ in range(3)]
    ens = ensemble_predict(members, x)
    probs = torch.stack([torch.sigmoid(m(x)) for m in members])
    torch.testing.assert_close(ens.mean, probs.mean(0))
    torch.testing.assert_close(ens.variance, probs.var(0))
    bern = -(ens.mean * ens.mean.log() + (1 - ens.mean) * (1 - ens.mean).log())
    torch.testing.assert_close(ens.entropy, bern[:, 0])
    assert isinstance(members[0], nn.Module)


@pytest.mark.parametrize("structure", ["kron", "lowrank"])
def test_lsn_with_kron_and_lowrank_posteriors(trained, structure):
    ssn, x, y = trained
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    options = {"rank": 3} if structure == "lowrank" else {}
    la = fit_lsn(ssn, loader, prior_precision=10.0, hessian_structure=structure, **options)
    diag = fit_lsn(ssn, loader, prior_precision=10.0)
    assert la.n_params == diag.n_params  # backbone + mean head, as for the diagonal
    pred = predict_lsn(la, ssn, x[:2], n_epistemic=8, n_aleatoric=4, seed=0)
    assert pred.epistemic.variance.shape == (2, 1, *x.shape[2:])
    assert pred.epistemic.variance.max() > 0
    sharp = fit_lsn(ssn, loader, prior_precision=1e12, hessian_structure=structure, **options)
    point = predict_lsn(sharp, ssn, x[:2], n_epistemic=8, n_aleatoric=4, seed=0)
    assert point.epistemic.variance.max() < 1e-6  # the posterior shrinks to the MAP


def test_lsn_structure_options_are_checked(trained):
    ssn, x, y = trained
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    with pytest.raises(ValueError, match="hessian_structure must be one of"):
        fit_lsn(ssn, loader, hessian_structure="full")
    with pytest.raises(ValueError, match="rank is an option of hessian_structure='lowrank'"):
        fit_lsn(ssn, loader, rank=3)
