import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsn_ext.models import SSN, SSNOutput, ssn_loss

CASES = {"binary": 1, "three-classes": 3}


def make(num_classes, rank=3):
    return SSN.with_unet(2, num_classes, widths=(3, 4), rank=rank, eps=1e-3)


@pytest.mark.parametrize("num_classes", CASES.values(), ids=CASES.keys())
def test_distribution_shapes_and_class_major_flattening(num_classes):
    ssn = make(num_classes)
    x = torch.randn(2, 2, 8, 6)
    out = ssn.distribution(x)
    D = num_classes * 8 * 6
    assert out.mean.shape == out.cov_diag.shape == (2, num_classes, 8, 6)
    assert out.cov_factor.shape == (2, D, 3)
    assert (out.cov_diag >= 1e-3).all()
    torch.testing.assert_close(out.mean, ssn(x))
    dist = out.distribution()
    assert dist.event_shape == (D,)
    # Entry k·H·W + h·W + w of the event is logit (k, h, w).
    torch.testing.assert_close(dist.loc.view(2, num_classes, 8, 6), out.mean)
    raw_factor = ssn.factor_head(ssn.backbone(x))  # [N, r·K, H, W], rank-major channels
    k, h, w, j = num_classes - 1, 5, 2, 1
    flat = k * 48 + h * 6 + w
    assert out.cov_factor[1, flat, j] == raw_factor[1, j * num_classes + k, h, w]
    assert out.rsample(4).shape == (4, 2, num_classes, 8, 6)


@pytest.mark.parametrize("num_classes", CASES.values(), ids=CASES.keys())
def test_covariance_is_diag_plus_low_rank_against_dense_build(num_classes):
    out = make(num_classes).distribution(torch.randn(2, 2, 4, 4))
    P = out.cov_factor
    D = P.shape[1]
    dense = torch.zeros(2, D, D)
    for n in range(2):
        for a in range(D):
            for b in range(D):
                dense[n, a, b] = (P[n, a] * P[n, b]).sum() + (a == b) * out.cov_diag[n].flatten()[a]
    torch.testing.assert_close(out.covariance(), dense)
    torch.testing.assert_close(out.distribution().covariance_matrix, dense)


def test_sample_covariance_matches():
    out = SSNOutput(torch.zeros(1, 1, 2, 2), torch.full((1, 1, 2, 2), 0.5), torch.randn(1, 4, 2))
    eta = out.rsample(40_000, generator=torch.Generator().manual_seed(0)).reshape(-1, 4)
    torch.testing.assert_close(eta.T.cov(), out.covariance()[0], atol=0.1, rtol=0.05)


def test_antithetic_samples_mirror_about_the_mean():
    out = make(1).distribution(torch.randn(3, 2, 4, 4))
    eta = out.rsample(6, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(eta[:3] + eta[3:], 2 * out.mean.expand(3, -1, -1, -1, -1))
    assert not torch.allclose(eta[0], eta[1])
    plain = out.rsample(5, antithetic=False)
    assert plain.shape[0] == 5
    with pytest.raises(ValueError, match="even"):
        out.rsample(5)


def direct_loss(out, y, eta, pos_weight=1.0, objective="logsumexp"):
    """Eq. 11 (or the per-pixel expected NLL) written out sample by sample and pixel by pixel."""
    M, N = eta.shape[:2]
    losses = []
    for n in range(N):
        terms = []
        for m in range(M):
            f = eta[m, n]
            if f.shape[0] == 1:
                p = torch.sigmoid(f[0])
                t = y[n, 0]
                ll = (pos_weight * t * p.log() + (1 - t) * (1 - p).log()).sum()
            else:
                ll = torch.log_softmax(f, 0).gather(0, y[n][None].long()).sum()
            terms.append(ll)
        terms = torch.stack(terms)
        losses.append(-terms.mean() if objective == "expected" else -(terms.exp().mean()).log())
    return torch.stack(losses)


@pytest.mark.parametrize(
    ("num_classes", "pos_weight"),
    [(1, 1.0), (1, 2.5), (3, 1.0)],
    ids=["binary", "binary-pos-weight-2.5", "three-classes"],
)
def test_loss_against_direct_evaluation(num_classes, pos_weight):
    # Small logits keep exp(log-likelihood) representable, so the direct formula is accurate.
    ssn = make(num_classes)
    x = 0.1 * torch.randn(2, 2, 4, 4)
    out = ssn.distribution(x)
    out = SSNOutput(0.1 * out.mean, 0.01 * out.cov_diag, 0.1 * out.cov_factor)
    y = (
        (torch.rand(2, 1, 4, 4) > 0.5).double()
        if num_classes == 1
        else torch.randint(0, num_classes, (2, 4, 4))
    )
    loss = ssn_loss(
        out,
        y,
        8,
        pos_weight=pos_weight,
        reduction="none",
        generator=torch.Generator().manual_seed(3),
    )
    eta = out.rsample(8, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(loss, direct_loss(out, y, eta, pos_weight))
    mean = ssn_loss(out, y, 8, pos_weight=pos_weight, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(mean, loss.mean())


@pytest.mark.parametrize(
    ("num_classes", "antithetic"),
    [(1, True), (1, False), (3, True)],
    ids=["binary", "binary-plain-samples", "three-classes"],
)
def test_expected_objective_matches_definition(num_classes, antithetic):
    ssn = make(num_classes)
    out = ssn.distribution(torch.randn(2, 2, 4, 4))
    y = (
        (torch.rand(2, 1, 4, 4) > 0.5).double()
        if num_classes == 1
        else torch.randint(0, num_classes, (2, 4, 4))
    )
    kw = {"antithetic": antithetic, "reduction": "none"}
    loss = ssn_loss(
        out, y, 6, objective="expected", generator=torch.Generator().manual_seed(5), **kw
    )
    eta = out.rsample(6, antithetic=antithetic, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(loss, direct_loss(out, y, eta, objective="expected"))
    lse = ssn_loss(out, y, 6, generator=torch.Generator().manual_seed(5), **kw)
    assert bool((lse <= loss + 1e-12).all())  # Jensen: log-mean-exp ≥ mean


def test_objectives_agree_for_one_sample():
    out = make(1).distribution(torch.randn(2, 2, 4, 4))
    y = (torch.rand(2, 1, 4, 4) > 0.5).double()
    a, b = (
        ssn_loss(
            out, y, 1, antithetic=False, objective=o, generator=torch.Generator().manual_seed(2)
        )
        for o in ("logsumexp", "expected")
    )
    torch.testing.assert_close(a, b)


def test_unknown_objective_is_refused():
    out = make(1).distribution(torch.randn(2, 2, 4, 4))
    with pytest.raises(ValueError, match="objective must be 'logsumexp' or 'expected'"):
        ssn_loss(out, torch.ones(2, 1, 4, 4), objective="mean")


def test_loss_is_cross_entropy_at_zero_variance():
    ssn = make(1)
    out = ssn.distribution(torch.randn(2, 2, 4, 4))
    out = SSNOutput(out.mean, torch.zeros_like(out.cov_diag), torch.zeros_like(out.cov_factor))
    y = (torch.rand(2, 1, 4, 4) > 0.5).double()
    bce = F.binary_cross_entropy_with_logits(out.mean, y, reduction="sum")
    torch.testing.assert_close(ssn_loss(out, y, 4, reduction="sum"), bce)
    torch.testing.assert_close(ssn_loss(out, y, 4, reduction="sum", objective="expected"), bce)


def test_loss_trains_the_variance_heads():
    ssn = make(1)
    loss = ssn_loss(ssn.distribution(torch.randn(2, 2, 4, 4)), torch.ones(2, 1, 4, 4))
    loss.backward()
    for head in (ssn.mean_head, ssn.log_diag_head, ssn.factor_head):
        assert head.weight.grad.abs().sum() > 0
    assert math.isfinite(loss.item())


def test_capacitance_failure_recovers_in_float64_or_raises_clearly():
    # Huge factor against a tiny diagonal: float32 Cholesky of I + Pᵀ D⁻¹ P fails.
    n, r = 64, 4
    factor = torch.ones(1, n, r, dtype=torch.float32) * 1e3
    factor[0, :, 1:] += torch.linspace(0, 1e-3, n)[:, None]
    diag = torch.full((1, 1, 8, 8), 1e-6, dtype=torch.float32)
    out = SSNOutput(torch.zeros(1, 1, 8, 8, dtype=torch.float32), diag, factor)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.distributions.LowRankMultivariateNormal(
            out.mean.flatten(1), factor, diag.flatten(1), validate_args=False
        )
    dist = out.distribution()
    assert dist.loc.dtype == torch.float64  # recovered: the same distribution, in float64
    assert torch.isfinite(dist.log_prob(torch.zeros(1, n, dtype=torch.float64))).all()

    bad = SSNOutput(out.mean.double(), diag.double(), torch.full((1, n, r), float("nan")).double())
    with pytest.raises(ValueError, match="SSN issue #4"):
        bad.distribution()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": -1}, "rank"),
        ({"num_classes": 0}, "num_classes"),
        ({"eps": -1.0}, "eps"),
    ],
    ids=["rank-negative", "classes-0", "negative-eps"],
)
def test_constructor_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SSN(nn.Conv2d(1, 4, 1), 4, **{"num_classes": 1, "rank": 2, **kwargs})


def test_loss_rejects_mismatched_target_and_reduction():
    out = make(1).distribution(torch.randn(2, 2, 4, 4))
    with pytest.raises(ValueError, match="does not match"):
        ssn_loss(out, torch.ones(2, 1, 4, 5))
    with pytest.raises(ValueError, match="reduction"):
        ssn_loss(out, torch.ones(2, 1, 4, 4), reduction="avg")


def test_rank_zero_is_the_diagonal_gaussian():
    torch.manual_seed(0)
    ssn = SSN.with_unet(2, widths=(3, 4), rank=0, eps=1e-3).double()
    assert ssn.factor_head is None
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    out = ssn.distribution(x)
    assert out.cov_factor.shape == (2, 16, 0)
    torch.testing.assert_close(out.covariance(), torch.diag_embed(out.cov_diag.flatten(1)))
    y = torch.randn(2, 16, dtype=torch.float64)
    normal = torch.distributions.Normal(out.mean.flatten(1), out.cov_diag.flatten(1).sqrt())
    torch.testing.assert_close(out.distribution().log_prob(y), normal.log_prob(y).sum(-1))
    samples = out.rsample(4000, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(samples.var(0), out.cov_diag, rtol=0.1, atol=0.0)
    loss = ssn_loss(out, (torch.rand(2, 1, 4, 4) > 0.5).double())
    loss.backward()
    assert ssn.log_diag_head.weight.grad.abs().sum() > 0
