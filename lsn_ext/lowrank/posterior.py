r"""Gaussian with a low-rank-plus-diagonal precision: covariance, log-determinant, variances.

The precision is

.. math::

    P = U Λ U^\top + D, \qquad U \in ℝ^{P×k} \text{ (orthonormal columns)}, \quad
    Λ = \operatorname{diag}(λ) \ge 0, \quad D = \operatorname{diag}(d) > 0.

With ``W = D^{-½} U Λ^{½}`` ``[P, k]`` and the Cholesky factor ``L`` of the ``k×k`` matrix
``M = I + Wᵀ W`` (all of whose eigenvalues are ``≥ 1``, so it is well conditioned whatever the
spread of ``λ`` and ``d``), the Woodbury identity gives

.. math::

    Σ = P^{-1} = D^{-1} - B B^\top, \quad B = D^{-½} W L^{-\top} \ [P, k], \qquad
    \log\det P = \textstyle\sum_i \log d_i + 2 \sum_j \log L_{jj}.

Unlike the textbook form ``D⁻¹ − D⁻¹U(Λ⁻¹ + UᵀD⁻¹U)⁻¹UᵀD⁻¹`` (laplace-torch's
``LowRankLaplace``), nothing here divides by ``λ``, so eigenvalues near zero are harmless.
Everything is differentiable in ``d`` and ``λ`` (marginal-likelihood tuning of the prior).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LowRankPlusDiagonal"]


@dataclass
class LowRankPlusDiagonal:
    """The precision ``U diag(λ) Uᵀ + diag(d)`` (module documentation).

    Attributes:
        U: ``[P, k]``, orthonormal columns.
        eigenvalues: ``λ`` ``[k]``, non-negative.
        diagonal: ``d`` ``[P]``, positive.

    Raises:
        ValueError: For mismatched shapes, negative ``λ`` or non-positive ``d``.
    """

    U: Tensor
    eigenvalues: Tensor
    diagonal: Tensor

    def __post_init__(self) -> None:
        P, k = self.U.shape
        if self.eigenvalues.shape != (k,) or self.diagonal.shape != (P,):
            raise ValueError(
                f"U {tuple(self.U.shape)}, eigenvalues {tuple(self.eigenvalues.shape)} and "
                f"diagonal {tuple(self.diagonal.shape)} do not fit: expected [P, k], [k], [P]"
            )
        if bool((self.eigenvalues < 0).any()):
            raise ValueError(
                f"eigenvalues must be ≥ 0, got minimum {float(self.eigenvalues.min())}"
            )
        if not bool((self.diagonal > 0).all()):
            raise ValueError(
                f"the diagonal must be positive (a positive prior precision), got minimum "
                f"{float(self.diagonal.min())}"
            )

    def _W(self) -> Tensor:
        return self.U * self.eigenvalues.sqrt() / self.diagonal.sqrt().unsqueeze(1)

    def _cholesky(self) -> tuple[Tensor, Tensor]:
        W = self._W()
        M = torch.eye(W.shape[1], dtype=W.dtype, device=W.device) + W.T @ W
        return W, torch.linalg.cholesky(M)

    def factor(self) -> Tensor:
        """``B`` ``[P, k]`` with ``Σ = diag(1/d) − B Bᵀ`` (Woodbury, exact).

        Returns:
            ``B``, ``[P, k]``.
        """
        W, L = self._cholesky()
        WL = torch.linalg.solve_triangular(L, W.T, upper=False).T  # W L^{-T}
        return WL / self.diagonal.sqrt().unsqueeze(1)

    def log_det(self) -> Tensor:
        """``log det P = Σ_i log d_i + log det(I + Wᵀ W)``, ``W = diag(d)^{-½} U diag(λ)^{½}``.

        Exact (matrix-determinant lemma, a ``k × k`` Cholesky factor).

        Returns:
            The scalar ``log det P``.
        """
        _, L = self._cholesky()
        return self.diagonal.log().sum() + 2 * L.diagonal().log().sum()

    def variance(self) -> Tensor:
        """The marginal posterior variances ``diag Σ = 1/d − rowsum(B²)`` (exact).

        Returns:
            ``[P]``.
        """
        return 1 / self.diagonal - self.factor().square().sum(1)

    def covariance(self) -> Tensor:
        """The dense ``Σ`` ``[P, P]`` (small ``P`` only: ``P²`` numbers).

        Returns:
            ``Σ = P⁻¹``, ``[P, P]``.
        """
        B = self.factor()
        return torch.diag(1 / self.diagonal) - B @ B.T

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """``J Σ Jᵀ`` per sample, without forming ``Σ``.

        Args:
            Js: Jacobians of the outputs w.r.t. the parameters, ``[N, C, P]``.

        Returns:
            ``[N, C, C]``.
        """
        JB = Js @ self.factor()
        return (Js / self.diagonal) @ Js.transpose(1, 2) - JB @ JB.transpose(1, 2)

    def square_norm(self, delta: Tensor) -> Tensor:
        """``Δᵀ P Δ = Σ_j λ_j (u_jᵀ Δ)² + Σ_i d_i Δ_i²``.

        Args:
            delta: ``Δ``, ``[P]`` or ``[n, P]`` (one value per row).

        Returns:
            A scalar, or ``[n]``.
        """
        projected = delta @ self.U
        return (projected.square() * self.eigenvalues).sum(-1) + (
            delta.square() * self.diagonal
        ).sum(-1)
