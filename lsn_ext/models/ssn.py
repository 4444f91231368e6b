"""Stochastic Segmentation Network (Monteiro et al. 2020): a low-rank Gaussian over all logits.

Shape legend: ``N`` batch, ``F`` backbone features, ``K`` logit channels (1 for binary
segmentation with a sigmoid, the number of classes for a softmax), ``H``/``W`` height and width,
``D = K·H·W`` the event size, ``r`` the rank, ``M`` logit samples.

Flattening is class-major: logit ``(k, h, w)`` is entry ``k·H·W + h·W + w`` of the event, i.e.
``logits.reshape(N, D)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributions import Distribution, Independent, LowRankMultivariateNormal, Normal

from lsn_ext._memory import check_sample_memory
from lsn_ext.models.unet import UNet

__all__ = ["SSN", "SSNOutput", "ssn_loss"]


@dataclass
class SSNOutput:
    """The SSN's logit distribution ``η ~ N(μ, diag(d) + P Pᵀ)`` for a batch, as tensors.

    Sampling (:meth:`rsample`) needs no factorisation, so it always works; only
    :meth:`distribution` (for ``log_prob`` or ``entropy``) factorises the capacitance matrix.

    Attributes:
        mean: ``μ``, ``[N, K, H, W]``.
        cov_diag: ``d = exp(log_diag) + ε``, ``[N, K, H, W]``.
        cov_factor: ``P``, ``[N, D, r]`` (rows in class-major order).
    """

    mean: Tensor
    cov_diag: Tensor
    cov_factor: Tensor

    @property
    def rank(self) -> int:
        """The rank ``r`` of the factor."""
        return self.cov_factor.shape[-1]

    def rsample(
        self, n_samples: int, *, antithetic: bool = True, generator: torch.Generator | None = None
    ) -> Tensor:
        """Reparameterised logit samples ``η = μ + √d ⊙ z₁ + P z₂``, ``z₁, z₂ ~ N(0, I)``.

        With ``antithetic=True`` (Monteiro et al. 2020) half of the samples are the mirror images
        ``μ − (√d ⊙ z₁ + P z₂)`` of the other half: sample ``m + M/2`` mirrors sample ``m``.

        Args:
            n_samples: ``M`` (even when antithetic).
            antithetic: Mirror the samples about the mean.
            generator: Random generator (on the device of the tensors).

        Returns:
            ``[M, N, K, H, W]``.

        Raises:
            ValueError: If ``M < 1``, ``M`` is odd with ``antithetic=True``, or the samples need
                more than the device's memory.
        """
        if n_samples < 1 or (antithetic and n_samples % 2):
            raise ValueError(
                f"n_samples must be positive (and even for antithetic sampling), got {n_samples}"
            )
        check_sample_memory(
            "n_samples",
            n_samples,
            self.mean.numel(),
            self.mean,
            "use fewer logit samples (the SSN and LSN papers use 20), or a smaller batch",
        )
        n_draw = n_samples // 2 if antithetic else n_samples
        N = self.mean.shape[0]
        like = self.mean
        opts = {"generator": generator, "dtype": like.dtype, "device": like.device}
        z1 = torch.randn(n_draw, *like.shape, **opts)
        z2 = torch.randn(n_draw, N, self.rank, 1, **opts)
        noise = self.cov_diag.sqrt() * z1 + (self.cov_factor @ z2).reshape(n_draw, *like.shape)
        if antithetic:
            noise = torch.cat([noise, -noise])
        return self.mean + noise

    def covariance(self) -> Tensor:
        """The dense covariance ``diag(d) + P Pᵀ``, ``[N, D, D]`` (for tests and small images).

        Returns:
            ``[N, D, D]`` with ``D = K·H·W``, ``O(D²)`` memory per image.
        """
        P = self.cov_factor
        return torch.diag_embed(self.cov_diag.flatten(1)) + P @ P.transpose(-1, -2)

    def distribution(self) -> Distribution:
        """The distribution as ``torch.distributions.LowRankMultivariateNormal`` over ``[N, D]``.

        Rank 0 (a diagonal-only covariance, the paper's "(diag)" models) gives the same
        distribution as ``Independent(Normal(μ, √d), 1)``, since torch's low-rank class needs a
        factor with at least one column.

        torch factorises the capacitance ``I + Pᵀ diag(d)⁻¹ P`` (``r × r``) with a Cholesky
        decomposition. It is positive definite in exact arithmetic, but in float32 the
        factorisation fails when ``P`` grows large against ``d`` over large uniform regions
        (SSN issue #4). Then the same distribution is built again in float64, which recovers
        all cases we have seen; if that fails too, a ``ValueError`` says why. The distribution
        is never replaced by a different (e.g. diagonal) one.

        Returns:
            A ``LowRankMultivariateNormal`` (or, for rank 0, an ``Independent(Normal)``) with
            batch shape ``[N]`` and event shape ``[D]``, ``D = K·H·W``; in float64 when the
            float32 factorisation failed.

        Raises:
            ValueError: If the capacitance matrix cannot be factorised even in float64.
        """
        loc, diag, factor = self.mean.flatten(1), self.cov_diag.flatten(1), self.cov_factor
        if factor.shape[-1] == 0:
            return Independent(Normal(loc, diag.sqrt(), validate_args=False), 1)
        try:
            return LowRankMultivariateNormal(loc, factor, diag, validate_args=False)
        except torch.linalg.LinAlgError:
            pass
        try:
            return LowRankMultivariateNormal(
                loc.double(), factor.double(), diag.double(), validate_args=False
            )
        except torch.linalg.LinAlgError as err:
            ratio = (factor.pow(2).sum(-1) / diag).max().item()
            raise ValueError(
                "the SSN covariance cannot be factorised (Cholesky of the capacitance "
                f"I + Pᵀ D⁻¹ P failed in {loc.dtype} and in float64): max_i |P_i|²/d_i = "
                f"{ratio:.3g}, min d = {diag.min().item():.3g}. The low-rank factor has grown "
                "far beyond the diagonal (large uniform regions; SSN issue #4). Raise eps, "
                "lower the learning rate, or clip the factor head's output. Sampling "
                "(SSNOutput.rsample) and ssn_loss do not need this factorisation."
            ) from err


class SSN(nn.Module):
    """Stochastic Segmentation Network: a backbone and three 1×1 convolution heads.

    From the backbone's feature map ``h(x)`` (``[N, F, H, W]``) the heads give the logit mean
    ``μ = W_μ * h``, the log-diagonal ``log(d − ε) = W_d * h`` and the factor ``P = W_P * h``
    (``K·r`` channels, regrouped to ``[N, D, r]``), so that ``η ~ N(μ, diag(d) + P Pᵀ)`` over all
    ``D = K·H·W`` logits (LSN Eq. 7–8). Binary segmentation uses ``K = 1`` and a sigmoid; ``K ≥ 2``
    a softmax over the classes.

    ``forward`` returns the mean ``μ`` only, so the SSN is a drop-in segmentation network;
    :meth:`distribution` gives the whole logit distribution. The submodules ``backbone`` and
    ``mean_head`` form the mean network that the Laplacian Segmentation Network puts a posterior
    on (:class:`lsn_ext.lsn.MeanNetwork`); ``log_diag_head`` and ``factor_head`` are the variance
    heads.

    Args:
        backbone: Maps ``[N, C_in, H, W]`` images to ``[N, F, H, W]`` features.
        features: ``F``.
        num_classes: ``K`` (1: binary with sigmoid).
        rank: ``r``, the rank of the covariance factor (the LSN paper: 10; 0: diagonal only,
            ``factor_head`` is ``None``).
        eps: ``ε``, added to the diagonal.

    Raises:
        ValueError: For non-positive sizes, a negative rank or ``eps < 0``.

    Example:
        >>> ssn = SSN.with_unet(1, widths=(8, 16), rank=4)
        >>> out = ssn.distribution(torch.zeros(2, 1, 16, 16))
        >>> out.rsample(6).shape
        torch.Size([6, 2, 1, 16, 16])
    """

    def __init__(
        self,
        backbone: nn.Module,
        features: int,
        num_classes: int = 1,
        rank: int = 10,
        eps: float = 1e-5,
    ):
        super().__init__()
        for name, value in (("features", features), ("num_classes", num_classes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"rank must be a non-negative int (0: diagonal only), got {rank!r}")
        if not eps >= 0:
            raise ValueError(f"eps must be non-negative, got {eps!r}")
        self.num_classes, self.rank, self.eps = num_classes, rank, float(eps)
        self.backbone = backbone
        self.mean_head = nn.Conv2d(features, num_classes, 1)
        self.log_diag_head = nn.Conv2d(features, num_classes, 1)
        self.factor_head = nn.Conv2d(features, num_classes * rank, 1) if rank else None

    @classmethod
    def with_unet(
        cls,
        in_channels: int,
        num_classes: int = 1,
        *,
        widths: Sequence[int] = (8, 16, 32, 64, 128),
        activation: Callable[[], nn.Module] = nn.Tanh,
        rank: int = 10,
        eps: float = 1e-5,
        dropout: float = 0.0,
        upsampling: str = "nearest",
    ) -> SSN:
        """An SSN on a :class:`~lsn_ext.models.UNet` backbone (the LSN paper's model).

        The backbone is the U-Net without its 1×1 output convolution (``head`` is an
        ``nn.Identity``): its features are the last decoder block's ``widths[0]`` activations.

        Args:
            in_channels: Channels of the input images.
            num_classes: ``K`` (1: binary with sigmoid).
            widths: The U-Net's feature maps per level (see :class:`~lsn_ext.models.UNet`);
                ``H`` and ``W`` must be divisible by ``2 ** (len(widths) - 1)``.
            activation: Zero-argument callable returning the U-Net's activation module.
            rank: ``r``, the rank of the covariance factor (0: diagonal only).
            eps: ``ε``, added to the diagonal.
            dropout: The U-Net's ``nn.Dropout2d`` rate (0: none).
            upsampling: ``"nearest"`` (default), ``"bilinear"`` or ``"transposed"``.

        Returns:
            The SSN, with ``widths[0]`` features into its heads.

        Raises:
            ValueError: As :class:`~lsn_ext.models.UNet` and :class:`SSN`.
        """
        backbone = UNet(
            in_channels,
            widths[0],
            widths=widths,
            activation=activation,
            upsampling=upsampling,
            dropout=dropout,
        )
        backbone.head = nn.Identity()
        return cls(backbone, widths[0], num_classes, rank, eps)

    def forward(self, x: Tensor) -> Tensor:
        """The logit mean ``μ(x)``, so that the SSN is a drop-in segmentation network.

        Args:
            x: Images ``[N, C_in, H, W]``.

        Returns:
            ``μ``, ``[N, K, H, W]``.
        """
        return self.mean_head(self.backbone(x))

    def distribution(self, x: Tensor) -> SSNOutput:
        """The logit distribution ``N(μ, diag(d) + P Pᵀ)`` for a batch of images.

        Args:
            x: Images ``[N, C_in, H, W]``.

        Returns:
            The :class:`SSNOutput`: ``mean`` and ``cov_diag`` ``[N, K, H, W]``, ``cov_factor``
            ``[N, K·H·W, r]``.

        Raises:
            ValueError: For non-finite images or a non-finite distribution (naming which part).
        """
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise ValueError(
                f"the images {tuple(x.shape)} have {int((~torch.isfinite(x)).sum())} non-finite "
                "(NaN or inf) entries; clean or mask them"
            )
        h = self.backbone(x)
        mean = self.mean_head(h)
        cov_diag = self.log_diag_head(h).exp() + self.eps
        N, K, H, W = mean.shape
        if self.factor_head is None:
            factor = mean.new_zeros(N, K * H * W, 0)
        else:
            factor = self.factor_head(h).view(N, self.rank, K * H * W).transpose(1, 2)
        for name, t in (("mean", mean), ("cov_diag", cov_diag), ("cov_factor", factor)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(
                    f"the SSN's {name} is not finite ({int((~torch.isfinite(t)).sum())} entries): "
                    "non-finite weights, or log_diag_head overflowing exp; check the weights"
                )
        return SSNOutput(mean, cov_diag, factor)

    def extra_repr(self) -> str:
        """Classes, rank and ε, shown in ``repr(model)``.

        Returns:
            ``"num_classes=…, rank=…, eps=…"``.
        """
        return f"num_classes={self.num_classes}, rank={self.rank}, eps={self.eps}"


def _log_likelihood(logits: Tensor, y: Tensor, pos_weight: float) -> Tensor:
    """``Σ_s log p(y_s | η_s)`` per sample and image: ``[M, N, K, H, W] → [M, N]``."""
    if logits.shape[2] == 1:
        target = y.reshape(logits.shape[1:]).to(logits.dtype).expand_as(logits)
        pw = torch.tensor(pos_weight, dtype=logits.dtype, device=logits.device)
        nll = F.binary_cross_entropy_with_logits(logits, target, reduction="none", pos_weight=pw)
        return -nll.flatten(2).sum(-1)
    M, N = logits.shape[:2]
    target = y.reshape(N, *logits.shape[3:]).long().expand(M, N, *logits.shape[3:])
    nll = F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1), reduction="none")
    return -nll.view(M, N, -1).sum(-1)


def _check_targets(y: Tensor, K: int) -> None:
    """Masks in ``[0, 1]`` for ``K = 1``; integer class indices in ``[0, K)`` otherwise."""
    if not isinstance(y, Tensor):
        raise TypeError(f"targets must be a tensor, got {type(y).__name__}")
    if K == 1:
        yf = y.double()
        outside = ~((yf >= 0) & (yf <= 1))  # NaN compares False: caught here
        if bool(outside.any()):
            raise ValueError(
                f"binary SSN targets (K = 1) must lie in [0, 1]; found {yf[outside][0].item()} "
                f"at {int(outside.sum())} entries"
            )
        return
    if y.is_floating_point():
        bad = ~torch.isfinite(y) | (y != y.round())
        if bool(bad.any()):
            raise ValueError(
                f"SSN targets for K = {K} classes must be integer class indices; found "
                f"{y[bad][0].item()} (dtype {y.dtype})"
            )
    elif y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"SSN targets for K = {K} classes must be class indices, got {y.dtype}")
    outside = (y < 0) | (y >= K)
    if bool(outside.any()):
        raise ValueError(
            f"SSN target {y[outside][0].item()} is outside the classes [0, {K}) "
            f"({int(outside.sum())} entries)"
        )


def ssn_loss(
    output: SSNOutput,
    y: Tensor,
    n_samples: int = 20,
    *,
    antithetic: bool = True,
    pos_weight: float = 1.0,
    reduction: str = "mean",
    generator: torch.Generator | None = None,
    objective: str = "logsumexp",
) -> Tensor:
    """The SSN loss per image, from ``M`` logit samples ``η^(m)`` of :meth:`SSNOutput.rsample`.

    - ``objective="logsumexp"`` (LSN Eq. 11, the SSN paper's loss): a Monte Carlo estimate of
      the image's marginal likelihood, ``L = −logsumexp_m Σ_s log p(y_s | η_s^(m)) + log M``
      (``−log E_η p(y | η)``; biased for finite ``M``, which favours a wide logit distribution:
      one sample that fits the image suffices).
    - ``objective="expected"``: the per-pixel expected negative log-likelihood under the logit
      distribution, ``L_E = −(1/M) Σ_m Σ_s log p(y_s | η_s^(m))`` (an unbiased estimate of
      ``−Σ_s E_η log p(y_s | η_s)``, an upper bound of ``−log E_η p(y | η)`` by Jensen). It
      depends on the covariance only through each pixel's marginal, so it cannot learn the
      low-rank factor's cross-pixel correlations beyond their marginal variance.

    With zero covariance both are the summed binary cross-entropy (``K = 1``, Bernoulli with
    ``σ(η)``) or cross-entropy (``K ≥ 2``); with ``M = 1`` they coincide.

    Args:
        output: The SSN's distribution for the batch.
        y: Binary masks ``[N, 1, H, W]`` (or ``[N, H, W]``) for ``K = 1``; class indices
            ``[N, H, W]`` (or ``[N, 1, H, W]``) for ``K ≥ 2``.
        n_samples: ``M`` (the LSN and SSN papers: 20).
        antithetic: Mirrored samples.
        pos_weight: Weight of the foreground term in the binary log-likelihood
            (``pos_weight · y log σ(η) + (1 − y) log(1 − σ(η))``); 1 is the plain likelihood.
        reduction: ``"mean"`` or ``"sum"`` over the images, or ``"none"`` (``[N]``).
        generator: Random generator.
        objective: ``"logsumexp"`` (Eq. 11) or ``"expected"`` (per-pixel expected NLL).

    Returns:
        The loss (a scalar, or ``[N]``).

    Raises:
        ValueError: For an unknown ``reduction`` or ``objective``, a target that does not match
            the logits, binary masks outside ``[0, 1]`` (or NaN), or class indices that are not
            integers in ``[0, K)``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if objective not in ("logsumexp", "expected"):
        raise ValueError(f"objective must be 'logsumexp' or 'expected', got {objective!r}")
    N, _, H, W = output.mean.shape
    if y.numel() != N * H * W:
        raise ValueError(
            f"target of shape {tuple(y.shape)} does not match logits {tuple(output.mean.shape)}: "
            f"expected {N * H * W} entries ([N, 1, H, W] masks or [N, H, W] class indices)"
        )
    _check_targets(y, output.mean.shape[1])
    logits = output.rsample(n_samples, antithetic=antithetic, generator=generator)
    log_lik = _log_likelihood(logits, y, pos_weight)  # [M, N]
    if objective == "expected":
        loss = -log_lik.mean(0)
    else:
        loss = -torch.logsumexp(log_lik, 0) + math.log(n_samples)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss
