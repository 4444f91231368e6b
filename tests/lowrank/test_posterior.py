"""The low-rank-plus-diagonal Gaussian against the dense ``(U Λ Uᵀ + D)⁻¹``, and its sampler."""

from __future__ import annotations

import pytest
import torch

from lsn_ext.lowrank import LowRankPlusDiagonal


def _precision(P=30, k=4, spread=1e6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(P, k, generator=gen))
    eigenvalues = torch.logspace(-12, 0, k).flip(0) * spread  # one near round-off
    diagonal = torch.rand(P, generator=gen) * 10 + 0.1
    return LowRankPlusDiagonal(U, eigenvalues, diagonal)


def test_covariance_log_det_and_variances_match_the_dense_inverse():
    prec = _precision()
    dense = (prec.U * prec.eigenvalues) @ prec.U.T + torch.diag(prec.diagonal)
    sigma = torch.linalg.inv(dense)
    torch.testing.assert_close(prec.covariance(), sigma, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(prec.variance(), sigma.diagonal(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(prec.log_det(), torch.logdet(dense))
    Js = torch.randn(3, 2, 30)
    torch.testing.assert_close(
        prec.functional_covariance(Js), Js @ sigma @ Js.transpose(1, 2), rtol=1e-8, atol=1e-10
    )
    delta = torch.randn(5, 30)
    torch.testing.assert_close(prec.square_norm(delta), ((delta @ dense) * delta).sum(1))


def test_log_det_is_differentiable_in_the_diagonal():
    prec = _precision()
    d = prec.diagonal.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(LowRankPlusDiagonal(prec.U, prec.eigenvalues, d).log_det(), d)
    # ∂ log det P / ∂ d_i = Σ_ii
    torch.testing.assert_close(grad, prec.variance(), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"eigenvalues": -torch.ones(4)}, "eigenvalues must be ≥ 0"),
        ({"diagonal": torch.zeros(30)}, "the diagonal must be positive"),
        ({"diagonal": torch.ones(29)}, r"do not fit: expected \[P, k\], \[k\], \[P\]"),
    ],
    ids=["negative-eigenvalue", "zero-diagonal", "wrong-shape"],
)
def test_bad_precisions_are_refused(change, match):
    prec = _precision()
    fields = {"U": prec.U, "eigenvalues": prec.eigenvalues, "diagonal": prec.diagonal, **change}
    with pytest.raises(ValueError, match=match):
        LowRankPlusDiagonal(**fields)
