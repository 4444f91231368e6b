r"""The Laplace Bridge: an analytic Dirichlet predictive from Gaussian logits.

Hobbhahn, Kristiadi & Hennig, "Fast Predictive Uncertainty for Classification with Bayesian Deep
Networks" (UAI 2022); the map goes back to MacKay (1998) and Hennig et al. (2012). A Gaussian
``N(μ, Σ)`` over ``K`` logits is mapped to a Dirichlet ``Dir(α)`` over the softmax output
(appendix Eq. 19):

.. math::

    α_k = \frac{1}{Σ_{kk}} \Bigl(1 - \frac{2}{K}
          + \frac{e^{μ_k}}{K^2} \sum_l e^{-μ_l}\Bigr),

after projecting the Gaussian onto the zero-sum subspace ``1ᵀf = 0`` (the logits of a softmax
are defined up to a constant; the bridge is derived for zero-sum logits), i.e. conditioning on
``1ᵀf = 0``:

.. math::

    μ ← μ - \frac{Σ1\,(1ᵀμ)}{1ᵀΣ1}, \qquad
    Σ ← Σ - \frac{(Σ1)(1ᵀΣ)}{1ᵀΣ1}, \qquad\text{so}\qquad
    Σ_{kk} ← Σ_{kk} - \frac{(Σ1)_k^2}{1ᵀΣ1}.

Only ``diag(Σ)`` is used afterwards. With a full covariance ``[N, K, K]`` the projection is
exact. With a diagonal input ``v`` (``[N, K]`` or per pixel ``[N, K, *]``) the same formula is
applied to ``Σ = diag(v)``: ``μ_k ← μ_k − v_k Σ_l μ_l / Σ_l v_l`` and
``v_k ← v_k (Σ_{l≠k} v_l) / Σ_l v_l`` (computed without cancellation); this is exact *for a
diagonal Σ*, i.e. it assumes the logits are uncorrelated, which a diagonal variance map from
:func:`lsn_ext.linearized_variance` or sampling does not guarantee. When ``1ᵀΣ1`` vanishes
(for a full covariance: relative to ``trace Σ``, e.g. the covariance of
:func:`dirichlet_to_gaussian`, whose rows sum to zero; for variances: all of them zero) the
Gaussian already lives on the zero-sum subspace up to a shift: ``Σ`` is kept and ``μ`` is centred,
``μ ← μ − mean(μ)`` (exact, since then ``1ᵀf = 1ᵀμ`` almost surely and the softmax
ignores shifts).

Numerics. ``α`` is computed in log space,
``log α_k = logaddexp(log(1 − 2/K), μ_k + logsumexp(−μ) − 2 log K) − log Σ_kk``, which is finite
for any finite logits (``μ_k + logsumexp(−μ) ≥ 0``), e.g. ±1e4. The exact ``log α`` is kept
(:attr:`BridgeDirichlet.log_concentration`); the predictive mean is ``softmax(log α)``, so it
sums to one for any input. The concentration itself is ``exp(log α)``, where, if the largest
``α_k`` of an input would exceed ``sqrt(max)/K`` of the dtype (float64: ``1.3e154/K``; float32:
``1.8e19/K``), all ``α_k`` of that input are divided by a common factor so that it does not
(the mean ``α/α₀`` is unchanged; ``α₀`` and ``α₀²`` stay finite; such a Dirichlet is a point
mass to working precision, with variances below ``K²/α_max``), and entries are then floored at
the dtype's ``tiny`` so that ``α > 0``.

Precision. Everything up to ``log α`` is computed in float32 for diagonal variances in float32
or half precision, and in float64 where float32 would lose accuracy, decided by the input's
largest ``|μ|`` and variance (taken from the validation pass, one host synchronisation): for a
full covariance (its zero-sum projection cancels), for float64 inputs, for logits larger than 32
in magnitude (``log α`` holds ``μ_k + logsumexp(−μ)``, whose absolute error grows with ``|μ|``),
for variances above ``2^100`` (their class sum could overflow float32), and, with ``norm``, when
the normalised logits exceed 32 in magnitude (checked after the float32 normalisation; the input
is then recomputed in float64). Tiny variances, subnormal ones included, and variances of very
different sizes need no fallback: the diagonal projection is computed as
``min(v_k, r_k) · (max(v_k, r_k) / Σ v)`` with the rest ``r_k = Σ_{l≠k} v_l`` summed without
cancellation, so no factor overflows or underflows (see :func:`_rest_product`). The float32 path
agrees with float64 to a few 1e-6 relative in ``log α`` (tested from tiny to huge variances,
with extreme logits and per pixel; half precision's range would cap ``α`` near ``256/K``). The
result is returned in the input's dtype, except that float16 and bfloat16 inputs give a float32
result (half precision cannot hold ``α`` to useful accuracy). Logits so extreme that ``log α``
itself overflows the result dtype (``|μ| ≳ 1.7e38`` in float32) raise a ``ValueError``; pass
float64.
The degenerate-projection threshold below uses the input dtype's machine epsilon; a full
covariance in a dtype too coarse for it (bfloat16, float16 with many classes) is refused.

Variance floor. Input variances (the diagonal of a full covariance) must be finite and
non-negative (``ValueError`` otherwise; a negative entry is a bug upstream, not rounding).
After the projection (and normalisation) every ``Σ_kk`` is floored at ``min_var``
(default: the dtype's machine epsilon, ``2.2e-16`` in float64, ``1.2e-7`` in float32), which
covers zero variances (a MAP network, an untouched class), classes whose whole variance is
removed by the projection, and rounding below zero in ``Σ_kk − (Σ1)_k²/1ᵀΣ1``.

Normalisation (``norm``). Large-K, large-variance Gaussians give tiny ``α`` (very flat
Dirichlets). A rescaling ``μ ← μ/√c``, ``Σ ← Σ/c`` with ``c`` set from the variances is used in
practice, and implementations disagree on ``c``:

- ``"mean"``: ``c = mean_k Σ_kk · √(2/K)``, laplace-torch's ``link_approx="bridge_norm"``;
- ``"sum"``: ``c = Σ_k Σ_kk · √(2/K)`` (= K × the above), laplax's ``use_correction=True``.

Neither is in the paper (Eq. 19 is ``norm=None``, the default). Both change the predictive mean,
not only its spread; they are offered by name for compatibility, and applied after the
projection (as laplace-torch does).

Shape legend: ``N`` batch, ``K`` classes, ``*`` spatial dimensions (``[N, K, H, W]`` for a
segmentation map). Inputs are never modified.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from scipy import special
from torch import Tensor
from torch.distributions import Beta, Dirichlet

__all__ = [
    "BridgeDirichlet",
    "LaplaceBridge",
    "TopK",
    "dirichlet_to_gaussian",
    "laplace_bridge",
]

Norm = Literal["mean", "sum"] | None
# Below this many classes BridgeDirichlet.mean computes the softmax in elementwise steps.
_SHORT_SOFTMAX = 16
_NORMS = (None, "mean", "sum")


@dataclass
class TopK:
    """Uncertainty-aware top-k sets (appendix Algorithm 1).

    Attributes:
        indices: Classes sorted by decreasing ``α``, the first ``max_k`` of them,
            ``[N, max_k, *]``; the set of an input is ``indices[n, :count[n]]``.
        count: Number of plausible classes (the set size, ``1 ≤ count ≤ max_k``), ``[N, *]``
            (for segmentation, the per-pixel "number of plausible classes" map).
        mask: Whether each class is in the set, ``[N, K, *]`` (bool).
    """

    indices: Tensor
    count: Tensor
    mask: Tensor

    def sets(self) -> list[Tensor]:
        """The variable-length sets, one tensor of class indices per input (``[N, K]`` only).

        Returns:
            ``N`` tensors of class indices, the ``n``-th ``indices[n, :count[n]]`` (most
            plausible class first).

        Raises:
            ValueError: For per-pixel sets (``count`` not ``[N]``); read ``count`` and ``mask``
                there.
        """
        if self.count.dim() != 1:
            raise ValueError(
                "sets() lists one set per input for [N, K] predictions; for per-pixel maps use "
                f"count {tuple(self.count.shape)} and mask {tuple(self.mask.shape)}"
            )
        return [self.indices[n, :c] for n, c in enumerate(self.count.tolist())]


class BridgeDirichlet(Dirichlet):
    r"""The Dirichlet predictive of the Laplace Bridge, a :class:`torch.distributions.Dirichlet`.

    The inherited interface follows torch's convention, classes *last*: ``concentration`` is
    ``[N, *, K]``, ``batch_shape = [N, *]``, ``event_shape = [K]``; ``mean``, ``variance``,
    ``log_prob(value)`` (value ``[..., N, *, K]``), ``entropy()`` (``[N, *]``), ``sample`` and
    ``rsample`` work as for any Dirichlet. The attributes :attr:`alpha`, :attr:`probs` and
    :attr:`probs_variance` give the same quantities in the layout of the input logits (classes in
    dim 1, ``[N, K, *]``); for ``[N, K]`` both layouts coincide.

    ``mean = softmax(log α)`` is computed from the exact log-concentration and ``variance`` as
    ``m (1 − m) / (α₀ + 1)``, so both stay finite and the mean sums to one even when ``α`` is
    rescaled (see the module docstring).

    Args:
        log_concentration: ``log α``, classes last, ``[N, *, K]``.
        validate_args: Passed to :class:`~torch.distributions.Dirichlet`.

    Raises:
        ValueError: If ``log_concentration`` is not ``[N, *, K]`` with ``K ≥ 2``.
    """

    def __init__(self, log_concentration: Tensor, validate_args: bool | None = None):
        if log_concentration.dim() < 2 or log_concentration.shape[-1] < 2:
            raise ValueError(
                "log_concentration must be [N, *, K] with K >= 2 classes last, got shape "
                f"{tuple(log_concentration.shape)}"
            )
        finfo = torch.finfo(log_concentration.dtype)
        K = log_concentration.shape[-1]
        high = 0.5 * math.log(finfo.max) - math.log(K)
        excess = (log_concentration.amax(-1, keepdim=True) - high).clamp_min(0)
        self.log_concentration = log_concentration
        super().__init__(
            (log_concentration - excess).clamp_min(math.log(finfo.tiny)).exp(),
            validate_args=validate_args,
        )

    # -- layout of the input logits (classes in dim 1) --------------------------------------
    @staticmethod
    def _to_input(t: Tensor) -> Tensor:
        return t if t.dim() == 2 else t.movedim(-1, 1)

    @property
    def num_classes(self) -> int:
        """``K``."""
        return self.concentration.shape[-1]

    @property
    def alpha(self) -> Tensor:
        """``α`` in the input layout, ``[N, K, *]``."""
        return self._to_input(self.concentration)

    @property
    def alpha0(self) -> Tensor:
        """The precision ``α₀ = Σ_k α_k``, ``[N, *]``."""
        return self.concentration.sum(-1)

    @property
    def probs(self) -> Tensor:
        """Predictive mean ``E[π] = α/α₀`` in the input layout, ``[N, K, *]``."""
        return self._to_input(self.mean)

    @property
    def probs_variance(self) -> Tensor:
        """``Var[π_k] = m_k (1 − m_k)/(α₀ + 1)`` in the input layout, ``[N, K, *]``."""
        return self._to_input(self.variance)

    # -- Dirichlet moments, stable -----------------------------------------------------------
    @property
    def mean(self) -> Tensor:
        """``softmax(log α)``, classes last, ``[N, *, K]``; sums to one exactly."""
        la = self.log_concentration
        if la.shape[-1] >= _SHORT_SOFTMAX:
            return torch.softmax(la, -1)
        # the same steps as torch's softmax, whose CPU kernel is ~5× slower over fewer than 16
        # classes (float32, 10 classes: 0.6 ms against 0.11 ms for 5,000 rows, one thread)
        e = (la - la.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)

    @property
    def variance(self) -> Tensor:
        """``m (1 − m) / (α₀ + 1)``, classes last, ``[N, *, K]``."""
        m = self.mean
        return m * (1 - m) / (self.alpha0.unsqueeze(-1) + 1)

    # -- marginals ---------------------------------------------------------------------------
    def _rest(self, k: int) -> Tensor:
        """``α₀ − α_k`` as a sum over the other classes (no cancellation), ``[N, *]``."""
        a = self.concentration
        return a[..., :k].sum(-1) + a[..., k + 1 :].sum(-1)

    def marginal(self, k: int) -> Beta:
        """The Beta marginal of class ``k``: ``π_k ~ Beta(α_k, α₀ − α_k)``, batch ``[N, *]``.

        Exact: the marginals of a Dirichlet are Beta distributions.

        Args:
            k: Class index in ``[−K, K)`` (negative counts from the end).

        Returns:
            A :class:`torch.distributions.Beta` with batch shape ``[N, *]``.

        Raises:
            ValueError: If ``k`` is out of range.
        """
        K = self.num_classes
        if not -K <= k < K:
            raise ValueError(f"class index {k} out of range for K = {K} classes")
        k %= K
        return Beta(self.concentration[..., k], self._rest(k), validate_args=False)

    def aggregate(self, groups: Sequence[Sequence[int]]) -> BridgeDirichlet:
        r"""The Dirichlet of merged class groups (aggregation property).

        If ``π ~ Dir(α)`` then ``(Σ_{k∈G_1} π_k, …, Σ_{k∈G_m} π_k) ~ Dir(Σ_{G_1} α, …,
        Σ_{G_m} α)`` for a partition ``G_1, …, G_m`` of the classes.

        Args:
            groups: Disjoint lists of class indices. Classes in no group are merged into one
                extra last group, so the result always covers all of ``π``.

        Returns:
            A :class:`BridgeDirichlet` with one class per group (``log α`` merged by
            ``logsumexp``, so exact even where ``α`` is rescaled).

        Raises:
            ValueError: Overlapping or out-of-range indices, an empty group, or fewer than two
                resulting groups.
        """
        K = self.num_classes
        seen: set[int] = set()
        parts = []
        for g in groups:
            g = [int(i) for i in g]
            if not g or any(not 0 <= i < K for i in g) or seen & set(g) or len(set(g)) < len(g):
                raise ValueError(
                    f"groups must be non-empty, disjoint lists of class indices in [0, {K}); "
                    f"got {[list(x) for x in groups]}"
                )
            seen |= set(g)
            parts.append(g)
        rest = [i for i in range(K) if i not in seen]
        if rest:
            parts.append(rest)
        if len(parts) < 2:
            raise ValueError("aggregate needs at least two resulting groups")
        la = self.log_concentration
        merged = [torch.logsumexp(la[..., g], -1) for g in parts]
        return BridgeDirichlet(torch.stack(merged, -1), validate_args=False)

    def proposition1(self) -> Tensor:
        r"""Where the paper's Proposition 1 condition holds, ``[N, K, *]`` (bool).

        With ``a = α₀ − α_k``: ``α_k > ¼(√(9a² + 10a + 1) − a − 1)``. Then ``Var[π_k]``
        increases with the Gaussian's ``Σ_kk``, i.e. the Dirichlet's uncertainty follows the
        logit uncertainty (a necessary condition; the paper uses it as a proxy for a good
        approximation).

        Returns:
            Booleans in the input layout, ``[N, K, *]``: ``True`` where the condition holds.
        """
        a = self.concentration
        rest = a.sum(-1, keepdim=True) - a
        bound = 0.25 * (torch.sqrt(9 * rest**2 + 10 * rest + 1) - rest - 1)
        return self._to_input(a > bound)

    # -- uncertainty-aware top-k -------------------------------------------------------------
    def topk(self, threshold: float = 0.05, max_k: int | None = 10) -> TopK:
        r"""Uncertainty-aware top-k (appendix Algorithm 1), vectorised over inputs and pixels.

        Classes are walked by decreasing ``α``; class ``i`` (``i ≥ 2``) joins the set while the
        right ``T/2`` quantile of its Beta marginal exceeds the left ``T/2`` quantile of the
        previous class's marginal, ``F_i^{-1}(1 − T/2) > F_{i−1}^{-1}(T/2)``, with
        ``F_i = Beta(α̃_i, α₀ − α̃_i)``; the first failure ends the set. The top class is
        always in it. The Beta quantiles come from :func:`scipy.special.betaincinv` (on CPU,
        float64; torch has no Beta inverse CDF); where it does not return a finite value (far
        out of its range) a normal approximation with the Beta's mean and variance is used.

        Args:
            threshold: ``T`` in ``(0, 1)``, e.g. ``0.05``.
            max_k: Largest set size (the paper uses 10); ``None`` for ``K``.

        Returns:
            :class:`TopK` with sorted class indices ``[N, max_k, *]``, the set size
            ``[N, *]`` and a class mask ``[N, K, *]``.

        Raises:
            ValueError: If ``threshold`` is not in ``(0, 1)`` or ``max_k < 1``.
        """
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        K = self.num_classes
        m = K if max_k is None else int(max_k)
        if m < 1:
            raise ValueError(f"max_k must be at least 1, got {max_k}")
        m = min(m, K)
        a = self.concentration
        a_sorted, order = torch.sort(a, -1, descending=True)
        a_sorted, order = a_sorted[..., :m], order[..., :m]
        count = torch.ones(a.shape[:-1], dtype=torch.long, device=a.device)
        if m > 1:
            a0 = a.sum(-1, keepdim=True)
            left = _beta_quantile(a_sorted[..., :-1], a0 - a_sorted[..., :-1], threshold / 2)
            right = _beta_quantile(a_sorted[..., 1:], a0 - a_sorted[..., 1:], 1 - threshold / 2)
            overlap = right > left  # [N, *, m-1]
            count = count + torch.cumprod(overlap.long(), -1).sum(-1)
        in_set = torch.arange(m, device=a.device) < count.unsqueeze(-1)
        mask = torch.zeros(a.shape, dtype=torch.bool, device=a.device)
        mask.scatter_(-1, order, in_set)
        return TopK(self._to_input(order), count, self._to_input(mask))

    def to_gaussian(self, full: bool = False) -> tuple[Tensor, Tensor]:
        """The inverse map of this Dirichlet, see :func:`dirichlet_to_gaussian`.

        Args:
            full: Return the full covariance ``[N, K, K]`` (only for ``[N, K]`` inputs) instead
                of its diagonal ``[N, K, *]``.

        Returns:
            ``(μ, Σ)`` in the input layout (classes in dim 1).
        """
        return dirichlet_to_gaussian(self.alpha, full=full)


def _beta_quantile(a: Tensor, b: Tensor, q: float) -> Tensor:
    """``F^{-1}(q)`` of ``Beta(a, b)`` elementwise, on CPU in float64, returned like ``a``."""
    an = a.detach().to("cpu", torch.float64).numpy()
    bn = b.detach().to("cpu", torch.float64).numpy()
    with np.errstate(all="ignore"):
        x = special.betaincinv(an, bn, q)
        bad = ~np.isfinite(x)
        if bad.any():
            s = an + bn
            mean = an / s
            sd = np.sqrt(an * bn / (s * s * (s + 1)))
            approx = np.clip(mean + sd * special.ndtri(q), 0.0, 1.0)
            x = np.where(bad, approx, x)
    return torch.from_numpy(x).to(a.device, a.dtype)


class LaplaceBridge:
    r"""Map Gaussian logits ``N(f_mu, f_var)`` to the Laplace-Bridge Dirichlet.

    Args:
        norm: ``None`` (the paper's Eq. 19, default), ``"mean"`` (laplace-torch's
            ``bridge_norm``) or ``"sum"`` (laplax), see the module docstring.
        min_var: Floor for the projected variances ``Σ_kk``; default the dtype's machine
            epsilon.
        project: Apply the zero-sum projection (default). ``False`` uses ``μ`` and
            ``diag Σ`` as given, e.g. for Gaussians that come from
            :func:`dirichlet_to_gaussian` with a diagonal (Eq. 16) covariance, which are
            zero-sum by construction.

    Raises:
        ValueError: If ``norm`` is not ``None``, ``"mean"`` or ``"sum"``, or ``min_var`` is not
            positive.

    Example:
        >>> bridge = LaplaceBridge()
        >>> d = bridge(torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([[0.5, 0.5, 0.5]]))
        >>> d.probs.sum().item(), d.alpha.shape
        (1.0, torch.Size([1, 3]))
    """

    def __init__(self, norm: Norm = None, min_var: float | None = None, project: bool = True):
        if norm not in _NORMS:
            raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
        if min_var is not None and not min_var > 0:
            raise ValueError(f"min_var must be positive, got {min_var}")
        self.norm = norm
        self.min_var = min_var
        self.project = project

    def __call__(self, f_mu: Tensor, f_var: Tensor) -> BridgeDirichlet:
        """Apply the bridge.

        Args:
            f_mu: Logit means ``[N, K]`` or per pixel ``[N, K, *]`` (classes in dim 1).
            f_var: Full covariances ``[N, K, K]`` (for ``[N, K]`` means) or variances shaped
                like ``f_mu``.

        Returns:
            The :class:`BridgeDirichlet`.

        Raises:
            ValueError: Shapes that do not match, ``K < 2``, non-finite means, or non-finite
                or negative variances.
        """
        mu, var, out = self._gaussian(f_mu, f_var)
        log_alpha = _log_alpha(mu, var)
        result = log_alpha.to(out)
        # log α is finite in its working dtype; only a float64 log α can overflow the result
        if log_alpha.dtype != out and not bool(torch.isfinite(result).all()):
            big = float(f_mu.detach().abs().max())
            raise ValueError(
                f"log α overflows {out} (largest |f_mu| = {big:.3g}: the logits are too extreme "
                f"for {out}); pass f_mu and f_var in float64"
            )
        return BridgeDirichlet(result, validate_args=False)

    def gaussian(self, f_mu: Tensor, f_var: Tensor) -> tuple[Tensor, Tensor]:
        """The projected (and normalised, floored) ``(μ, Σ_kk)`` that enter Eq. 19.

        Args:
            f_mu: Logit means ``[N, K]`` or per pixel ``[N, K, *]`` (classes in dim 1).
            f_var: Full covariances ``[N, K, K]`` (for ``[N, K]`` means) or variances shaped
                like ``f_mu``.

        Returns:
            ``(μ, Σ_kk)``, both with classes *last*, ``[N, *, K]``, in the result dtype (the
            input's; float32 for float16 and bfloat16 inputs).

        Raises:
            ValueError: As :meth:`__call__`.
        """
        mu, var, out = self._gaussian(f_mu, f_var)
        return mu.to(out), var.to(out)

    def _gaussian(self, f_mu: Tensor, f_var: Tensor) -> tuple[Tensor, Tensor, torch.dtype]:
        """``(μ, Σ_kk)`` in the working dtype, and the dtype of the result (module docstring)."""
        mu, var, full, mu_abs, var_max = _check(f_mu, f_var)
        out = _result_dtype(mu.dtype)
        work = _work_dtype(mu.dtype, full, mu_abs, var_max)
        m, v = self._transform(mu.to(work), var.to(work), full, mu.dtype, out)
        # the normalisation scales the logits by 1/√c: check them again
        renorm = work != torch.float64 and self.norm is not None and m.numel() > 0
        if renorm and float(m.abs().amax()) > _FLOAT32_LOGIT_LIMIT:
            m, v = self._transform(mu.double(), var.double(), full, mu.dtype, out)
        return m, v, out

    def _transform(
        self, mu: Tensor, var: Tensor, full: bool, dtype: torch.dtype, out: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """Projection, normalisation and floor, in the dtype of ``mu`` (``dtype``: the input's)."""
        if self.project:
            # The threshold for a degenerate 1ᵀΣ1 is the round-off of the *input* dtype.
            mu, var = _project(mu, var, full, torch.finfo(dtype).eps)
        elif full:
            var = var.diagonal(dim1=-2, dim2=-1)
        if self.norm is not None:
            K = mu.shape[-1]
            reduce = var.mean if self.norm == "mean" else var.sum
            c = (reduce(-1, keepdim=True) * math.sqrt(2 / K)).clamp_min(torch.finfo(out).tiny)
            mu, var = mu / c.sqrt(), var / c
        floor = torch.finfo(out).eps if self.min_var is None else self.min_var
        return mu, var.clamp_min(max(floor, torch.finfo(out).tiny))


def laplace_bridge(
    f_mu: Tensor,
    f_var: Tensor,
    *,
    norm: Norm = None,
    min_var: float | None = None,
    project: bool = True,
) -> BridgeDirichlet:
    r"""The Laplace-Bridge Dirichlet of Gaussian logits ``N(f_mu, f_var)`` (appendix Eq. 19).

    The functional form of :class:`LaplaceBridge`:
    ``LaplaceBridge(norm=norm, min_var=min_var, project=project)(f_mu, f_var)``. After the
    zero-sum projection (see the module docstring),

    .. math::

        α_k = \frac{1}{Σ_{kk}} \Bigl(1 - \frac{2}{K} + \frac{e^{μ_k}}{K^2} \sum_l e^{-μ_l}\Bigr).

    Args:
        f_mu: Logit means ``[N, K]`` or per pixel ``[N, K, *]`` (classes in dim 1).
        f_var: Full covariances ``[N, K, K]`` (for ``[N, K]`` means) or variances shaped like
            ``f_mu``. A diagonal input is treated as ``Σ = diag(f_var)`` (uncorrelated logits).
        norm: ``None`` (the paper's Eq. 19, default), ``"mean"`` (laplace-torch's
            ``bridge_norm``) or ``"sum"`` (laplax): the rescaling ``μ ← μ/√c``, ``Σ ← Σ/c``
            described in the module docstring; it changes the predictive mean too.
        min_var: Floor for the projected variances ``Σ_kk``; default (``None``) the result
            dtype's machine epsilon (``2.2e-16`` in float64, ``1.2e-7`` in float32).
        project: Apply the zero-sum projection onto ``1ᵀf = 0`` (default). ``False`` uses
            ``μ`` and ``diag Σ`` as given, for Gaussians that are zero-sum already (those of
            :func:`dirichlet_to_gaussian` with a diagonal covariance).

    Returns:
        The :class:`BridgeDirichlet`; ``.probs`` and ``.probs_variance`` are ``[N, K, *]``.

    Raises:
        ValueError: For an unknown ``norm``, a non-positive ``min_var``, shapes that do not
            match, ``K < 2``, non-finite means, non-finite or negative variances, or logits too
            extreme for the result dtype.
    """
    return LaplaceBridge(norm=norm, min_var=min_var, project=project)(f_mu, f_var)


def _check(f_mu: Tensor, f_var: Tensor) -> tuple[Tensor, Tensor, bool, float, float]:
    """Validate, and move classes last.

    Returns:
        ``(μ [N, *, K], Σ [N, *, K] or [N, K, K], full, max |μ|, max Σ)``. The values are
        checked with one ``aminmax`` pass per tensor and one host synchronisation (NaN
        propagates through ``aminmax``, so finite extremes mean finite entries).
    """
    if not isinstance(f_mu, Tensor) or not isinstance(f_var, Tensor):
        raise TypeError("f_mu and f_var must be tensors")
    if f_mu.dim() < 2 or f_mu.shape[1] < 2:
        raise ValueError(
            f"f_mu must be [N, K] or [N, K, *spatial] with K >= 2 classes in dim 1, got shape "
            f"{tuple(f_mu.shape)} (binary logits: use [−f/2, f/2] with covariance "
            "[[v, −v], [−v, v]]/4, as bridge_predictive does)"
        )
    N, K = f_mu.shape[:2]
    if f_var.shape == f_mu.shape:
        full = False
        diag = f_var
    elif f_mu.dim() == 2 and f_var.shape == (N, K, K):
        full = True
        diag = f_var.diagonal(dim1=-2, dim2=-1)
    else:
        raise ValueError(
            f"f_var must be shaped like f_mu {tuple(f_mu.shape)} (variances) or, for [N, K] "
            f"means, [N, K, K] (covariances); got {tuple(f_var.shape)}"
        )
    if not f_mu.is_floating_point() or f_var.dtype != f_mu.dtype:
        raise TypeError(
            f"f_mu and f_var must share a floating dtype, got {f_mu.dtype}, {f_var.dtype}"
        )
    mu, var = f_mu.detach(), f_var.detach()
    mu_abs = var_max = 0.0
    if mu.numel() > 0:
        stats = [*torch.aminmax(mu), *torch.aminmax(var)]
        if full:
            stats.append(diag.detach().amin())
        mu_lo, mu_hi, var_lo, var_max, *diag_lo = torch.stack(stats).tolist()
        if not (math.isfinite(mu_lo) and math.isfinite(mu_hi)):
            raise ValueError("f_mu has non-finite entries")
        smallest = diag_lo[0] if full else var_lo
        if not (math.isfinite(var_lo) and math.isfinite(var_max)) or smallest < 0:
            bad = smallest if math.isfinite(smallest) else float("nan")
            raise ValueError(
                "f_var must be finite with non-negative variances (the diagonal for a "
                f"covariance); smallest variance {bad}. Zero is allowed: projected variances are "
                "floored at min_var"
            )
        mu_abs = max(-mu_lo, mu_hi)
    if full:
        _check_covariance(var)
    if not full and mu.dim() > 2:
        # one copy to classes-last memory: the reductions over classes are then contiguous
        mu, var = mu.movedim(1, -1).contiguous(), var.movedim(1, -1).contiguous()
    return mu, var, full, mu_abs, var_max


def _check_covariance(cov: Tensor) -> None:
    """Refuse ``[N, K, K]`` matrices that cannot be covariances.

    Checked (``O(N K²)``, no factorisation): symmetry and every 2×2 principal minor,
    ``Σ_ij² ≤ Σ_ii Σ_jj``, to ``64 K eps`` of the dtype relative to the largest diagonal entry of
    each matrix; :func:`_project` then refuses a negative ``1ᵀΣ1`` or projected variance, the
    quantities Eq. 19 uses. (A full positive semi-definiteness test would cost more than the
    bridge itself.)
    """
    K = cov.shape[-1]
    c = cov if cov.dtype in (torch.float32, torch.float64) else cov.float()
    diag = c.diagonal(dim1=-2, dim2=-1)
    scale = diag.amax(-1).clamp_min(torch.finfo(c.dtype).tiny)
    tol = 64 * K * torch.finfo(cov.dtype).eps * scale
    asym = (c - c.mT).abs().flatten(1).amax(1)
    if bool((asym > tol).any()):
        i = int((asym / scale).argmax())
        raise ValueError(
            f"f_var[{i}] is not symmetric (largest |Σ - Σᵀ| = {float(asym[i]):.3g}, diagonal up "
            f"to {float(scale[i]):.3g}): give a covariance matrix, e.g. (S + Sᵀ)/2"
        )
    excess = (c.square() - diag.unsqueeze(-1) * diag.unsqueeze(-2)).flatten(1).amax(1)
    if bool((excess > tol * scale).any()):
        i = int((excess / scale.square()).argmax())
        raise ValueError(
            f"f_var[{i}] is not positive semi-definite: an off-diagonal entry exceeds the "
            "geometric mean of its diagonal entries (|Σ_ij| > √(Σ_ii Σ_jj)); a covariance "
            "cannot have that, check how it was computed"
        )


# Largest |logit| computed in float32: log α then has an absolute error of a few 1e-6.
_FLOAT32_LOGIT_LIMIT = 32.0
# Largest variance computed in float32: the sum over the classes stays far from overflow.
_FLOAT32_VAR_LIMIT = 2.0**100


def _work_dtype(dtype: torch.dtype, full: bool, mu_abs: float, var_max: float) -> torch.dtype:
    """float32 for diagonal inputs of at most float32 precision and moderate values, else float64.

    A full covariance's projection cancels (``Σ_kk − (Σ1)_k²/1ᵀΣ1``), large logits lose
    absolute precision in ``log α``, and the class sum of variances above ``2^100`` could
    overflow float32: these are computed in float64. ``mu_abs`` and ``var_max`` are the largest
    ``|μ|`` and variance of the input (from :func:`_check`, no further pass over the data).
    """
    if full or dtype == torch.float64:
        return torch.float64
    if mu_abs > _FLOAT32_LOGIT_LIMIT or var_max > _FLOAT32_VAR_LIMIT:
        return torch.float64
    return torch.float32


def _result_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs (see the module docstring), else the input's dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _project(mu: Tensor, var: Tensor, full: bool, eps: float) -> tuple[Tensor, Tensor]:
    """Condition ``N(μ, Σ)`` on ``1ᵀf = 0``; returns ``(μ, diag Σ)``, classes last (new tensors)."""
    if full:
        s = var.sum(-1)  # Σ1, [N, K]
        diag = var.diagonal(dim1=-2, dim2=-1)
        total = s.sum(-1, keepdim=True)  # 1ᵀΣ1
        new_diag = diag - s**2 / total
    else:
        s = diag = var
        total = var.sum(-1, keepdim=True)
        new_diag = _rest_product(var, total)
    K = mu.shape[-1]
    if full:
        scale = diag.abs().sum(-1, keepdim=True)
        if 64 * K * eps >= 1:
            raise ValueError(
                f"a full covariance with K = {K} classes in a dtype with machine epsilon {eps:.3g} "
                "cannot be projected reliably: its rounding hides whether 1ᵀΣ1 vanishes. Pass "
                "f_mu and f_var in float32 or float64"
            )
        degenerate = total <= 64 * K * eps * scale
        if bool((total < -64 * K * eps * scale).any()) or bool(
            (new_diag.masked_fill(degenerate, 0) < -64 * K * eps * scale).any()
        ):
            raise ValueError(
                "f_var is not positive semi-definite: 1ᵀΣ1 or a variance after conditioning on "
                "zero-sum logits is negative; a covariance cannot give that, check how it was "
                "computed"
            )
    else:
        # 1ᵀΣ1 = Σ v_k ≥ max v_k: it vanishes only with all variances.
        degenerate = total <= 0
    safe = torch.where(degenerate, torch.ones_like(total), total)
    projected_mu = mu - s / safe * mu.sum(-1, keepdim=True)  # s/1ᵀΣ1 first: no underflow
    centred_mu = mu - mu.mean(-1, keepdim=True)
    mu = torch.where(degenerate, centred_mu, projected_mu)
    var = torch.where(degenerate, diag, new_diag.nan_to_num(0.0))
    return mu, var


def _rest_product(v: Tensor, total: Tensor) -> Tensor:
    """``v_k Σ_{l≠k} v_l / Σ_l v_l`` for non-negative ``v``, to a few ulps in any dtype.

    The rest ``Σ_{l≠k} v_l`` is ``total − v_k``, except for a class holding more than half of
    the total, whose rest is summed directly (the subtraction would cancel: in float32, one
    variance of 1 beside nine of 1e-6 lost the others' sum to rounding). The product is taken as
    ``min(v_k, rest) · (max(v_k, rest) / total)``, whose ratio lies in ``[½, 1]``, so it
    neither overflows nor loses digits to underflow. ``0/0`` (all variances zero) gives NaN.
    """
    top = v.amax(-1, keepdim=True)
    rest_of_top = torch.where(v == top, 0, v).sum(-1, keepdim=True)
    rest = total - v
    rest = torch.where(v > rest, rest_of_top, rest)
    return torch.minimum(v, rest) * (torch.maximum(v, rest) / total)


def _log_alpha(mu: Tensor, var: Tensor) -> Tensor:
    """Eq. 19 in log space, classes last: ``log(1 − 2/K + e^{μ_k} Σ_l e^{−μ_l}/K²) − log Σ_kk``."""
    K = mu.shape[-1]
    log_term = mu + torch.logsumexp(-mu, -1, keepdim=True) - 2 * math.log(K)
    if K > 2:
        log_term = torch.logaddexp(log_term, torch.full_like(log_term, math.log(1 - 2 / K)))
    return log_term - var.log()


def dirichlet_to_gaussian(alpha: Tensor, full: bool = False) -> tuple[Tensor, Tensor]:
    r"""The Laplace approximation of ``Dir(α)`` in the softmax basis (appendix Eq. 12, 15, 16).

    .. math::

        μ_k = \log α_k - \frac1K \sum_l \log α_l, \qquad
        Σ_{kl} = \frac{δ_{kl}}{α_k} - \frac1K\Bigl[\frac1{α_k} + \frac1{α_l}
                 - \frac1K \sum_u \frac1{α_u}\Bigr],

        Σ_{kk} = \frac1{α_k}\Bigl(1 - \frac2K\Bigr) + \frac1{K^2}\sum_l \frac1{α_l}.

    ``μ`` sums to zero and the rows of ``Σ`` sum to zero, so :class:`LaplaceBridge` maps both
    forms back to ``α`` exactly: the full covariance with the default projection (the
    degenerate case: ``μ`` is centred, ``Σ`` kept), the diagonal with ``project=False``.

    Args:
        alpha: Positive concentrations ``[N, K]`` or ``[N, K, *]`` (classes in dim 1).
        full: Return the full covariance ``[N, K, K]`` (only for ``[N, K]``) instead of its
            diagonal (shaped like ``alpha``).

    Returns:
        ``(μ, Σ)`` in the layout of ``alpha``; in float32 for a float16 or bfloat16 ``alpha``.

    Raises:
        ValueError: If ``alpha`` is not ``[N, K, *]`` with ``K ≥ 2``, not positive and finite,
            or ``full`` is asked for per-pixel concentrations.
    """
    if alpha.dim() < 2 or alpha.shape[1] < 2:
        raise ValueError(f"alpha must be [N, K, *] with K >= 2, got {tuple(alpha.shape)}")
    if not bool((alpha > 0).all()) or not bool(torch.isfinite(alpha).all()):
        raise ValueError("alpha must be positive and finite")
    if full and alpha.dim() != 2:
        raise ValueError("full covariances are available for [N, K] only")
    alpha = alpha.to(_result_dtype(alpha.dtype))
    K = alpha.shape[1]
    log_a = alpha.log()
    mu = log_a - log_a.mean(1, keepdim=True)
    inv = alpha.reciprocal()
    inv_sum = inv.sum(1, keepdim=True)
    if not full:
        return mu, inv * (1 - 2 / K) + inv_sum / K**2
    cov = torch.diag_embed(inv) - (inv[:, :, None] + inv[:, None, :] - inv_sum[..., None] / K) / K
    return mu, cov
