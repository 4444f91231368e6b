"""Structured variational inference over a network's parameters (Le Folgoc et al. 2021).

Variational families over the ``P`` trainable parameters of any ``nn.Module`` (the network is
run with sampled parameters through ``torch.func.functional_call``; it is never rewritten):

* :class:`StructuredGaussian`: ``q(θ) = N(μ, Σ)``, ``Σ = diag(a) + U Uᵀ`` with ``a > 0``
  (``softplus`` of a free parameter) and ``U ∈ ℝ^{P×r}`` shared across all layers, so the
  low-rank part couples parameters within and across layers. ``r = 0`` is mean-field.
* :class:`GaussianMixture`: ``q(θ) = Σ_c π_c N(θ; μ_c, Σ_c)`` with structured components of a
  common rank and weights ``π = softmax(logits)``.

Densities never form a ``P×P`` matrix. With ``D = diag(a)``, the capacitance
``C = I_r + Uᵀ D⁻¹ U`` (``r×r``) and ``d = θ − μ``:

* Woodbury: ``dᵀ Σ⁻¹ d = dᵀ D⁻¹ d − wᵀ C⁻¹ w`` with ``w = Uᵀ D⁻¹ d``;
* matrix-determinant lemma: ``log |Σ| = Σ_i log a_i + log |C|``;
* ``log q(θ) = −½ (P log 2π + log |Σ| + dᵀ Σ⁻¹ d)``, entropy ``½ (P (1 + log 2π) + log |Σ|)``.

Cost per density evaluation ``O(P r + r³)``; per sample ``O(P r)``.

Sampling is reparametrised, ``θ = μ + √a ⊙ ε + U z`` with ``ε ~ N(0, I_P)``, ``z ~ N(0, I_r)``,
in three modes (the paper's §4):

* ``"single"``: independent draws.
* ``"paired"`` (antithetic): draws come in mirrored pairs ``μ ± (√a ⊙ ε + U z)``.
* ``"unscented"``: groups of ``2r`` draws (2 for mean-field): a Haar-random orthogonal
  ``Q ∈ O(r)`` and one radius ``ρ ~ χ_r`` give ``z_j = ρ Q e_j`` for ``j = 1..r`` (orthogonal
  directions in the low-rank subspace, of common length), each with its own ``ε_j``, followed by
  the ``r`` mirrors ``μ − (√a ⊙ ε_j + U z_j)``. Every draw is still exactly ``N(μ, Σ)``
  (``ρ Q e_j ~ N(0, I_r)``), so Monte Carlo estimates stay unbiased, while each group has mean
  exactly ``μ`` and low-rank second moment ``(1/2r) Σ_j z_j z_jᵀ = (ρ²/r) I_r`` (isotropic).

Objective: the ELBO ``E_q[log p(Y | X, θ) + log p(θ) − log q(θ)]`` estimated, as the paper
advocates, with ``log q`` of the drawn samples rather than the closed-form entropy (scaling
effects of a draw then affect all terms alike). Mixtures use stratified sampling,
``Σ_c π_c E_{q_c}[·]``, which is exact and differentiable in ``π``.

:class:`VariationalPosterior` wraps a model: its ``sample``, ``mean``, ``posterior_variance``,
``model``, ``n_params`` and ``link`` are what :func:`lsn_ext.predict`,
:func:`lsn_ext.linearized_variance` and the Laplace Bridge read from a Laplace posterior.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap

from lsn_ext._functional import functional_call_all, unflatten
from lsn_ext._memory import check_sample_memory
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy, Loss, as_loss

__all__ = [
    "GaussianMixture",
    "SampleMode",
    "StructuredGaussian",
    "VariationalPosterior",
    "elbo",
    "gaussian_kl",
]

SampleMode = Literal["single", "paired", "unscented"]
_MODES = ("single", "paired", "unscented")
_LOG_2PI = math.log(2 * math.pi)


def _inverse_softplus(x: Tensor) -> Tensor:
    """``softplus⁻¹(x) = log(eˣ − 1)``, stable for large ``x``."""
    return x + torch.log(-torch.expm1(-x))


def _positive_finite(name: str, value: object) -> float:
    """``float(value)`` for a finite positive real number; otherwise a clear error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        else:
            raise TypeError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, got {value!r}")
    return float(value)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_batch(x: object, y: object) -> None:
    """Refuse non-tensor, empty or non-finite batches (they would turn the ELBO into NaN)."""
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, Tensor):
            raise TypeError(f"batches must be (x, y) tensors; {name} is a {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"{name} must be a non-empty batch [B, ...], got {tuple(t.shape)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} holds NaN or infinite values; clean or mask "
                "them before fitting"
            )


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")


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
        """``Σ = diag(a) + UUᵀ``, ``[P, P]``: ``O(P²)`` memory, for checks on small ``P`` only."""
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
        """``log |Σ| = Σ_i log a_i + log |C|`` (matrix-determinant lemma), a scalar."""
        a, L = self._capacitance_cholesky()
        out = a.log().sum()
        return out if L is None else out + 2 * L.diagonal().log().sum()

    def solve(self, rhs: Tensor) -> Tensor:
        """``Σ⁻¹ rhs`` (Woodbury: ``D⁻¹ − D⁻¹ U C⁻¹ Uᵀ D⁻¹``) for ``rhs`` ``[P]`` or ``[P, k]``."""
        a, L = self._capacitance_cholesky()
        vec = rhs.dim() == 1
        R = rhs[:, None] if vec else rhs
        out = R / a[:, None]
        if L is not None:
            w = torch.cholesky_solve(self.factor.T @ out, L)  # C⁻¹ Uᵀ D⁻¹ R, [r, k]
            out = out - (self.factor @ w) / a[:, None]
        return out[:, 0] if vec else out

    def log_prob(self, theta: Tensor) -> Tensor:
        """``log q(θ)`` for ``θ`` ``[*, P]``, returns ``[*]`` (Woodbury + determinant lemma)."""
        a, L = self._capacitance_cholesky()
        d = theta - self.loc
        maha = (d * d / a).sum(-1)
        logdet = a.log().sum()
        if L is not None:
            w = (d / a) @ self.factor  # [*, r]
            v = torch.linalg.solve_triangular(L, w.unsqueeze(-1), upper=False).squeeze(-1)
            maha = maha - v.pow(2).sum(-1)
            logdet = logdet + 2 * L.diagonal().log().sum()
        return -0.5 * (self.n_params * _LOG_2PI + logdet + maha)

    def entropy(self) -> Tensor:
        """Closed form ``H = ½ (P (1 + log 2π) + log |Σ|)``, a scalar."""
        return 0.5 * (self.n_params * (1 + _LOG_2PI) + self.logdet())

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
            mode: ``"single"``, ``"paired"`` or ``"unscented"`` (see the module docstring).
            generator: Random generator.

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
        """Draws without gradient, ``[n, P]`` (see :meth:`rsample`)."""
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
        """``log q(θ) = logsumexp_c (log π_c + log N_c(θ))`` for ``θ`` ``[*, P]``, ``[*]``."""
        logs = torch.stack([c.log_prob(theta) for c in self.components], -1)
        return torch.logsumexp(logs + torch.log_softmax(self.logits, 0), -1)

    def entropy(self, n_samples: int = 256, generator: torch.Generator | None = None) -> Tensor:
        """Stratified Monte Carlo estimate ``Ĥ = −Σ_c π_c (1/S) Σ_s log q(θ_cs)``, ``θ_cs ~ q_c``.

        Unbiased (no closed form exists for a Gaussian mixture); its standard error decreases
        as ``1/√S``. It always lies in ``[Σ_c π_c H_c, Σ_c π_c H_c + H(π)]`` in expectation.

        Args:
            n_samples: Draws ``S`` per component (antithetic pairs; rounded up to even).
            generator: Random generator.
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
        """Draws without gradient, ``[n, P]`` (see :meth:`rsample`), grouped by component."""
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
    """
    d = q.loc - mean_p
    trace = torch.trace(q.solve(cov_p))
    return 0.5 * (trace + d @ q.solve(d) - q.n_params + q.logdet() - torch.logdet(cov_p))


_LINK = {BCEWithLogits: "sigmoid", CrossEntropy: "softmax", MSE: "identity"}


class VariationalPosterior:
    """A variational posterior over the trainable parameters of ``model``.

    ``θ`` is the concatenation of the parameters with ``requires_grad``, in
    ``model.parameters()`` order (laplace-torch's layout). The model is evaluated at a draw by
    ``torch.func.functional_call``; its own parameters are never modified.

    Objective (:meth:`elbo`, maximised):
    ``(N/B) Σ_{batch} log p(y | x, θ) + log p(θ) − log q(θ)`` averaged over the draws, with
    ``log p(y | x, θ) = −loss`` (``reduction="sum"``; e.g. ``MSE(factor=1/(2σ²))`` is a
    Gaussian of standard deviation ``σ``, up to a constant), ``N`` the training-set size and
    ``B = x.shape[0]`` the batch size, and the prior ``p(θ) = N(0, λ⁻¹ I)``.

    The model runs in its current mode (e.g. training-mode dropout adds its noise to the
    likelihood, training-mode batch norm normalises with the batch's statistics), but always
    with copies of its buffers: running statistics are never updated.

    Attributes:
        model: The wrapped network.
        q: The family (:class:`StructuredGaussian` or :class:`GaussianMixture`), an ``nn.Module``
            whose parameters are the variational parameters.
        n_params: ``P``.
        link: ``"sigmoid"`` (BCE), ``"softmax"`` (CE) or ``"identity"`` (MSE), for
            :func:`lsn_ext.predict`.
        loss_fn: The likelihood's loss.
        prior_precision: ``λ``.
        history: ELBO values recorded by :meth:`fit`.

    Args:
        model: Any ``nn.Module``; the initial mean is its current weights.
        likelihood: ``"ce"``, ``"bce"``, ``"mse"``, a :class:`~lsn_ext.Loss` or a torch loss
            module, with ``reduction="sum"``.
        rank: Rank ``r`` of ``U`` (0: mean-field).
        n_components: ``K``; more than one gives a :class:`GaussianMixture`.
        prior_precision: ``λ > 0``.
        init_std: Initial ``√a``.
        min_variance: Floor of ``a``.
        generator: Random generator of the initialisation.

    Raises:
        ValueError: For a model without trainable parameters (or non-finite ones), a loss with
            ``reduction="mean"``, a prior precision or ``init_std`` that is not finite and
            positive, or bad ``rank``/``n_components``.
        TypeError: For a loss without a known link, or a non-numeric prior precision.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Loss | nn.Module = "ce",
        *,
        rank: int = 0,
        n_components: int = 1,
        prior_precision: float = 1.0,
        init_std: float = 1e-3,
        min_variance: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        self.model = model
        self.loss_fn = as_loss(likelihood)
        if self.loss_fn.reduction != "sum":
            raise ValueError("give the likelihood's loss with reduction='sum'")
        link = next((v for k, v in _LINK.items() if isinstance(self.loss_fn, k)), None)
        if link is None:
            raise TypeError(f"no predictive link for loss {type(self.loss_fn).__name__}")
        self.link = link
        self.prior_precision = _positive_finite("prior_precision", prior_precision)
        _positive_finite("init_std", init_std)
        named = self._named()
        if not named:
            raise ValueError(f"{type(model).__name__} has no parameters with requires_grad")
        loc = torch.cat([p.detach().reshape(-1) for _, p in named])
        self.n_params = loc.numel()
        kw = {"init_std": init_std, "min_variance": min_variance, "generator": generator}
        self.q: Family = (
            StructuredGaussian(loc, rank, **kw)
            if n_components == 1
            else GaussianMixture(loc, n_components, rank, **kw)
        )
        self.history: list[float] = []
        self._vectorize = True  # vmap the data term over draws until it proves impossible

    def _named(self) -> list[tuple[str, Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    # -- the Laplace-posterior interface --------------------------------------------------------

    def parameters(self) -> Iterable[nn.Parameter]:
        """The variational parameters (pass them to any ``torch.optim`` optimizer)."""
        return self.q.parameters()

    @property
    def mean(self) -> Tensor:
        """Posterior mean ``E_q θ``, ``[P]`` (detached)."""
        return self.q.mean.detach()

    @property
    def posterior_variance(self) -> Tensor:
        """Marginal variances ``diag(a) + rowsum(U²)`` (mixtures: of the mixture), ``[P]``."""
        return self.q.variance.detach()

    def sample(
        self, n: int, generator: torch.Generator | None = None, mode: SampleMode = "single"
    ) -> Tensor:
        """``n`` draws ``[n, P]`` from ``q``, no gradient (:meth:`StructuredGaussian.rsample`)."""
        return self.q.sample(n, generator=generator, mode=mode)

    def log_q(self, theta: Tensor) -> Tensor:
        """``log q(θ)`` for ``θ`` ``[*, P]``, ``[*]``."""
        return self.q.log_prob(theta)

    def entropy(self, n_samples: int = 256, generator: torch.Generator | None = None) -> Tensor:
        """Closed form for a Gaussian; a stratified MC estimate for a mixture (``n_samples``)."""
        if isinstance(self.q, GaussianMixture):
            return self.q.entropy(n_samples, generator)
        return self.q.entropy()

    # -- the objective --------------------------------------------------------------------------

    def _params(self, theta: Tensor) -> dict[str, Tensor]:
        named = self._named()
        sizes = [p.numel() for _, p in named]
        if sum(sizes) != self.n_params:
            raise ValueError(
                "the model's trainable parameters changed since the posterior was built"
            )
        return unflatten(named, theta)

    def log_likelihood(self, theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``log p(y | x, θ) = −loss(f_θ(x), y)`` (summed), for one ``θ`` ``[P]``."""
        tensors = self._params(theta)
        # Copies of the buffers: a training-mode batch norm updates the copies, not the model.
        tensors.update({n: b.clone() for n, b in self.model.named_buffers()})
        f = functional_call_all(self.model, tensors, (x,))
        return -self.loss_fn.value(f, y)

    def batched_log_likelihood(
        self, thetas: Tensor, x: Tensor, y: Tensor, *, vectorize: bool | None = None
    ) -> Tensor:
        """``log p(y | x, θ_s)`` for every row of ``thetas`` ``[S, P]``, returns ``[S]``.

        Vectorised over the draws by ``torch.func.vmap`` of :meth:`log_likelihood` (one
        batched forward pass instead of ``S``). Models that ``vmap`` cannot run (in-place
        updates of buffers, e.g. ``BatchNorm`` in training mode; random ops such as ``Dropout``
        in training mode; data-dependent control flow) fall back to a loop over the draws.

        Args:
            thetas: Draws ``[S, P]``.
            x: Inputs ``[B, *]``.
            y: Targets.
            vectorize: ``True`` forces ``vmap`` (errors propagate), ``False`` the loop, ``None``
                (default) tries ``vmap`` and, should it fail where the loop works, uses the
                loop from then on (a batch that fails both ways changes nothing).
        """
        use_vmap = self._vectorize if vectorize is None else vectorize
        if use_vmap:
            try:
                return vmap(lambda t: self.log_likelihood(t, x, y))(thetas)
            except (RuntimeError, NotImplementedError, ValueError):
                if vectorize:
                    raise
            # The loop raises what is wrong with the batch itself (bad targets, say); only when
            # it works is the model not vmap-able, and the loop used from then on.
            result = torch.stack([self.log_likelihood(t, x, y) for t in thetas])
            self._vectorize = False
            return result
        return torch.stack([self.log_likelihood(t, x, y) for t in thetas])

    def log_prior(self, theta: Tensor) -> Tensor:
        """``log N(θ; 0, λ⁻¹ I) = −½ λ ‖θ‖² + ½ P (log λ − log 2π)`` for ``θ`` ``[*, P]``."""
        lam = self.prior_precision
        return -0.5 * lam * theta.pow(2).sum(-1) + 0.5 * self.n_params * (math.log(lam) - _LOG_2PI)

    def elbo(
        self,
        x: Tensor,
        y: Tensor,
        n_data: int | None = None,
        n_samples: int = 2,
        mode: SampleMode = "paired",
        *,
        generator: torch.Generator | None = None,
        vectorize: bool | None = None,
    ) -> Tensor:
        """Monte Carlo ELBO on a batch, differentiable in the variational parameters.

        Args:
            x: Inputs ``[B, *]``.
            y: Targets, as the loss expects.
            n_data: Training-set size ``N`` (default: ``B``, i.e. full batch); the data term is
                scaled by ``N/B``.
            n_samples: Draws (per component), a multiple of the mode's group size.
            mode: ``"single"``, ``"paired"`` or ``"unscented"``.
            generator: Random generator.
            vectorize: How the data term is evaluated over the draws: ``None`` (default)
                ``vmap`` with a fallback to a loop, ``True`` ``vmap`` only, ``False`` the loop
                (see :meth:`batched_log_likelihood`).

        Returns:
            The scalar estimate (up to the likelihood's normalising constant).

        Raises:
            ValueError: For an empty or non-finite batch, or ``n_data`` that is not a positive
                int.
        """
        _check_batch(x, y)
        scale = 1.0 if n_data is None else _positive_int("n_data", n_data) / x.shape[0]

        def log_joint(thetas: Tensor) -> Tensor:
            data = self.batched_log_likelihood(thetas, x, y, vectorize=vectorize)
            return scale * data + self.log_prior(thetas)

        return elbo(self.q, log_joint, n_samples, mode, generator=generator)

    def fit(
        self,
        loader: Iterable[tuple[Tensor, Tensor]],
        epochs: int = 1,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        lr: float = 1e-2,
        n_samples: int = 2,
        mode: SampleMode = "paired",
        n_data: int | None = None,
        progress: bool | Callable[[int, float], None] = False,
        log_every: int = 50,
        generator: torch.Generator | None = None,
    ) -> VariationalPosterior:
        """Maximise the ELBO over ``epochs`` passes through ``loader``.

        Args:
            loader: Batches ``(x, y)`` (a list of one batch for full-batch training).
            epochs: Passes over the data.
            optimizer: Any optimizer over :meth:`parameters` (default ``Adam(lr=lr)``).
            lr: Learning rate of the default optimizer.
            n_samples: Draws per step (per component).
            mode: Sampling mode.
            n_data: Training-set size (default: the sum of the batch sizes of ``loader``,
                which must then be re-iterable).
            progress: ``True`` prints ``step, ELBO`` every ``log_every`` steps; a callable
                ``(step, elbo)`` is called at every step instead.
            log_every: Printing period for ``progress=True``.
            generator: Random generator of the draws.

        Returns:
            ``self``; the ELBO of every step is appended to :attr:`history`.

        Raises:
            ValueError: For ``epochs``, ``n_samples``, ``n_data`` or ``log_every`` that are not
                positive ints, a learning rate that is not finite and positive, a loader without
                batches, an empty or non-finite batch, or a non-finite ELBO (the variational
                parameters are left as they were before that step).
            RuntimeError: Under ``torch.inference_mode()``, which switches autograd off.
        """
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "VariationalPosterior.fit was called under torch.inference_mode(), which switches "
                "autograd off (even inside torch.enable_grad()), so the ELBO has no gradient to "
                "follow; call fit outside the inference_mode block"
            )
        _positive_int("epochs", epochs)
        _positive_int("n_samples", n_samples)
        _positive_int("log_every", log_every)
        if optimizer is None:
            _positive_finite("lr", lr)
        if n_data is None:
            n_data = sum(int(batch[0].shape[0]) for batch in loader)
            if n_data == 0:
                raise ValueError("loader yielded no data: nothing to fit")
        _positive_int("n_data", n_data)
        optimizer = optimizer or torch.optim.Adam(self.parameters(), lr=lr)
        step = len(self.history)
        for _ in range(epochs):
            steps_before = step
            for x, y in loader:
                optimizer.zero_grad()
                value = self.elbo(x, y, n_data, n_samples, mode, generator=generator)
                if not torch.isfinite(value):
                    raise ValueError(
                        f"the ELBO is {float(value)} at step {step}; check the targets and the "
                        "learning rate (the variational parameters were not updated)"
                    )
                (-value).backward()
                optimizer.step()
                value = float(value.detach())
                self.history.append(value)
                if callable(progress):
                    progress(step, value)
                elif progress and step % log_every == 0:
                    print(f"step {step:6d}  ELBO {value:.4g}")
                step += 1
            if step == steps_before:
                raise ValueError("loader yielded no batches: nothing to fit")
        return self
