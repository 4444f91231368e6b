"""Mixture of Laplaces (Eschenhagen et al. 2021): one Laplace posterior per ensemble member.

The predictive is the equal-weight mixture of the members' predictives (:func:`lsn_ext.predict`
on each). Re-exported as :func:`lsn_ext.lsn.mixture_predict`.

Shape legend: ``N`` batch, ``C`` output channels, ``*`` the spatial axes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from lsn_ext.laplace_ext import (
    LINK_APPROXES,
    PRED_TYPES,
    SegmentationPrediction,
    check_choice,
    check_n_samples,
    link_of,
    predict,
)
from lsn_ext.links import categorical_entropy

__all__ = ["mixture_predict"]


def _total(means: list[Tensor], variances: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Mean and variance of an equal-weight mixture (law of total variance)."""
    stacked = torch.stack(means)
    within = torch.stack(variances).mean(0)
    return stacked.mean(0), within + stacked.var(0, unbiased=False)


@torch.no_grad()
def mixture_predict(
    posteriors: Iterable[Any],
    x: Tensor,
    n_samples: int = 50,
    *,
    pred_type: Literal["glm", "nn"] = "nn",
    link_approx: Literal["mc", "probit", "bridge"] = "mc",
    seed: int = 0,
    progress_bar: bool = False,
) -> SegmentationPrediction:
    r"""Predictive of a mixture of Laplaces: the average of the members' predictives.

    Each member ``k = 0 … K−1`` (a fitted posterior, typically one per ensemble member) gives
    :func:`lsn_ext.predict` ``(la_k, x, n_samples, pred_type, link_approx)`` with a generator
    seeded ``seed + k``: mean ``μ_k`` and variance ``v_k`` of the probabilities ``[N, C, *]``,
    entropy ``H_k`` and mutual information ``I_k`` ``[N, *]``. The mixture's maps are

    .. math::

        E p = \frac1K \sum_k μ_k, \qquad
        \mathrm{Var}\,p = \frac1K \sum_k v_k + \frac1K \sum_k (μ_k - E p)^2, \\
        H = H[E p], \qquad
        I = \max\Big(0,\; H - \frac1K \sum_k (H_k - I_k)\Big),

    the variance by the law of total variance (the population variance of the members' means),
    ``H_k − I_k = E H[p]`` the member's expected entropy, and ``H`` the categorical entropy of
    ``E p`` under the members' link (softmax over ``C``; a sigmoid per channel for a BCE
    posterior). The logit moments combine the same way. Regression posteriors (identity
    link) have no entropy and mutual information (``None``).

    Args:
        posteriors: At least two fitted posteriors that :func:`lsn_ext.predict` takes, with the
            same link and the same output shape on ``x``.
        x: Inputs ``[N, C_in, *]``, as :func:`lsn_ext.predict` takes them.
        n_samples: Posterior samples per member, at least 2.
        pred_type: ``"glm"`` or ``"nn"`` (the default), for every member.
        link_approx: ``"mc"`` (default), ``"probit"`` or ``"bridge"``, for every member.
        seed: Member ``k`` samples with ``torch.Generator(x.device).manual_seed(seed + k)``.
        progress_bar: Show :func:`lsn_ext.predict`'s bars for each member.

    Returns:
        The mixture's :class:`~lsn_ext.SegmentationPrediction`: mean and variance
        ``[N, C, *]``, entropy and mutual information ``[N, *]``, ``n_samples`` the total
        ``K · n_samples``, and the mixture's logit mean and variance where every member has them.

    Raises:
        ValueError: For fewer than two posteriors, ``n_samples < 2``, an unknown ``pred_type``
            or ``link_approx``, members with different links or output shapes (naming the
            member), or any error of :func:`lsn_ext.predict` on a member (prefixed with its
            index).
        TypeError: If a member is not a posterior (naming the member).
    """
    posteriors = list(posteriors)
    if len(posteriors) < 2:
        n = len(posteriors)
        raise ValueError(
            "mixture_predict needs at least 2 posteriors (one per ensemble member) to form a "
            f"mixture; got {n}. For one posterior use lsn_ext.predict(la, x, n_samples)"
        )
    check_n_samples(n_samples)
    check_choice("pred_type", pred_type, PRED_TYPES)
    check_choice("link_approx", link_approx, LINK_APPROXES)
    device = x.device if isinstance(x, Tensor) else None
    preds, links = [], []
    for k, la in enumerate(posteriors):
        try:
            preds.append(
                predict(
                    la,
                    x,
                    n_samples,
                    pred_type=pred_type,
                    link_approx=link_approx,
                    generator=torch.Generator(device=device).manual_seed(seed + k),
                    progress_bar=progress_bar,
                )
            )
            links.append(link_of(la))
        except (TypeError, ValueError) as err:
            raise type(err)(f"mixture_predict: posterior {k}: {err}") from err
        if links[k] != links[0]:
            raise ValueError(
                f"mixture_predict: posterior {k} has the {links[k]!r} link, posterior 0 the "
                f"{links[0]!r} link; a mixture needs members of the same likelihood"
            )
        if preds[k].mean.shape != preds[0].mean.shape:
            raise ValueError(
                f"mixture_predict: posterior {k} predicts outputs {tuple(preds[k].mean.shape)} "
                f"on x, posterior 0 {tuple(preds[0].mean.shape)}; the members must have the "
                "same output channels"
            )
    mean, variance = _total([p.mean for p in preds], [p.variance for p in preds])
    entropy = mutual_information = None
    if links[0] != "identity":
        entropy = categorical_entropy(mean, links[0])
        expected = torch.stack([p.entropy - p.mutual_information for p in preds]).mean(0)
        mutual_information = (entropy - expected).clamp_min(0)
    logit_mean = logit_variance = None
    if all(p.logit_mean is not None and p.logit_variance is not None for p in preds):
        logit_mean, logit_variance = _total(
            [p.logit_mean for p in preds], [p.logit_variance for p in preds]
        )
    return SegmentationPrediction(
        mean,
        variance,
        entropy,
        mutual_information,
        n_samples * len(posteriors),
        logit_mean,
        logit_variance,
        pred_type,
        link_approx,
    )
