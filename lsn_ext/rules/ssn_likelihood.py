r"""The SSN's own likelihood as a loss of the mean logits: curvatures for the LSN's Laplace.

The LSN (:func:`lsn_ext.lsn.fit_lsn`) puts a Laplace approximation on the SSN's mean network
``θ ↦ μ`` with the variance heads fixed at ``θ_MAP`` (LSN Eq. 12). The SSN is trained with logit
noise ``η ~ N(μ, Σ)``, ``Σ = diag(d) + P Pᵀ``; since ``Σ`` does not depend on ``θ_mean``, it is a
constant of each training image, and so is each pixel's marginal variance
``v_s = Σ_ss = d_s + |P_s|²``. The losses here are functions of the mean logits ``μ`` whose
*targets* carry that constant (the mask and ``v``, or the mask and fixed noise draws), so that
they plug into :class:`lsn_ext.DiagBackprop` like :class:`~lsn_ext.BCEWithLogits`. Binary SSNs
only (``K = 1``, sigmoid); see "Multi-class" below.

Notation (per image; ``s`` a pixel, ``D = H·W``): ``w₊`` the ``pos_weight``,
``a_s = w₊ y_s + 1 − y_s``, ``log p(y_s | η_s) = w₊ y_s log σ(η_s) + (1 − y_s) log σ(−η_s)``
(the likelihood of ``ssn_loss`` and ``BCEWithLogits``), whose negative Hessian is
``Λ(η) = diag(a_s σ(η_s) σ(−η_s))`` and whose gradient is ``g(η)_s = w₊ y_s − a_s σ(η_s)``.

**Eq. 11, the SSN training loss** (:class:`LogsumexpBCE`). With ``M`` fixed draws
``η^(m) = μ + ε^(m)``, ``ε^(m) ~ N(0, Σ)``, ``ℓ_m = Σ_s log p(y_s | η_s^(m))`` and importance
weights ``w_m = softmax_m(ℓ_m)``::

    L(μ)       = −logsumexp_m ℓ_m + log M
    ∇_μ L      = −Σ_m w_m g_m                         (g_m = g(η^(m)), ḡ = Σ_m w_m g_m)
    ∇²_μ L     = Σ_m w_m Λ(η^(m)) − Cov_w(g),         Cov_w(g) = Σ_m w_m (g_m − ḡ)(g_m − ḡ)ᵀ

This is exact (for the draws held fixed). ``Cov_w(g)`` is dense across the pixels of an image
(rank ``≤ M − 1``) and the Hessian is not positive semi-definite in general. Its PSD part
``Σ_m w_m Λ(η^(m))`` is the Hessian with the importance weights held fixed: diagonal per pixel,
it is the "logsumexp" curvature (:meth:`LogsumexpBCE.hessian_diag`); the exact diagonal
``Σ_m w_m Λ(η^(m)) − Σ_m w_m (g_m − ḡ)²`` is :meth:`LogsumexpBCE.exact_hessian_diag`. With zero
noise all ``w_m = 1/M`` and ``g_m`` agree: both are the BCE Hessian at ``μ``.

**The per-pixel expected NLL** (:class:`ExpectedBCE`)::

    L_E(μ)     = −Σ_s E_{η_s ~ N(μ_s, v_s)} log p(y_s | η_s)
    ∇²_μ L_E   = E_{η ~ N(μ, Σ)} Λ(η) = diag(a_s E_{N(μ_s, v_s)} σ(η)σ(−η))

exactly (``Λ`` is diagonal, so only the marginals ``N(μ_s, v_s)`` enter; PSD). This "expected"
curvature is also the GGN analogue for the marginal likelihood ``p(y | μ) = E_η p(y | η)``
(``w₊ = 1``, a normalised Bernoulli): its score is ``E_{η|y} g`` under the posterior
``p(η | y, μ)``, and averaging that posterior over ``y ~ p(y | μ)`` gives back the prior
``N(μ, Σ)``; the law of total covariance over ``(η, y)`` with ``E_{y|η}[g gᵀ] = Λ(η)`` gives::

    Fisher(μ)  = Cov_y(E_{η|y} g) = E_η Λ(η) − E_y Cov_{η|y}(g)  ≼  E_η Λ(η)

so the expected curvature is an upper bound of the marginal likelihood's Fisher (which is not
diagonal), as the GGN is for a likelihood without noise. At ``v = 0`` all three curvatures are
the BCE Hessian at ``μ``.

**Quadrature.** ``E_{N(μ, v)} f(η)`` for ``f = Λ`` is computed deterministically by the
trapezoid rule with step ``h = ½`` on 161 nodes ``t_j ∈ [−40, 40]``, in one of two coordinates:
for ``v < 1``, ``η_j = μ + √v t_j`` with weights ``h φ(t_j)``; for ``v ≥ 1`` (where the
Gaussian is wider than ``Λ``'s bump), ``η_j = c + t_j``, ``c = μ − clamp(μ, −v, v)`` (0, or the
product's mode for ``|μ| > v``) with weights ``h N(η_j; μ, v)``. Both integrands are analytic in a
strip of half-width ``π`` (the poles of ``σ``) and the trapezoid rule converges geometrically
there (the error is ``O(e^{−2π d/h})``): against adaptive quadrature over ``v ∈ [0, 10⁴]``,
``μ ∈ [−1200, 25]``, the relative error is ``≤ 10⁻¹²`` wherever ``E Λ > 10⁻⁹`` and the absolute
error ``< 10⁻¹⁵`` everywhere. Gauss–Hermite quadrature on ``N(μ, v)`` is not used because it
fails for large ``v``: it cannot resolve ``Λ``'s unit-width bump inside a wide Gaussian (32 nodes:
relative error 4·10⁻² at ``v = 30``, 0.4 at ``v = 100``; 128 nodes: 0.02 at ``v = 100``). The
loss value uses ``E softplus(η) = E G(η) + E[softplus − G](η)`` with
``G(η) = η Φ(η) + φ(η)`` (the Gaussian-smoothed ReLU, ``E_{N(μ, v)} G = μ Φ(μ/τ) + τ φ(μ/τ)``,
``τ = √(v + 1)``) and the same rule for the decaying remainder, so that its autograd Hessian
matches :meth:`ExpectedBCE.hessian_diag` to round-off.

**Multi-class** (``K ≥ 2``) is not offered: the expected ``C×C`` block
``E[diag p − p pᵀ]`` needs each pixel's ``K``-dimensional marginal. :meth:`ExpectedBCE.targets`
and :meth:`LogsumexpBCE.targets` refuse ``K ≥ 2`` SSN outputs.

Shapes: logits ``μ`` ``[N, 1, *]``; targets ``[N, 2, *]`` (mask, ``v``) for
:class:`ExpectedBCE` and ``[N, 1 + M, *]`` (mask, ``ε^(1…M)``) for :class:`LogsumexpBCE`. Both
losses are summed over the batch (laplace-torch's ``reduction="sum"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lsn_ext.models.ssn import SSNOutput
from lsn_ext.rules.losses import BCEWithLogits, check_batch

__all__ = ["ExpectedBCE", "LogsumexpBCE", "expected_value", "marginal_variance"]

# Trapezoid rule: step ½, nodes t_j = j/2 for j = −80…80 (see the module documentation).
_STEP = 0.5
_HALF_SPAN = 80


def _softplus(eta: Tensor) -> Tensor:
    """``log(1 + e^η)`` accurate everywhere (torch's ``F.softplus`` returns ``η`` above 20)."""
    return torch.logaddexp(eta, torch.zeros_like(eta))


def _logistic_curvature(eta: Tensor) -> Tensor:
    """``σ(η) σ(−η)`` without the cancellation of ``σ(1 − σ)`` at large ``η``."""
    return torch.sigmoid(eta) * torch.sigmoid(-eta)


def _softplus_remainder(eta: Tensor) -> Tensor:
    """``softplus(η) − (η Φ(η) + φ(η))``, an even function decaying as ``e^{−|η|}``.

    Written in ``a = |η|`` with the common ReLU cancelled exactly; ``a`` has derivative ``+1``
    at 0 (not torch's 0 for ``abs``), so autograd's second derivative is right at ``η = 0``.
    """
    a = torch.where(eta >= 0, eta, -eta)
    smooth = torch.exp(-0.5 * a * a) / math.sqrt(2 * math.pi) - a * torch.special.ndtr(-a)
    return torch.log1p(torch.exp(-a)) - smooth


def expected_value(f: Callable[[Tensor], Tensor], mean: Tensor, variance: Tensor) -> Tensor:
    """``E_{η ~ N(mean, variance)} f(η)`` per entry by the trapezoid rule of the module docs.

    Accurate for functions like ``σ(η)σ(−η)`` that are analytic in the strip ``|Im η| < π``
    and decay at least like ``e^{−|η|}`` (for ``v ≥ 1`` only ``[c − 40, c + 40]`` is sampled).

    Args:
        f: An elementwise function.
        mean: ``μ``, any shape; differentiable (the nodes follow ``μ``).
        variance: ``v ≥ 0``, broadcastable to ``mean``.

    Returns:
        Shaped like ``mean``.
    """
    variance = variance.expand_as(mean)
    std = variance.sqrt()
    narrow = std < 1
    centre = torch.where(
        narrow, mean, mean - torch.minimum(torch.maximum(mean, -variance), variance)
    )
    scale = torch.where(narrow, std, torch.ones_like(std))
    inv_std = torch.where(narrow, torch.ones_like(std), 1 / std.clamp_min(1))  # scale / std
    total = torch.zeros_like(mean)
    for j in range(-_HALF_SPAN, _HALF_SPAN + 1):
        t = j * _STEP
        eta = centre + scale * t
        z = torch.where(narrow, torch.full_like(std, t), (eta - mean) * inv_std)
        total = total + f(eta) * torch.exp(-0.5 * z * z) * inv_std
    return total * (_STEP / math.sqrt(2 * math.pi))


def marginal_variance(output: SSNOutput) -> Tensor:
    """Each logit's marginal variance ``v = d + |P_s|²`` (the diagonal of ``Σ``), ``[N, K, H, W]``.

    ``cov_factor`` is ``[N, D, r]`` in class-major order, so its row norms reshape to
    ``[N, K, H, W]`` directly.
    """
    return output.cov_diag + output.cov_factor.square().sum(-1).reshape(output.mean.shape)


def _binary_mask(output: SSNOutput, y: Tensor, what: str) -> Tensor:
    """The mask as ``[N, 1, H, W]`` in the mean's dtype; refuse ``K ≥ 2`` and mismatched masks."""
    if not isinstance(output, SSNOutput):
        raise TypeError(f"{what}.targets takes an SSNOutput, got {type(output).__name__}")
    N, K, H, W = output.mean.shape
    if K != 1:
        raise ValueError(
            f"{what} supports binary SSNs (one logit channel, K = 1), got K = {K}: the expected "
            "C×C curvature block of K ≥ 2 classes needs each pixel's K-dimensional marginal. "
            "Use curvature='ce' for multi-class SSNs"
        )
    if not isinstance(y, Tensor):
        raise TypeError(f"masks must be a tensor, got {type(y).__name__}")
    if y.numel() != N * H * W:
        raise ValueError(
            f"masks of shape {tuple(y.shape)} do not match the SSN's logits "
            f"{tuple(output.mean.shape)}: give [N, 1, H, W] (or [N, H, W]) masks"
        )
    return y.reshape(N, 1, H, W).to(output.mean.dtype)


class _NoisyBCE(BCEWithLogits):
    """BCE on mean logits ``[N, 1, *]`` whose targets ``[N, 1 + c, *]`` add ``c`` channels."""

    extra_name = ""

    def __init__(self, pos_weight: Tensor | float | None = None):
        super().__init__(pos_weight=pos_weight)

    def _extra_channels(self) -> int:
        raise NotImplementedError

    def check(self, logits: Tensor, targets: Tensor) -> Tensor:
        name, c = type(self).__name__, self._extra_channels()
        check_batch(logits, targets, name)
        if logits.dim() < 2 or logits.shape[1] != 1:
            raise ValueError(
                f"{name} takes the mean logits of a binary SSN, [N, 1, *]; got shape "
                f"{tuple(logits.shape)}"
            )
        expected = (logits.shape[0], 1 + c, *logits.shape[2:])
        if tuple(targets.shape) != expected:
            raise ValueError(
                f"{name} targets must be {expected}: the mask and {self.extra_name} on dim 1 "
                f"(build them with {name}.targets(ssn.distribution(x), y)); got "
                f"{tuple(targets.shape)}"
            )
        targets = targets.to(logits.dtype)
        mask = targets[:, :1]
        outside = ~((mask >= 0) & (mask <= 1))  # NaN compares False: caught here
        if bool(outside.any()):
            raise ValueError(
                f"{name} masks (channel 0 of the targets) must lie in [0, 1]; found "
                f"{mask[outside][0].item()} at {int(outside.sum())} entries"
            )
        if not bool(torch.isfinite(targets[:, 1:]).all()):
            raise ValueError(f"{name}: the {self.extra_name} in the targets are not finite")
        return targets

    def _coefficients(self, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``a = w₊ y + 1 − y`` and ``b = w₊ y``: ``−log p(y | η) = a softplus(η) − b η``."""
        pw = 1.0 if self.pos_weight is None else self.pos_weight.to(mask)
        return pw * mask + 1 - mask, pw * mask


class ExpectedBCE(_NoisyBCE):
    r"""The per-pixel expected binary NLL under the SSN's logit noise, a loss of ``μ``.

    ``L_E(μ) = Σ_n Σ_s E_{η ~ N(μ_s, v_s)} [a_s softplus(η) − w₊ y_s η]`` with
    ``a = w₊ y + 1 − y``; exact Hessian ``diag(a E σ(η)σ(−η))`` (PSD, diagonal). Targets
    ``[N, 2, *]``: the mask ``y ∈ [0, 1]`` and the marginal variance ``v ≥ 0`` of each logit
    (:meth:`targets`). Quadrature and derivation: the module documentation.

    Args:
        pos_weight: Weight ``w₊`` of the foreground term (as in the SSN's loss).
    """

    extra_name = "marginal logit variances"

    def _extra_channels(self) -> int:
        return 1

    def check(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Validate the packed targets: shape ``[N, 2, *]``, mask in ``[0, 1]``, ``v ≥ 0``.

        Args:
            logits: The mean logits ``μ`` of a binary SSN, ``[N, 1, *]``.
            targets: ``[N, 2, *]``: the mask in ``[0, 1]`` and the marginal variance ``v ≥ 0``
                (:meth:`targets`).

        Returns:
            The targets in the logits' dtype.

        Raises:
            ValueError: For logits that are not ``[N, 1, *]``, targets of another shape, a mask
                outside ``[0, 1]``, or negative or non-finite variances.
            TypeError: For targets that are not a tensor.
        """
        targets = super().check(logits, targets)
        if bool((targets[:, 1:] < 0).any()):
            raise ValueError("ExpectedBCE: the marginal variances (channel 1) must be >= 0")
        return targets

    @staticmethod
    def targets(output: SSNOutput, y: Tensor) -> Tensor:
        """Pack the mask and the SSN's marginal variance ``d + |P_s|²`` into ``[N, 2, H, W]``.

        Args:
            output: ``ssn.distribution(x)`` (binary SSN, ``K = 1``); computed without gradients.
            y: Masks ``[N, 1, H, W]`` or ``[N, H, W]`` in ``[0, 1]``.

        Returns:
            ``[N, 2, H, W]``: the mask, then ``v`` (detached).

        Raises:
            ValueError: For ``K ≥ 2`` or masks that do not match the logits.
            TypeError: For an ``output`` that is not an :class:`~lsn_ext.models.SSNOutput`.
        """
        mask = _binary_mask(output, y, "ExpectedBCE")
        return torch.cat([mask, marginal_variance(output).detach()], 1)

    def value(self, logits: Tensor, targets: Tensor) -> Tensor:
        """``L_E(μ) = Σ_n Σ_s E_{η ~ N(μ_s, v_s)} [a_s softplus(η) − w₊ y_s η]``, by quadrature.

        Args:
            logits: The mean logits ``μ`` of a binary SSN, ``[N, 1, *]``.
            targets: ``[N, 2, *]``: the mask in ``[0, 1]`` and the marginal variance ``v ≥ 0``
                (:meth:`targets`).

        Returns:
            The scalar loss, summed over the batch; its autograd Hessian matches
            :meth:`hessian_diag` to round-off.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        targets = self.check(logits, targets)
        mask, variance = targets[:, :1], targets[:, 1:]
        a, b = self._coefficients(mask)
        tau = (variance + 1).sqrt()
        r = logits / tau
        smoothed_relu = logits * torch.special.ndtr(r) + tau * torch.exp(-0.5 * r * r) / math.sqrt(
            2 * math.pi
        )
        softplus = smoothed_relu + expected_value(_softplus_remainder, logits, variance)
        return (a * softplus - b * logits).sum()

    def hessian_diag(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The exact Hessian ``a_s E_{N(μ_s, v_s)} σ(η)σ(−η)``: diagonal and PSD.

        Args:
            logits: The mean logits ``μ`` of a binary SSN, ``[N, 1, *]``.
            targets: ``[N, 2, *]``: the mask in ``[0, 1]`` and the marginal variance ``v ≥ 0``
                (:meth:`targets`).

        Returns:
            Non-negative, ``[N, 1, *]`` like the logits.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        targets = self.check(logits, targets)
        a, _ = self._coefficients(targets[:, :1])
        return a * expected_value(_logistic_curvature, logits, targets[:, 1:])


class LogsumexpBCE(_NoisyBCE):
    r"""The SSN training loss (LSN Eq. 11) with fixed noise draws, a loss of ``μ``.

    ``L(μ) = Σ_n [−logsumexp_m ℓ_m + log M]``, ``ℓ_m = Σ_s log p(y_s | μ_s + ε_s^(m))``.
    :meth:`hessian_diag` is the PSD part ``Σ_m w_m Λ(η^(m))`` (importance weights
    ``w = softmax(ℓ)`` held fixed); :meth:`exact_hessian_diag` subtracts ``diag Cov_w(g)``.
    Targets ``[N, 1 + M, *]``: the mask and the ``M`` draws ``ε^(m)`` (:meth:`targets`).
    Derivation: the module documentation.

    Args:
        pos_weight: Weight ``w₊`` of the foreground term (as in the SSN's loss).
        n_samples: ``M``, the draws per image (the LSN paper: 20).
        antithetic: Draw mirrored pairs ``±ε`` as :func:`lsn_ext.models.ssn_loss` does
            (``M`` even).

    Raises:
        ValueError: For ``M < 1``, or an odd ``M`` with ``antithetic=True``.
    """

    extra_name = "noise draws"

    def __init__(
        self,
        pos_weight: Tensor | float | None = None,
        n_samples: int = 20,
        *,
        antithetic: bool = True,
    ):
        super().__init__(pos_weight=pos_weight)
        if (
            isinstance(n_samples, bool)
            or not isinstance(n_samples, int)
            or n_samples < 1
            or (antithetic and n_samples % 2)
        ):
            raise ValueError(
                f"n_samples must be a positive int (even for antithetic draws, as in ssn_loss), "
                f"got {n_samples!r}"
            )
        self.n_samples, self.antithetic = n_samples, antithetic

    def _extra_channels(self) -> int:
        return self.n_samples

    def targets(
        self, output: SSNOutput, y: Tensor, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """Pack the mask and ``M`` draws ``ε^(m) ~ N(0, Σ)`` into ``[N, 1 + M, H, W]``.

        Args:
            output: ``ssn.distribution(x)`` (binary SSN, ``K = 1``); computed without gradients.
            y: Masks ``[N, 1, H, W]`` or ``[N, H, W]`` in ``[0, 1]``.
            generator: Random generator of the draws (on the device of ``output``).

        Returns:
            ``[N, 1 + M, H, W]``: the mask, then the ``M`` draws (antithetic pairs when
            ``antithetic=True``).

        Raises:
            ValueError: For ``K ≥ 2`` or masks that do not match the logits.
            TypeError: For an ``output`` that is not an :class:`~lsn_ext.models.SSNOutput`.
        """
        mask = _binary_mask(output, y, "LogsumexpBCE")
        centred = SSNOutput(
            torch.zeros_like(output.mean), output.cov_diag.detach(), output.cov_factor.detach()
        )
        noise = centred.rsample(self.n_samples, antithetic=self.antithetic, generator=generator)
        return torch.cat([mask, noise[:, :, 0].transpose(0, 1)], 1)

    def _draws(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``η^(m)`` ``[N, M, *]``, ``ℓ_m`` ``[N, M]``, ``a`` and ``b`` ``[N, 1, *]``."""
        targets = self.check(logits, targets)
        a, b = self._coefficients(targets[:, :1])
        eta = logits + targets[:, 1:]
        log_lik = -(a * _softplus(eta) - b * eta).flatten(2).sum(-1)
        return eta, log_lik, a, b

    def _importance_weights(self, log_lik: Tensor, like: Tensor) -> Tensor:
        """``w_m = softmax_m(ℓ_m)``, shaped ``[N, M, 1, …]`` to broadcast against ``like``."""
        w = torch.softmax(log_lik, 1)
        return w.reshape(*w.shape, *([1] * (like.dim() - 2)))

    def value(self, logits: Tensor, targets: Tensor) -> Tensor:
        """LSN Eq. 11 with the draws held fixed, ``Σ_n [−logsumexp_m ℓ_m + log M]``.

        Args:
            logits: The mean logits ``μ`` of a binary SSN, ``[N, 1, *]``.
            targets: ``[N, 1 + M, *]``: the mask in ``[0, 1]`` and the ``M`` draws ``ε^(m)``
                (:meth:`targets`).

        Returns:
            The scalar loss, summed over the batch.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        _, log_lik, _, _ = self._draws(logits, targets)
        return (math.log(self.n_samples) - torch.logsumexp(log_lik, 1)).sum()

    def hessian_diag(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The PSD part ``Σ_m w_m Λ(η^(m))`` of the Hessian (importance weights held fixed).

        An approximation: the exact diagonal (:meth:`exact_hessian_diag`) also subtracts
        ``Σ_m w_m (g_m − ḡ)²``; both agree at zero noise.

        Args:
            logits: The mean logits ``μ`` of a binary SSN, ``[N, 1, *]``.
            targets: ``[N, 1 + M, *]``: the mask in ``[0, 1]`` and the ``M`` draws ``ε^(m)``
                (:meth:`targets`).

        Returns:
            Non-negative, ``[N, 1, *]`` like the logits.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        eta, log_lik, a, _ = self._draws(logits, targets)
        w = self._importance_weights(log_lik, eta)
        return a * (w * _logistic_curvature(eta)).sum(1, keepdim=True)

    def exact_hessian_diag(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The diagonal of the exact Hessian, ``Σ_m w_m Λ(η^(m)) − Σ_m w_m (g_m − ḡ)²``.

        Not PSD in general (it can be negative).

        Args:
            logits: The mean logits ``μ`` of a binary SSN, ``[N, 1, *]``.
            targets: ``[N, 1 + M, *]``: the mask in ``[0, 1]`` and the ``M`` draws ``ε^(m)``
                (:meth:`targets`).

        Returns:
            ``[N, 1, *]`` like the logits.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        eta, log_lik, a, b = self._draws(logits, targets)
        w = self._importance_weights(log_lik, eta)
        g = b - a * torch.sigmoid(eta)
        centred = g - (w * g).sum(1, keepdim=True)
        psd = a * (w * _logistic_curvature(eta)).sum(1, keepdim=True)
        return psd - (w * centred.square()).sum(1, keepdim=True)
