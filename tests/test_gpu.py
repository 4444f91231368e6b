"""CUDA runs against CPU float64 results: DB, Monte Carlo, a DiagBackprop Laplace, the bridge.

Every test is marked ``gpu`` and skipped when ``torch.cuda.is_available()`` is False
(``tests/conftest.py``); ``pytest -m gpu`` runs these alone. Models and data are float64 on both
devices (``tests/conftest.py``), so DB, the Monte-Carlo estimate from the same vectors and
everything deterministic agree to rounding; the Laplace Bridge also runs on float32 inputs,
against the float64 reference to its stated tolerance.
"""

import copy

import pytest
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import bridge_predictive, ggn_diagonal, laplace_bridge, linearized_variance
from lsn_ext.data import synthetic_lesions
from lsn_ext.engine.checks import round_off
from lsn_ext.estimators.monte_carlo import monte_carlo
from lsn_ext.laplace_ext import DiagBackprop, batch_digest, predict
from lsn_ext.metrics import (
    aurc,
    average_precision,
    expected_calibration_error,
    noise_box,
    risk_coverage,
    roc_auc,
    spearman,
)
from lsn_ext.models import UNet
from lsn_ext.rules.losses import as_loss

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
TOL = {"rtol": 1e-9, "atol": 1e-12}


def lesions(n=4, size=16):
    x, m = synthetic_lesions(n, size, generator=torch.Generator().manual_seed(0))
    return x.double(), m.double()


def nets(out_channels=1):
    """The same U-Net on the CPU and on the device."""
    net = UNet(3, out_channels, widths=(2, 3, 4))
    return net, copy.deepcopy(net).to(DEVICE)


def fitted(net, x, m, **backend_kwargs):
    la = Laplace(
        net,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=DiagBackprop,
        backend_kwargs={"loss": "bce", **backend_kwargs},
    )
    la.fit(DataLoader(TensorDataset(x, m), batch_size=2))  # laplace-torch moves the batches
    return la


def test_db_on_the_device_matches_cpu():
    net, dev = nets()
    x, m = lesions()
    cpu = ggn_diagonal(net, x, m, "bce", estimator="db")
    got = ggn_diagonal(dev, x.to(DEVICE), m.to(DEVICE), "bce", estimator="db")
    assert got.vector.device.type == DEVICE.type
    torch.testing.assert_close(got.vector.cpu(), cpu.vector, **TOL)
    torch.testing.assert_close(got.loss.cpu(), cpu.loss, **TOL)


def test_monte_carlo_on_the_device_matches_cpu_with_the_same_vectors():
    net, dev = nets(out_channels=3)
    x, m = lesions()
    y = (m[:, 0] > 0).long() + (x[:, 0] > 0.5).long()  # three classes
    z = torch.randint(0, 2, (2, 4, 3, 16, 16), generator=torch.Generator().manual_seed(1)) * 2 - 1
    z = z.double()
    cpu = monte_carlo(net, x, y, as_loss("ce"), 2, None, None, noise=z)
    got = monte_carlo(
        dev, x.to(DEVICE), y.to(DEVICE), as_loss("ce"), 2, None, None, noise=z.to(DEVICE)
    )
    torch.testing.assert_close(got.vector.cpu(), cpu.vector, **TOL)
    # the public call draws its vectors on the device: the same generator seed, the same
    # estimate (to rounding: CUDA's convolution gradients sum in a non-deterministic order),
    # another seed, another estimate
    runs = [
        ggn_diagonal(
            dev, x.to(DEVICE), y.to(DEVICE), "ce", generator=torch.Generator(DEVICE).manual_seed(s)
        ).vector
        for s in (3, 3, 4)
    ]
    torch.testing.assert_close(runs[0], runs[1], **TOL)
    assert not torch.allclose(runs[0], runs[2], rtol=1e-3)
    assert bool(torch.isfinite(runs[0]).all())


def test_fingerprint_and_corruptions_are_the_same_on_the_device():
    x, _ = lesions()
    assert torch.equal(batch_digest(x.to(DEVICE)).cpu(), batch_digest(x))
    noisy, box = noise_box(x, generator=torch.Generator().manual_seed(1))
    got, got_box = noise_box(x.to(DEVICE), generator=torch.Generator().manual_seed(1))
    assert got.device.type == got_box.device.type == DEVICE.type
    assert torch.equal(got.cpu(), noisy)
    assert torch.equal(got_box.cpu(), box)


def test_metrics_on_the_device_match_cpu():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(300, generator=g).round(decimals=1)  # ties
    labels = torch.rand(300, generator=g) < scores
    risk = torch.rand(300, generator=g)
    on = {"scores": scores.to(DEVICE), "labels": labels.to(DEVICE), "risk": risk.to(DEVICE)}
    assert roc_auc(on["scores"], on["labels"]) == pytest.approx(roc_auc(scores, labels), rel=1e-12)
    assert average_precision(on["scores"], on["labels"]) == pytest.approx(
        average_precision(scores, labels), rel=1e-12
    )
    assert expected_calibration_error(on["scores"], on["labels"]) == pytest.approx(
        expected_calibration_error(scores, labels), rel=1e-12
    )
    assert aurc(on["scores"], on["risk"]) == pytest.approx(aurc(scores, risk), rel=1e-12)
    assert spearman(on["scores"], on["risk"]) == pytest.approx(spearman(scores, risk), rel=1e-12)
    coverage, curve = risk_coverage(on["scores"], on["risk"])
    assert curve.device.type == DEVICE.type
    torch.testing.assert_close(curve.cpu(), risk_coverage(scores, risk)[1], **TOL)
    torch.testing.assert_close(coverage.cpu(), risk_coverage(scores, risk)[0], **TOL)


def test_laplace_db_fit_and_predict_on_the_device_match_cpu():
    net, dev = nets()
    x, m = lesions(6)
    cpu = fitted(net, x, m, estimator="db")
    got = fitted(dev, x, m, estimator="db")
    assert got.H.device.type == DEVICE.type
    torch.testing.assert_close(got.H.cpu(), cpu.H, **TOL)
    torch.testing.assert_close(got.log_marginal_likelihood().cpu(), cpu.log_marginal_likelihood())
    xs = x[:2]
    mean, var = linearized_variance(net, xs, cpu.posterior_variance)
    got_mean, got_var = linearized_variance(dev, xs.to(DEVICE), got.posterior_variance)
    torch.testing.assert_close(got_mean.cpu(), mean, **TOL)
    torch.testing.assert_close(got_var.cpu(), var, **TOL)
    # the linearised predictive samples on the device: the exact logit mean, and a variance
    # that agrees with the CPU's estimate from other draws (2,000 pairs: a few % sd per pixel)
    pred = predict(
        got, xs.to(DEVICE), 4000, pred_type="glm", generator=torch.Generator(DEVICE).manual_seed(0)
    )
    ref = predict(cpu, xs, 4000, pred_type="glm", generator=torch.Generator().manual_seed(0))
    assert pred.mean.device.type == DEVICE.type
    torch.testing.assert_close(pred.logit_mean.cpu(), ref.logit_mean, **TOL)
    torch.testing.assert_close(pred.logit_variance.cpu(), ref.logit_variance, rtol=0.3, atol=0)
    sampled = predict(got, xs.to(DEVICE), 8, generator=torch.Generator(DEVICE).manual_seed(0))
    assert bool(((sampled.mean >= 0) & (sampled.mean <= 1)).all())
    bridged = bridge_predictive(got, xs.to(DEVICE))
    torch.testing.assert_close(bridged.probs.cpu(), bridge_predictive(cpu, xs).probs, **TOL)


def test_laplace_monte_carlo_fit_on_the_device_is_a_function_of_seed_and_batch():
    _, dev = nets()
    x, m = lesions(6)
    la = fitted(dev, x, m)
    first = la.H.clone()
    torch.manual_seed(1234)  # the global random state does not matter
    la.fit(DataLoader(TensorDataset(x, m), batch_size=2))
    torch.testing.assert_close(la.H, first, **TOL)  # to CUDA's non-deterministic sums
    assert bool(torch.isfinite(first).all())
    batches = [(x[i : i + 2].to(DEVICE), m[i : i + 2].to(DEVICE)) for i in range(0, 6, 2)]
    generators = [la.backend._batch_generator(xb, yb) for xb, yb in batches]
    assert all(g.device.type == DEVICE.type for g in generators)
    assert len({g.initial_seed() for g in generators}) == len(batches)
    other = fitted(dev, x, m, seed=1)
    assert not torch.allclose(other.H, first, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bridge_on_the_device_matches_cpu_float64(dtype):
    g = torch.Generator().manual_seed(0)
    cases = [
        (torch.randn(500, 10, generator=g) * 3, torch.rand(500, 10, generator=g) * 5),
        (torch.randn(2, 10, 8, 8, generator=g) * 3, torch.rand(2, 10, 8, 8, generator=g) ** 8),
        (torch.randn(50, 10, generator=g) * 1e3, torch.rand(50, 10, generator=g)),  # fallback
    ]
    for mu, var in cases:
        mu, var = mu.to(dtype), var.to(dtype)
        ref = laplace_bridge(mu.double(), var.double(), min_var=1e-6)
        got = laplace_bridge(mu.to(DEVICE), var.to(DEVICE), min_var=1e-6)
        la = got.log_concentration
        assert la.device.type == DEVICE.type
        assert la.dtype == dtype
        assert got.probs.shape == mu.shape
        assert not bool(la.isnan().any())
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        err = ((la.cpu().double() - ref.log_concentration).abs()).max()
        assert err <= tol * max(1.0, float(ref.log_concentration.abs().max())), float(err)
    top = got.topk(0.05, 3)
    assert top.count.device.type == DEVICE.type
    assert torch.equal(top.count.cpu(), ref.topk(0.05, 3).count)


def test_round_off_follows_the_tf32_setting():
    t = torch.zeros(1, device=DEVICE, dtype=torch.float32)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        assert round_off(t) == 2.0**-10
    matmul = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            assert round_off(t) == torch.finfo(torch.float32).eps
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
    assert round_off(t.double()) == torch.finfo(torch.float64).eps


@pytest.mark.parametrize(
    ("tf32", "tolerance"),
    [pytest.param(False, 1e-4, id="ieee-float32"), pytest.param(True, 5e-2, id="tf32")],
)
def test_monte_carlo_in_float32_on_cuda_matches_cpu_float64(tf32, tolerance):
    """MONAI's BasicUNet in float32 on CUDA against float64 on the CPU, from the same vectors.

    With TF32 convolutions (cuDNN's default for float32) the per-sample replay agrees with the
    batched forward to TF32's rounding only; the estimator's checks must accept that (they
    refused it once). The estimate is then as accurate as TF32 allows (within 5 % in norm for
    this network); with TF32 off, to float32's accuracy.
    """
    monai = pytest.importorskip("monai")
    net = monai.networks.nets.BasicUNet(spatial_dims=2, in_channels=1, out_channels=2).eval()
    dev = copy.deepcopy(net).float().to(DEVICE)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1, 32, 32, generator=g)
    y = (x[:, 0] > 0).long()
    z = (torch.randint(0, 2, (1, 4, 2, 32, 32), generator=g) * 2 - 1).double()
    ref = monte_carlo(net, x, y, as_loss("ce"), 1, None, None, noise=z).vector
    matmul = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
            got = monte_carlo(
                dev, x.float().to(DEVICE), y.to(DEVICE), as_loss("ce"), 1, None, None,
                noise=z.float().to(DEVICE),
            ).vector  # fmt: skip
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
    assert got.dtype == torch.float32
    rel = float((got.cpu().double() - ref).norm() / ref.norm())
    assert rel < tolerance, rel
