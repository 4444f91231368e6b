"""The link of a predictive: softmax, sigmoid or identity, decided and applied in one place.

A posterior over a network's parameters predicts through a *link* ``g`` from the outputs ``f`` to
what the likelihood models (classes on dim 1 unless stated):

- ``"softmax"``: ``p = softmax(f)`` over ``K ≥ 2`` classes (cross-entropy, categorical);
- ``"sigmoid"``: ``p = σ(f)`` per entry, one logit channel for binary segmentation (binary
  cross-entropy, Bernoulli);
- ``"identity"``: ``f`` itself (the Gaussian likelihood of regression, and laplace-torch's
  ``"reward_modeling"``, whose rewards are predicted as a regression).

Which link applies is read from the loss (each loss class of :mod:`lsn_ext.rules.losses` names
its own in its ``link`` attribute, so this module imports no loss), from a laplace-torch
likelihood and backend loss (:func:`link_of_likelihood`), or from the number of logit channels of
a network without a likelihood object (:func:`link_of_channels`, e.g. MC dropout and ensembles).
:func:`inverse_link` turns logits into probabilities, :func:`categorical_entropy` gives the
per-position entropy of the probabilities, and :func:`sigmoid_as_softmax` writes a sigmoid logit
as the two softmax logits that the Laplace Bridge takes.

Shape legend: ``N`` batch, ``C`` logit channels (classes), ``*`` spatial dimensions.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "LINKS",
    "Link",
    "NoLinkError",
    "categorical_entropy",
    "check_link",
    "inverse_link",
    "link_of_channels",
    "link_of_likelihood",
    "link_of_loss",
    "sigmoid_as_softmax",
]

Link = Literal["softmax", "sigmoid", "identity"]
LINKS: tuple[str, ...] = ("softmax", "sigmoid", "identity")

# laplace-torch's likelihoods whose predictive is the model's output itself.
_IDENTITY_LIKELIHOODS = ("regression", "reward_modeling")


class NoLinkError(TypeError, ValueError):
    """A loss without a predictive link (a ``TypeError`` and a ``ValueError``).

    Both types, because the predictives (:func:`lsn_ext.predict`) have always raised a
    ``ValueError`` for it and the variational posteriors (:mod:`lsn_ext.vi`) a ``TypeError``.
    """


def check_link(link: Any) -> Link:
    """``link`` if it is one of :data:`LINKS`; otherwise a ``ValueError`` naming them."""
    if link not in LINKS:
        raise ValueError(f"the posterior's link must be one of {LINKS}")
    return link


def link_of_loss(loss: Any) -> Link:
    """The link a loss implies: its class's ``link`` attribute.

    ``BCEWithLogits`` (and the SSN likelihoods built on it) is ``"sigmoid"``, ``CrossEntropy``
    ``"softmax"`` and ``MSE`` ``"identity"`` (:mod:`lsn_ext.rules.losses`).

    Raises:
        NoLinkError: For a loss that names no link (e.g. a custom :class:`~lsn_ext.Loss`).
    """
    link = getattr(loss, "link", None)
    if link not in LINKS:
        raise NoLinkError(f"no predictive link for loss {type(loss).__name__}")
    return link


def link_of_likelihood(likelihood: str, loss: Any | None) -> Link:
    """The link of a laplace-torch posterior from its likelihood and its backend's loss.

    ``"regression"`` and ``"reward_modeling"`` (whose rewards are predicted as a regression) are
    ``"identity"``. A classification likelihood takes the loss's link, ``"sigmoid"`` or
    ``"softmax"``; ``loss=None`` (a laplace-torch backend, which always uses cross-entropy) is
    ``"softmax"``.

    Args:
        likelihood: laplace-torch's ``la.likelihood``.
        loss: The backend's loss (:class:`lsn_ext.DiagBackprop`'s ``loss_fn``), or ``None``.

    Raises:
        NoLinkError: For a classification likelihood with a loss whose link is neither
            ``"sigmoid"`` nor ``"softmax"``.
    """
    if likelihood in _IDENTITY_LIKELIHOODS:
        return "identity"
    if loss is None:
        return "softmax"
    link = getattr(loss, "link", None)
    if link not in ("sigmoid", "softmax"):
        raise NoLinkError(f"no predictive link for loss {type(loss).__name__}")
    return link


def link_of_channels(channels: int) -> Link:
    """The link of a classifier with ``channels`` logit channels: 1 is a sigmoid, more a softmax."""
    return "sigmoid" if channels == 1 else "softmax"


def inverse_link(f: Tensor, link: str, dim: int = 1) -> Tensor:
    """Probabilities from logits: ``softmax(f)`` over ``dim``, ``σ(f)``, or ``f`` (identity).

    Args:
        f: Logits (outputs) ``[…, C, …]``, classes on ``dim``.
        link: One of :data:`LINKS`.
        dim: The class axis of a softmax.

    Returns:
        A tensor shaped like ``f``.
    """
    if link == "softmax":
        return torch.softmax(f, dim)
    if link == "sigmoid":
        return torch.sigmoid(f)
    return f


def categorical_entropy(p: Tensor, link: str) -> Tensor:
    r"""Entropy in nats of per-position categorical (softmax) or Bernoulli (sigmoid) ``p``.

    .. math::

        H = -\sum_c p_c \log p_c \quad\text{(softmax)}, \qquad
        H = -\sum_c [p_c \log p_c + (1 - p_c) \log(1 - p_c)] \quad\text{(sigmoid)},

    with ``0 log 0 = 0`` (the logarithm's argument is floored at the dtype's ``tiny``).

    Args:
        p: Probabilities ``[N, C, *]``.
        link: ``"softmax"`` or ``"sigmoid"``.

    Returns:
        ``[N, *]``.
    """
    tiny = torch.finfo(p.dtype).tiny
    if link == "sigmoid":
        q = 1 - p
        return -(p * p.clamp_min(tiny).log() + q * q.clamp_min(tiny).log()).sum(1)
    return -(p * p.clamp_min(tiny).log()).sum(1)


def sigmoid_as_softmax(f_mean: Tensor, f_var: Tensor) -> tuple[Tensor, Tensor]:
    """A Gaussian sigmoid logit ``f ~ N(m, v)`` as the two softmax logits ``[−f/2, f/2]``.

    ``softmax([−f/2, f/2])₁ = σ(f)`` exactly, and the two logits sum to zero, so their Gaussian
    (covariance ``[[v, −v], [−v, v]]/4``) needs no zero-sum projection: its means and the
    diagonal ``[v/4, v/4]`` are what the Laplace Bridge takes (``project=False``). Class 1 is the
    foreground.

    Args:
        f_mean: Logit means ``[N, 1, *]``.
        f_var: Logit variances ``[N, 1, *]``.

    Returns:
        ``(means, variances)``, each ``[N, 2, *]``.
    """
    return torch.cat([-f_mean / 2, f_mean / 2], 1), torch.cat([f_var / 4, f_var / 4], 1)
