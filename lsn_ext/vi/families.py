"""The variational families: :class:`StructuredGaussian`, :class:`GaussianMixture`, the ELBO.

A family is an ``nn.Module`` over ``ℝ^P`` whose parameters are the variational parameters: its
moments, its density ``log q(θ)`` (Woodbury and the matrix-determinant lemma, never a ``P×P``
matrix), reparametrised draws in the three sampling modes, and the stratified draws that
:func:`elbo` averages over. The maths and the sampling modes are described in
:mod:`lsn_ext.vi`; :func:`gaussian_kl` compares a family with a dense Gaussian (small ``P``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lsn_ext._memory import check_sample_memory

__all__ = [
    "LOG_2PI",
    "MODES",
    "Family",
    "GaussianMixture",
    "SampleMode",
    "StructuredGaussian",
    "elbo",
    "gaussian_kl",
]

SampleMode = Literal["single", "paired", "unscented"]
MODES = ("single", "paired", "unscented")
LOG_2PI = math.log(2 * math.pi)


def _inverse_softplus(x: Tensor) -> Tensor:
    """``softplus⁻¹(x) = log(eˣ − 1)``, stable for large ``x``."""
    return x + torch.log(-torch.expm1(-x))


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _group_size(mode: str, rank: int) -> int:
    """Number of coupled draws per group: 1 (single), 2 (paired), ``2 max(r, 1)`` (unscented)."""
    return {"single": 1, "paired": 2, "unscented": 2 * max(rank, 1)}[mode]


class StructuredGaussian(nn.Module):
    """Gaussian ``N(μ, diag(a) + U Uᵀ)`` over ``ℝ^P`` with ``U ∈ ℝ^{P×r}``.

    Parameters (``nn.Parameter``, trained by any optimizer): ``loc`` ``[P]``, ``raw_diag``
    ``[P]`` with ``a = softplus(raw_diag) + min_variance``, and ``factor`` ``U`` ``[P, r]``
    (absent for ``r = 0``, the mean-field family).

    Args:
        loc: Initial mean ``μ``, ``[P]`` (copied).
        rank: ``r ≥ 0``, the number of low-rank directions.
        init_std: Initial ``√a`` (scalar or ``[P]``).
        init_factor_std: Standard deviation of the random initial entries of ``U`` (default
            ``init_std / √r``, so that ``UUᵀ`` starts comparable to ``diag(a)``). ``U = 0`` is a
            stationary point of the ELBO, hence a random start.
        min_variance: Floor added to ``a`` (keeps the Woodbury solves well conditioned).
        generator: Random generator for the initial ``U``.

    Raises:
        ValueError: For a ``loc`` that is not 1-D, a negative rank or non-positive ``init_std``.
    """

    def __init__(
        self,
        loc: Tensor,
        rank: int = 0,
        *,
        init_std: float | Tensor = 1e-3,
        init_factor_std: float | None = None,
        min_variance: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        loc = torch.as_tensor(loc)
        if loc.dim() != 1:
            raise ValueError(f"loc must be a flat vector [P], got shape {tuple(loc.shape)}")
        if not torch.isfinite(loc).all():
            raise ValueError("loc (the initial mean, e.g. the model's weights) holds NaN or inf")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        if rank > loc.numel():
            raise ValueError(
                f"rank {rank} exceeds the number of parameters P = {loc.numel()}: the factor "
                f"U [P, rank] would hold {loc.numel() * rank:,} numbers and add no freedom past "
                "rank P; use a rank of at most P (in practice 1–100)"
            )
        init_std = torch.as_tensor(init_std, dtype=loc.dtype, device=loc.device)
        if not torch.isfinite(init_std).all() or (init_std <= 0).any():
            raise ValueError(f"init_std must be finite and positive, got {init_std}")
        if not math.isfinite(min_variance) or min_variance < 0:
            raise ValueError(f"min_variance must be finite and non-negative, got {min_variance}")
        self.n_params, self.rank, self.min_variance = loc.numel(), rank, float(min_variance)
        self.loc = nn.Parameter(loc.detach().clone())
        variance = (init_std**2 - min_variance).clamp_min(1e-30).expand(self.n_params)
        self.raw_diag = nn.Parameter(_inverse_softplus(variance.clone()))
        if rank > 0:
            std = (
                init_factor_std
                if init_factor_std is not None
                else float(init_std.max()) / (math.sqrt(rank))
            )
            U = torch.randn(
                self.n_params, rank, generator=generator, dtype=loc.dtype, device=loc.device
            )
            self.factor = nn.Parameter(U * std)
        else:
            self.register_parameter("factor", None)

    # -- moments ------------------------------------------------------------------------------

    @property
    def diag(self) -> Tensor:
        """``a = softplus(raw_diag) + min_variance``, ``[P]`` (differentiable)."""
        return F.softplus(self.raw_diag) + self.min_variance

    @property
    def mean(self) -> Tensor:
        """``μ``, ``[P]`` (differentiable)."""
        return self.loc

    @property
    def variance(self) -> Tensor:
        """Marginal variances ``diag Σ = a + Σ_k U_{ik}²``, ``[P]`` (differentiable)."""
        if self.factor is None:
            return self.diag
        return self.diag + self.factor.pow(2).sum(1)

    def dense_covariance(self) -> Tensor:
        """``Σ = diag(a) + UUᵀ``, ``[P, P]``: ``O(P²)`` memory, for checks on small ``P`` only.

        Returns:
            The dense covariance ``[P, P]`` (differentiable).
        """
        cov = torch.diag(self.diag)
        return cov if self.factor is None else cov + self.factor @ self.factor.T

    def _capacitance_cholesky(self) -> tuple[Tensor, Tensor | None]:
        """``(a, L)`` with ``L Lᵀ = C = I_r + Uᵀ D⁻¹ U`` (``None`` for mean-field)."""
        a = self.diag
        if self.factor is None:
            return a, None
        U = self.factor
        C = U.T @ (U / a[:, None])
        C = C + torch.eye(self.rank, dtype=C.dtype, device=C.device)
        return a, torch.linalg.cholesky(C)

    def logdet(self) -> Tensor:
        """``log |Σ| = Σ_i log a_i + log |C|`` (matrix-determinant lemma), a scalar.

        ``C = I_r + Uᵀ diag(a)⁻¹ U`` is the ``r × r`` capacitance matrix; exact, without forming
        ``Σ``.

        Returns:
            The scalar ``log |Σ|`` (differentiable).
        """
        a, L = self._capacitance_cholesky()
        out = a.log().sum()
        return out if L is None else out + 2 * L.diagonal().log().sum()

    def solve(self, rhs: Tensor) -> Tensor:
        """``Σ⁻¹ rhs`` by Woodbury, ``Σ⁻¹ = D⁻¹ − D⁻¹ U C⁻¹ Uᵀ D⁻¹`` with ``D = diag(a)``.

        Exact; costs ``O(P r k + r³)`` and never forms a ``P × P`` matrix.

        Args:
            rhs: Right-hand side, ``[P]`` or ``[P, k]``.

        Returns:
            ``Σ⁻¹ rhs``, shaped like ``rhs``.
        """
        a, L = self._capacitance_cholesky()
        vec = rhs.dim() == 1
        R = rhs[:, None] if vec else rhs
        out = R / a[:, None]
        if L is not None:
            w = torch.cholesky_solve(self.factor.T @ out, L)  # C⁻¹ Uᵀ D⁻¹ R, [r, k]
            out = out - (self.factor @ w) / a[:, None]
        return out[:, 0] if vec else out

    def log_prob(self, theta: Tensor) -> Tensor:
        """The Gaussian log-density ``log q(θ)``, evaluated exactly without forming ``Σ``.

        ``log q(θ) = −½ [P log 2π + log |Σ| + (θ − μ)ᵀ Σ⁻¹ (θ − μ)]``, the quadratic form by
        Woodbury and ``log |Σ|`` by the matrix-determinant lemma (see :meth:`solve`,
        :meth:`logdet`); ``O(P r)`` per draw.

        Args:
            theta: Parameter vectors, ``[*, P]`` (any leading batch axes).

        Returns:
            ``[*]`` log-densities, differentiable in ``θ`` and in the variational parameters.
        """
        a, L = self._capacitance_cholesky()
        d = theta - self.loc
        maha = (d * d / a).sum(-1)
        logdet = a.log().sum()
        if L is not None:
            w = (d / a) @ self.factor  # [*, r]
            v = torch.linalg.solve_triangular(L, w.unsqueeze(-1), upper=False).squeeze(-1)
            maha = maha - v.pow(2).sum(-1)
            logdet = logdet + 2 * L.diagonal().log().sum()
        return -0.5 * (self.n_params * LOG_2PI + logdet + maha)

    def entropy(self) -> Tensor:
        """Closed form ``H = ½ (P (1 + log 2π) + log |Σ|)``, a scalar.

        Returns:
            The scalar entropy in nats (differentiable).
        """
        return 0.5 * (self.n_params * (1 + LOG_2PI) + self.logdet())

    # -- sampling -----------------------------------------------------------------------------

    def _noise(
        self, n: int, mode: str, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor | None]:
        """Standard noise ``(ε [n, P], z [n, r])`` coupled according to ``mode``."""
        _check_mode(mode)
        g = _group_size(mode, self.rank)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n % g:
            raise ValueError(
                f"mode {mode!r} draws groups of {g} coupled samples (rank {self.rank}); "
                f"n must be a positive multiple of {g}, got {n}"
            )
        P, r = self.n_params, self.rank
        check_sample_memory(
            "n_samples/n",
            n,
            P + r,
            self.loc,
            "use fewer draws (the ELBO's default is 2 per step), or draw in smaller batches",
        )
        kw = {"dtype": self.loc.dtype, "device": self.loc.device, "generator": generator}
        if mode == "single":
            eps = torch.randn(n, P, **kw)
            return eps, torch.randn(n, r, **kw) if r else None
        n_groups, half = n // g, g // 2
        eps = torch.randn(n_groups, half, P, **kw)
        if r == 0:
            z = None
        elif mode == "paired":
            z = torch.randn(n_groups, 1, r, **kw)
        else:
            Q, R = torch.linalg.qr(torch.randn(n_groups, r, r, **kw))
            Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar
            radius = torch.randn(n_groups, 1, r, **kw).norm(dim=-1, keepdim=True)  # χ_r
            z = Q.transpose(-2, -1) * radius  # rows z_j = ρ Q e_j, [groups, r, r]
        eps = torch.cat([eps, -eps], 1).reshape(n, P)
        if z is not None:
            z = torch.cat([z, -z], 1).reshape(n, r)
        return eps, z

    def rsample(
        self, n: int, mode: SampleMode = "single", generator: torch.Generator | None = None
    ) -> Tensor:
        """Reparametrised draws ``θ = μ + √a ⊙ ε + U z``, ``[n, P]``, differentiable in ``ψ``.

        Args:
            n: Number of draws; a multiple of 2 (``"paired"``) or ``2r`` (``"unscented"``).
            mode: ``"single"``, ``"paired"`` or ``"unscented"`` (see :mod:`lsn_ext.vi`).
            generator: Random generator.

        Returns:
            ``[n, P]`` draws, differentiable in the variational parameters.

        Raises:
            ValueError: For an unknown mode, an ``n`` that does not fill whole groups, or more
                draws than the device's memory holds (naming the memory they need).
        """
        eps, z = self._noise(n, mode, generator)
        theta = self.loc + eps * self.diag.sqrt()
        return theta if z is None else theta + z @ self.factor.T

    @torch.no_grad()
    def sample(
        self, n: int, generator: torch.Generator | None = None, mode: SampleMode = "single"
    ) -> Tensor:
        """Draws without gradient, ``[n, P]`` (see :meth:`rsample`).

        Args:
            n: Number of draws; a multiple of 2 (``"paired"``) or ``2r`` (``"unscented"``).
            generator: Random generator.
            mode: ``"single"``, ``"paired"`` or ``"unscented"`` (see :mod:`lsn_ext.vi`).

        Returns:
            ``[n, P]`` draws, detached from the variational parameters.

        Raises:
            ValueError: As :meth:`rsample`.
        """
        return self.rsample(n, mode, generator)

    def _stratified(
        self, n: int, mode: str, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        """``(θ [1, n, P], weights [1])`` for the ELBO estimator."""
        return self.rsample(n, mode, generator)[None], self.loc.new_ones(1)


class GaussianMixture(nn.Module):
    """Mixture ``q(θ) = Σ_c π_c N(θ; μ_c, diag(a_c) + U_c U_cᵀ)`` with ``π = softmax(logits)``.

    Args:
        loc: Initial mean ``[P]``, shared by the components before ``jitter``.
        n_components: ``K ≥ 1`` components.
        rank: Rank ``r`` of every component.
        init_std: Initial ``√a`` of every component.
        jitter: Standard deviation of the Gaussian noise added to each component's initial mean
            (default ``init_std``): identical components would stay identical under the ELBO.
        min_variance: See :class:`StructuredGaussian`.
        generator: Random generator for the initial means and factors.

    Raises:
        ValueError: For ``n_components < 1`` and as :class:`StructuredGaussian`.
    """

    def __init__(
        self,
        loc: Tensor,
        n_components: int = 2,
        rank: int = 0,
        *,
        init_std: float = 1e-3,
        jitter: float | None = None,
        min_variance: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        if not isinstance(n_components, int) or n_components < 1:
            raise ValueError(f"n_components must be a positive int, got {n_components!r}")
        loc = torch.as_tensor(loc)
        jitter = init_std if jitter is None else jitter
        if not math.isfinite(jitter) or jitter < 0:
            raise ValueError(f"jitter must be finite and non-negative, got {jitter}")
        self.components = nn.ModuleList(
            StructuredGaussian(
                loc
                + jitter
                * torch.randn(loc.shape, generator=generator, dtype=loc.dtype, device=loc.device),
                rank,
                init_std=init_std,
                min_variance=min_variance,
                generator=generator,
            )
            for _ in range(n_components)
        )
        self.logits = nn.Parameter(torch.zeros(n_components, dtype=loc.dtype, device=loc.device))
        self.n_params, self.rank, self.n_components = loc.numel(), rank, n_components

    @property
    def weights(self) -> Tensor:
        """``π = softmax(logits)``, ``[K]``."""
        return torch.softmax(self.logits, 0)

    @property
    def mean(self) -> Tensor:
        """``E θ = Σ_c π_c μ_c``, ``[P]``."""
        return torch.einsum("c,cp->p", self.weights, torch.stack([c.loc for c in self.components]))

    @property
    def variance(self) -> Tensor:
        """Marginal variances of the mixture, ``Σ_c π_c (diag Σ_c + μ_c²) − (E θ)²``, ``[P]``."""
        pi = self.weights
        second = sum(p * (c.variance + c.loc**2) for p, c in zip(pi, self.components, strict=True))
        return (second - self.mean**2).clamp_min(0)

    def log_prob(self, theta: Tensor) -> Tensor:
        """``log q(θ) = logsumexp_c (log π_c + log N_c(θ))``, exact.

        Args:
            theta: Parameter vectors, ``[*, P]``.

        Returns:
            ``[*]`` log-densities, differentiable.
        """
        logs = torch.stack([c.log_prob(theta) for c in self.components], -1)
        return torch.logsumexp(logs + torch.log_softmax(self.logits, 0), -1)

    def entropy(self, n_samples: int = 256, generator: torch.Generator | None = None) -> Tensor:
        """Stratified Monte Carlo estimate ``Ĥ = −Σ_c π_c (1/S) Σ_s log q(θ_cs)``, ``θ_cs ~ q_c``.

        Unbiased (no closed form exists for a Gaussian mixture); its standard error decreases
        as ``1/√S``. It always lies in ``[Σ_c π_c H_c, Σ_c π_c H_c + H(π)]`` in expectation.

        Args:
            n_samples: Draws ``S`` per component (antithetic pairs; rounded up to even).
            generator: Random generator.

        Returns:
            The scalar estimate in nats, differentiable in the variational parameters.
        """
        n = n_samples + n_samples % 2
        theta, pi = self._stratified(n, "paired", generator)
        return -(pi * self.log_prob(theta).mean(1)).sum()

    def _stratified(
        self, n: int, mode: str, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        """``(θ [K, n, P], π [K])``: ``n`` draws from every component."""
        theta = torch.stack([c.rsample(n, mode, generator) for c in self.components])
        return theta, self.weights

    def rsample(
        self, n: int, mode: SampleMode = "single", generator: torch.Generator | None = None
    ) -> Tensor:
        """Draws ``[n, P]``: component counts from ``Multinomial(n, π)``, then per component.

        Not differentiable in ``π`` (the ELBO uses stratified draws instead). ``mode`` couples
        the draws within a component; for ``"paired"`` / ``"unscented"`` the counts are rounded
        to whole groups, so the realised proportions differ from ``π`` by at most a group.

        Args:
            n: Number of draws; a multiple of 2 (``"paired"``) or ``2r`` (``"unscented"``).
            mode: ``"single"``, ``"paired"`` or ``"unscented"`` (see :mod:`lsn_ext.vi`).
            generator: Random generator (component counts, then draws).

        Returns:
            ``[n, P]`` draws, grouped by component (differentiable in the components'
            parameters, not in ``π``).

        Raises:
            ValueError: For an unknown mode or an ``n`` that does not fill whole groups.
        """
        _check_mode(mode)
        g = _group_size(mode, self.rank)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n % g:
            raise ValueError(f"n must be a positive multiple of {g} for mode {mode!r}, got {n}")
        groups = torch.multinomial(
            self.weights.detach(), n // g, replacement=True, generator=generator
        )
        counts = torch.bincount(groups, minlength=self.n_components) * g
        draws = [
            c.rsample(int(k), mode, generator)
            for c, k in zip(self.components, counts, strict=True)
            if k > 0
        ]
        return torch.cat(draws)

    @torch.no_grad()
    def sample(
        self, n: int, generator: torch.Generator | None = None, mode: SampleMode = "single"
    ) -> Tensor:
        """Draws without gradient, ``[n, P]`` (see :meth:`rsample`), grouped by component.

        Args:
            n: Number of draws; a multiple of 2 (``"paired"``) or ``2r`` (``"unscented"``).
            generator: Random generator.
            mode: ``"single"``, ``"paired"`` or ``"unscented"`` (see :mod:`lsn_ext.vi`).

        Returns:
            ``[n, P]`` draws, detached from the variational parameters.

        Raises:
            ValueError: As :meth:`rsample`.
        """
        return self.rsample(n, mode, generator)


Family = StructuredGaussian | GaussianMixture


def elbo(
    q: Family,
    log_joint: Callable[[Tensor], Tensor],
    n_samples: int = 2,
    mode: SampleMode = "paired",
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Monte Carlo ELBO ``Σ_c π_c (1/S) Σ_s [log p̃(θ_cs) − log q(θ_cs)]``, ``θ_cs ~ q_c``.

    Uses ``log q`` of the drawn samples (not the closed-form entropy), as the paper advocates.
    For a single Gaussian ``c`` takes one value and ``π = 1``.

    Args:
        q: The variational family.
        log_joint: ``θ [S, P] ↦ log p̃(θ) [S]``, the unnormalised log posterior.
        n_samples: ``S`` draws per component (a multiple of the mode's group size).
        mode: Sampling mode.
        generator: Random generator.

    Returns:
        The scalar estimate, differentiable in ``q``'s parameters; maximise it.
    """
    theta, pi = q._stratified(n_samples, mode, generator)
    K, S, P = theta.shape
    values = log_joint(theta.reshape(K * S, P)) - q.log_prob(theta.reshape(K * S, P))
    return (pi * values.reshape(K, S).mean(1)).sum()


def gaussian_kl(mean_p: Tensor, cov_p: Tensor, q: StructuredGaussian) -> Tensor:
    """``KL[p ‖ q]`` from a dense Gaussian ``p = N(m, S)`` to a :class:`StructuredGaussian`.

    ``½ [tr(Σ_q⁻¹ S) + (μ_q − m)ᵀ Σ_q⁻¹ (μ_q − m) − P + log |Σ_q| − log |S|]`` with ``Σ_q⁻¹``
    applied by Woodbury (``S`` is ``[P, P]``, so this is for small ``P``).

    Args:
        mean_p: ``m``, the mean of ``p``, ``[P]``.
        cov_p: ``S``, the covariance of ``p``, ``[P, P]`` (positive definite).
        q: The structured Gaussian ``q``.

    Returns:
        The scalar KL divergence in nats (differentiable in ``q``'s parameters).
    """
    d = q.loc - mean_p
    trace = torch.trace(q.solve(cov_p))
    return 0.5 * (trace + d @ q.solve(d) - q.n_params + q.logdet() - torch.logdet(cov_p))
