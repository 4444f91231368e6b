r"""The top eigenpairs of a symmetric positive semi-definite operator from its products.

:func:`lanczos` runs ``m`` Lanczos steps with full reorthogonalisation (classical Gram-Schmidt,
twice per step): an orthonormal Krylov basis ``Q = [q_1 … q_m]`` ``[P, m]`` and the tridiagonal
``T = Qᵀ G Q`` ``[m, m]``; the Ritz pairs ``(θ_i, Q s_i)`` of ``T = S diag(θ) Sᵀ`` approximate the
extreme eigenpairs of ``G``, the largest first, with residuals
``‖G Q s_i − θ_i Q s_i‖ = β_m |s_{m,i}|`` known without another product. One product per step,
one vector of ``P`` numbers stored per step.

Why Lanczos rather than a randomized SVD or block power iteration: every product is a full pass
over the data, and for a given number of products the Krylov space of Lanczos contains the
power-iteration and randomized-range subspaces of the same start vectors (the best polynomial
filter instead of a fixed power), so it resolves the top eigenpairs of the fast-decaying GGN
spectra of trained networks with the fewest passes (Golub & Van Loan, Matrix Computations,
§10.1; Halko et al., SIAM Review 2011, §4.5 and §6). The block methods' advantage, several
vectors per forward pass, would need ``vmap`` over the network, which not every module
supports; full reorthogonalisation keeps the basis orthonormal to round-off at ``O(P m²)``
arithmetic, small beside ``m`` passes over the data.

:func:`deflated_trace` estimates ``tr G`` for the rank rule of :func:`choose_rank`: exactly
``tr(Qᵀ G Q) = Σ_j T_jj`` on the Krylov space, plus Hutchinson's estimate on its orthogonal
complement (Rademacher probes projected off ``Q``; the top of the spectrum, which dominates the
variance of plain Hutchinson, is deflated as in Hutch++, Meyer et al., SOSA 2021).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "LanczosResult",
    "TraceEstimate",
    "choose_rank",
    "deflated_trace",
    "lanczos",
    "noise_floor",
]


def noise_floor(dtype: torch.dtype) -> float:
    """``10 ε`` of ``dtype``: relative size below which a residual or eigenvalue is round-off.

    A GGN-vector product in ``dtype`` carries errors of about ``ε λ₁`` (``λ₁`` the largest
    eigenvalue), so eigenvalues below ``10 ε λ₁`` (float32: ``1.2·10⁻⁶ λ₁``; float64:
    ``2·10⁻¹⁵ λ₁``) cannot be resolved from them, and a Lanczos residual below it means the
    Krylov space is invariant to working precision.
    """
    return 10 * torch.finfo(dtype).eps


@dataclass
class LanczosResult:
    """Ritz pairs of ``G`` from :func:`lanczos`, the largest eigenvalue first.

    Attributes:
        eigenvalues: Ritz values ``θ`` ``[m]``, descending.
        eigenvectors: Ritz vectors ``Q S`` ``[P, m]`` (orthonormal columns).
        residuals: ``‖G u_i − θ_i u_i‖`` ``[m]`` per pair.
        basis: The Krylov basis ``Q`` ``[P, m]``.
        diagonal: ``T``'s diagonal ``qᵢᵀ G qᵢ`` ``[m]`` (its sum is ``tr(Qᵀ G Q)``).
        steps: ``m``, the products taken (fewer than asked where the Krylov space became
            invariant: ``G`` then has no further eigenvalue along the start vector).
    """

    eigenvalues: Tensor
    eigenvectors: Tensor
    residuals: Tensor
    basis: Tensor
    diagonal: Tensor
    steps: int


def lanczos(
    matvec: Callable[[Tensor], Tensor],
    dim: int,
    steps: int,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> LanczosResult:
    """``steps`` Lanczos steps with full reorthogonalisation on a symmetric ``matvec``.

    Args:
        matvec: ``v ↦ G v``, ``[P] → [P]``, ``G`` symmetric.
        dim: ``P``.
        steps: Products to take, ``1 ≤ steps ≤ P``.
        dtype: Of the basis and the start vector.
        device: Of the basis.
        generator: For the Gaussian start vector (on ``device``).

    Returns:
        :class:`LanczosResult`.

    Raises:
        ValueError: For ``steps`` outside ``[1, P]``, or a ``matvec`` giving non-finite values.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= dim:
        raise ValueError(f"steps must be an int in [1, {dim}] (the dimension), got {steps!r}")
    q = torch.randn(dim, dtype=dtype, device=device, generator=generator)
    q = q / q.norm()
    basis = torch.empty(steps, dim, dtype=dtype, device=device)
    alphas, betas = [], []
    scale = 0.0
    for j in range(steps):
        basis[j] = q
        w = matvec(q).to(dtype)
        if not bool(torch.isfinite(w).all()):
            raise ValueError(
                f"the GGN product of Lanczos step {j + 1} has non-finite values: the loss or "
                "network overflows at these parameters (or holds NaN); check the model and data"
            )
        alpha = torch.dot(w, q)
        w = w - alpha * q - (betas[-1] * basis[j - 1] if j else 0)
        for _ in range(2):  # "twice is enough" (Parlett): orthogonal to round-off
            w = w - basis[: j + 1].T @ (basis[: j + 1] @ w)
        beta = w.norm()
        alphas.append(alpha)
        scale = max(scale, float(alpha.abs()), float(beta))
        betas.append(beta)
        if float(beta) <= noise_floor(dtype) * scale:
            break  # invariant Krylov space: no further eigenvalue along the start vector
        q = w / beta
    m = len(alphas)
    Q = basis[:m]
    T = torch.diag(torch.stack(alphas))
    if m > 1:
        off = torch.stack(betas[: m - 1])
        T = T + torch.diag(off, 1) + torch.diag(off, -1)
    theta, S = torch.linalg.eigh(T)
    theta, S = theta.flip(0), S.flip(1)
    residuals = betas[-1] * S[-1].abs()
    return LanczosResult(theta, Q.T @ S, residuals, Q.T, torch.stack(alphas), m)


@dataclass
class TraceEstimate:
    """``tr G`` from :func:`deflated_trace`.

    Attributes:
        value: The estimate.
        standard_error: Its standard error over the probes (``0`` without probes, then ``value``
            is the trace on the Krylov space only, a lower bound).
        krylov: ``tr(Qᵀ G Q)``, exact.
        probes: The number of probes.
    """

    value: float
    standard_error: float
    krylov: float
    probes: int


def deflated_trace(
    matvec: Callable[[Tensor], Tensor],
    result: LanczosResult,
    probes: int,
    generator: torch.Generator | None = None,
) -> TraceEstimate:
    """``tr G = tr(Qᵀ G Q) + tr((I − QQᵀ) G (I − QQᵀ))``, the second by Hutchinson's estimator.

    ``probes`` Rademacher vectors ``z`` projected off the Krylov basis, ``z' = z − Q Qᵀ z``:
    ``E[z'ᵀ G z'] = tr((I − QQᵀ) G (I − QQᵀ))``, one product each.

    Args:
        matvec: As for :func:`lanczos`.
        result: The Lanczos run whose basis is deflated.
        probes: Number of probes (``0``: the Krylov part only).
        generator: For the probes (on the basis's device).

    Returns:
        The :class:`TraceEstimate`: the estimate, its standard error and the exact Krylov
        part.

    Raises:
        ValueError: For a negative number of probes.
    """
    if isinstance(probes, bool) or not isinstance(probes, int) or probes < 0:
        raise ValueError(f"probes must be an int ≥ 0, got {probes!r}")
    Q = result.basis
    krylov = float(result.diagonal.sum())
    if probes == 0 or Q.shape[1] == Q.shape[0]:
        return TraceEstimate(krylov, 0.0, krylov, 0)
    samples = []
    for _ in range(probes):
        z = torch.randint(0, 2, (Q.shape[0],), generator=generator, device=Q.device)
        z = 2 * z.to(Q.dtype) - 1
        z = z - Q @ (Q.T @ z)
        samples.append(float(torch.dot(z, matvec(z).to(Q.dtype))))
    rest = sum(samples) / probes
    spread = math.sqrt(sum((s - rest) ** 2 for s in samples) / (probes - 1)) if probes > 1 else 0.0
    return TraceEstimate(krylov + rest, spread / math.sqrt(probes), krylov, probes)


def choose_rank(eigenvalues: Tensor, trace: float, energy: float) -> int:
    """The smallest ``k`` with ``Σ_{i≤k} λ_i ≥ energy · trace``; all of them if none reaches it.

    Args:
        eigenvalues: ``[m]``, descending, non-negative.
        trace: ``tr G`` (e.g. :func:`deflated_trace`).
        energy: The fraction, in ``(0, 1]``.

    Returns:
        The number of leading eigenpairs to keep, in ``[1, m]`` (``m`` when no prefix reaches
        the fraction).

    Raises:
        ValueError: For ``energy`` outside ``(0, 1]``.
    """
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must lie in (0, 1], got {energy!r}")
    captured = eigenvalues.cumsum(0)
    reached = (captured >= energy * trace).nonzero()
    return int(reached[0]) + 1 if len(reached) else len(eigenvalues)
