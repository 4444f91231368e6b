r"""Running moments of a stream of tensors: Welford's mean, variance and per-position covariance.

The predictives (:func:`lsn_ext.predict`, :mod:`lsn_ext.lsn`) average over posterior samples one
at a time, so that memory does not grow with the number of samples. :class:`RunningMoments` keeps
the running mean and the sum of squared deviations of the samples ``x_1 … x_k`` (Welford 1962):

.. math::

    δ = x_k - \bar x_{k-1}, \qquad \bar x_k = \bar x_{k-1} + δ / k, \qquad
    M_k = M_{k-1} + δ ⊙ (x_k - \bar x_k),

and the unbiased variance ``M_k / (k − 1)``. With ``second="covariance"`` the second moment is
the per-position covariance over the class axis (dim 1), ``M_k = M_{k−1} + δ (x_k − x̄_k)ᵀ``,
``[N, C, C, *]`` for samples ``[N, C, *]``; with ``second=None`` only the mean is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch import Tensor

__all__ = ["RunningMoments", "SecondMoment"]

SecondMoment = Literal["variance", "covariance"] | None
_SECOND = ("variance", "covariance", None)


class RunningMoments:
    """Running mean and (co)variance of tensor samples of one shape (Welford).

    Attributes:
        count: The number of samples added, ``k``.
        mean: ``x̄_k``, shaped like a sample (``None`` before the first).
        m2: The sum of squared deviations ``M_k``: shaped like a sample for ``"variance"``,
            ``[N, C, C, *]`` for ``"covariance"``; ``None`` before the first sample and for
            ``second=None``.

    Args:
        second: ``"variance"`` (default, elementwise), ``"covariance"`` (over dim 1 per
            position, for samples ``[N, C, *]``) or ``None`` (the mean only).

    Raises:
        ValueError: For another ``second``.
    """

    def __init__(self, second: SecondMoment = "variance"):
        if second not in _SECOND:
            raise ValueError(f"second must be one of {_SECOND}, got {second!r}")
        self.second = second
        self.count = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None

    def add(self, x: Tensor) -> None:
        """Add one sample ``x`` (``x`` is neither kept nor changed)."""
        self.count += 1
        if self.mean is None:
            # zeros_like keeps the samples' memory layout (channels_last, the outer product's)
            self.mean = torch.zeros_like(x)
            if self.second == "covariance":
                self.m2 = torch.zeros_like(x.unsqueeze(2) * x.unsqueeze(1))
            elif self.second == "variance":
                self.m2 = torch.zeros_like(x)
        delta = x - self.mean
        self.mean += delta / self.count
        if self.second == "covariance":
            self.m2 += delta.unsqueeze(2) * (x - self.mean).unsqueeze(1)
        elif self.second == "variance":
            self.m2 += delta * (x - self.mean)

    def extend(self, samples: Iterable[Tensor]) -> None:
        """Add every sample of ``samples`` in order (a tensor ``[S, …]`` is ``S`` samples)."""
        for x in samples:
            self.add(x)

    @property
    def variance(self) -> Tensor:
        """The unbiased (co)variance ``M_k / (k − 1)``.

        Raises:
            ValueError: For fewer than two samples, or ``second=None``.
        """
        if self.m2 is None or self.count < 2:
            raise ValueError(
                f"a variance needs at least 2 samples and second='variance' or 'covariance'; "
                f"have {self.count} sample(s) with second={self.second!r}"
            )
        return self.m2 / (self.count - 1)
