"""laplace-torch integration: the ``DiagBackprop`` backend and per-pixel predictives.

``Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag",
backend=DiagBackprop)`` fits a diagonal Laplace approximation whose GGN diagonal comes from
diagonal backpropagation (:func:`lsn_ext.diag_backprop`): one backward pass per batch, linear in
the number of pixels, for models whose logits are ``[N, C, *spatial]`` as well as ``[N, K]``.

Binary segmentation: laplace-torch has no Bernoulli likelihood. Ask for it explicitly through the
backend, ``backend_kwargs={"loss": lsn_ext.BCEWithLogits(pos_weight=...)}`` (or ``"bce"``), with
``likelihood="classification"`` and one logit channel ``[N, 1, *]``. The loss reported to
laplace-torch (and so its log likelihood and marginal likelihood), the curvature and
:func:`predict` (sigmoid link) then all use the same Bernoulli model.

laplace-torch's own predictive (``la(x)``) assumes ``[batch, outputs]``: for spatial outputs the
backend's ``jacobians`` refuses with a pointer to :func:`predict`, so the GLM predictive and
laplace-torch's validation grid search fail loudly instead of mixing pixels and classes.
``la(x, pred_type="nn")`` does not go through the backend and takes the softmax over the *last*
axis; do not use it for segmentation. :func:`predict` and :func:`gridsearch_prior_precision` are
the per-pixel equivalents.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from laplace.baselaplace import BaseLaplace
from laplace.curvature import GGNInterface
from torch import Tensor, nn

from lsn_ext._functional import functional_call_all
from lsn_ext.estimators import Estimator, check_estimator, ggn_diagonal
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy, Loss, as_loss

__all__ = [
    "DiagBackprop",
    "SegmentationPrediction",
    "gridsearch_prior_precision",
    "predict",
]


class DiagBackprop(GGNInterface):
    """laplace-torch backend for segmentation networks: GGN diagonals linear in the pixels.

    The curvature comes from the native engine, by unbiased Monte Carlo (default) or by
    diagonal backpropagation (``estimator="db"``, the LSN paper's method), see ``estimator``.

    Use it with ``hessian_structure="diag"`` and ``subset_of_weights="all"`` (or a subnetwork
    Laplace, whose indices it honours). ``H`` is ``Σ_batches`` of :func:`lsn_ext.ggn_diagonal`
    (Monte Carlo unless ``estimator`` says otherwise) with laplace-torch's conventions: losses
    summed over the data, the regression loss ``½ Σ (f − y)²`` (Hessian 1, scaled by
    laplace-torch with ``1/σ²``).

    Args:
        model: The network; any ``nn.Module`` the native engine supports.
        likelihood: ``"classification"`` or ``"regression"`` (given by laplace-torch).
        last_layer: Must be false: for last-layer Laplace the built-in backends are exact.
        subnetwork_indices: Set by laplace-torch's subnetwork Laplace.
        dict_key_x: Unused (dictionary inputs are not supported).
        dict_key_y: Unused.
        loss: The likelihood's loss, summed over the data: ``"ce"`` (default for
            classification), ``"bce"`` / :class:`~lsn_ext.BCEWithLogits` for binary
            segmentation with one logit channel, ``"mse"`` (regression), or a
            :class:`~lsn_ext.Loss`. Pass it as ``backend_kwargs={"loss": ...}``.
        ce_first_step: ``"exact"`` (default) or ``"diag"``, see :func:`lsn_ext.diag_backprop`.
        estimator: How each batch's GGN diagonal is estimated (:func:`lsn_ext.ggn_diagonal`):
            ``"mc"`` (default: unbiased Monte Carlo, about 2× a training step; its noise
            averages out over the batches of a fit), ``"db"`` (diagonal backprop, the LSN
            paper's method: deterministic, one backward pass, but 10–10⁶× too small below the
            last layers of trained networks, which breaks marginal-likelihood prior tuning) or
            ``"db_calibrated"`` (DB rescaled per parameter tensor to Monte-Carlo traces, per
            batch).
        mc_samples: Monte-Carlo vectors per sample for ``"mc"`` and ``"db_calibrated"``.
        shrinkage: Weight of the Monte-Carlo estimate in ``"db_calibrated"``, in ``[0, 1]``.
        seed: Seed of the backend's own random generator for the Monte-Carlo vectors, so that
            a fit is reproducible: a new ``Laplace`` with the same seed and data gets the same
            curvature. The generator advances from batch to batch and from one ``fit`` to the
            next (a refit draws new vectors); ``None`` draws from torch's global generator.

    Raises:
        ValueError: For ``last_layer=True``, a loss that does not match the likelihood, a
            loss with ``reduction="mean"``, or an unknown estimator or bad estimator options.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        loss: str | Loss | nn.Module | None = None,
        ce_first_step: Literal["exact", "diag"] = "exact",
        estimator: Estimator = "mc",
        mc_samples: int = 1,
        shrinkage: float = 0.0,
        seed: int | None = None,
    ):
        if last_layer:
            raise ValueError(
                "DiagBackprop does not support subset_of_weights='last_layer': use 'all' (or a "
                "subnetwork), or laplace-torch's own backends, which are exact for the last layer"
            )
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y)
        if loss is None:
            loss = "mse" if likelihood == "regression" else "ce"
        self.loss_fn = as_loss(loss)
        if self.loss_fn.reduction != "sum":
            raise ValueError(
                "laplace-torch sums the loss over the data: give the loss with reduction='sum'"
            )
        regression = isinstance(self.loss_fn, MSE)
        if regression != (likelihood == "regression"):
            raise ValueError(
                f"loss {type(self.loss_fn).__name__} does not fit likelihood={likelihood!r}: use "
                "MSE for 'regression' and cross-entropy or BCE for 'classification'"
            )
        if ce_first_step not in ("exact", "diag"):
            raise ValueError(f"ce_first_step must be 'exact' or 'diag', got {ce_first_step!r}")
        self.ce_first_step = ce_first_step
        check_estimator(estimator, mc_samples, shrinkage)
        self.estimator, self.mc_samples, self.shrinkage = estimator, mc_samples, shrinkage
        self.seed = seed
        self._generator: torch.Generator | None = None
        self.factor = 1.0
        self.lossfunc = self.loss_fn.value

    def diag(
        self, x: Tensor | MutableMapping[str, Any], y: Tensor, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Loss and estimated GGN diagonal on one batch, ``(scalar, [n_params])``."""
        if not isinstance(x, Tensor):
            raise TypeError("DiagBackprop takes tensor inputs, not dictionaries")
        if self.seed is not None and self._generator is None:
            self._generator = torch.Generator(x.device).manual_seed(self.seed)
        result = ggn_diagonal(
            self.model,
            x,
            y,
            self.loss_fn,
            estimator=self.estimator,
            mc_samples=self.mc_samples,
            shrinkage=self.shrinkage,
            generator=self._generator,
            ce_first_step=self.ce_first_step,
            params=self.params,
        )
        H = result.vector
        if self.subnetwork_indices is not None:
            H = H[self.subnetwork_indices]
        return result.loss, H

    def full(self, *args: Any, **kwargs: Any):
        """Not available: DB computes a diagonal."""
        raise NotImplementedError(
            "DiagBackprop computes the GGN diagonal only; use hessian_structure='diag'"
        )

    def kron(self, *args: Any, **kwargs: Any):
        """Not available: DB computes a diagonal."""
        raise NotImplementedError(
            "DiagBackprop computes the GGN diagonal only; use hessian_structure='diag' "
            "(a Kronecker-factored curvature is not defined for segmentation outputs here)"
        )

    def jacobians(self, x: Tensor | MutableMapping[str, Any], enable_backprop: bool = False):
        """laplace-torch's Jacobians for ``[N, K]`` outputs; refuses spatial outputs.

        laplace-torch's GLM predictive treats the last axis as the outputs, which mixes pixels
        and classes for ``[N, C, H, W]`` logits. Use :func:`lsn_ext.predict` for those.
        """
        with torch.no_grad():
            shape = self.model(x[:1]).shape
        if len(shape) != 2:
            raise ValueError(
                f"the model returns logits of shape [N, {', '.join(map(str, shape[1:]))}]; "
                "laplace-torch's predictive (la(x), GLM grid search) assumes [N, K]. Use "
                "lsn_ext.predict(la, x) for per-pixel maps and "
                "lsn_ext.gridsearch_prior_precision(la, val_loader) to tune the prior"
            )
        return super().jacobians(x, enable_backprop)


@dataclass
class SegmentationPrediction:
    """Per-pixel predictive maps from :func:`predict`.

    Shapes for logits ``[N, C, *spatial]`` (``C = 1`` for binary segmentation, where the maps
    refer to the foreground probability ``σ(f)``):

    Attributes:
        mean: Predictive mean probability ``E[p]``, ``[N, C, *]`` (regression: mean output).
        variance: Epistemic variance of the probabilities ``Var[p]`` across posterior samples,
            ``[N, C, *]`` (regression: variance of the outputs).
        entropy: Predictive entropy ``H[E p]`` in nats, ``[N, *]`` (classification only).
        mutual_information: ``H[E p] − E H[p]`` (epistemic part of the entropy), ``[N, *]``.
        n_samples: Number of posterior samples used.
    """

    mean: Tensor
    variance: Tensor
    entropy: Tensor | None
    mutual_information: Tensor | None
    n_samples: int


_LINKS = ("softmax", "sigmoid", "identity")


def _link(la: Any) -> str:
    if not isinstance(la, BaseLaplace):
        if getattr(la, "link", None) not in _LINKS:
            raise ValueError(f"the posterior's link must be one of {_LINKS}")
        return la.link
    backend = la.backend
    loss = backend.loss_fn if isinstance(backend, DiagBackprop) else None
    if la.likelihood == "regression":
        return "identity"
    if isinstance(loss, BCEWithLogits):
        return "sigmoid"
    if loss is None or isinstance(loss, CrossEntropy):
        return "softmax"
    raise ValueError(f"no predictive link for loss {type(loss).__name__}")


def _entropy(p: Tensor, link: str) -> Tensor:
    """Entropy in nats of per-position categorical (softmax) or Bernoulli (sigmoid) ``p``."""
    tiny = torch.finfo(p.dtype).tiny
    if link == "sigmoid":
        q = 1 - p
        return -(p * p.clamp_min(tiny).log() + q * q.clamp_min(tiny).log()).sum(1)
    return -(p * p.clamp_min(tiny).log()).sum(1)


def _trainable(la: Any) -> list[tuple[str, Tensor]]:
    named = [(n, p) for n, p in la.model.named_parameters() if p.requires_grad]
    if sum(p.numel() for _, p in named) != la.n_params:
        raise ValueError("the model's trainable parameters changed since the posterior was created")
    return named


def _check_fitted(la: Any) -> None:
    if not all(hasattr(la, a) for a in ("sample", "model", "n_params")):
        raise TypeError(
            "expected a fitted laplace-torch Laplace object or a posterior with model, "
            f"n_params, sample(n, generator=) and link; got {type(la).__name__}"
        )
    fitted = getattr(la, "H", None) is not None and getattr(la, "n_data", 0) > 0
    if isinstance(la, BaseLaplace) and not fitted:
        raise ValueError("the Laplace object is not fitted yet: call la.fit(train_loader) first")


@torch.no_grad()
def predict(
    la: Any,
    x: Tensor,
    n_samples: int = 50,
    *,
    generator: torch.Generator | None = None,
) -> SegmentationPrediction:
    """Per-pixel sampling predictive of a fitted Laplace approximation.

    Draws ``n_samples`` parameter vectors from the posterior (``la.sample``), runs the network
    with each (``torch.func.functional_call`` with every alias of a shared module or tied weight
    substituted: the model itself is never modified),
    and accumulates the probabilities (softmax over dim 1; sigmoid for a BCE backend) in one pass
    (Welford), so memory does not grow with ``n_samples``.

    Args:
        la: A fitted laplace-torch ``Laplace`` object (any backend; :class:`DiagBackprop` tells
            binary from multi-class by its loss), or any other posterior over the model's
            trainable parameters (in ``parameters()`` order) with attributes ``model``,
            ``n_params``, ``link`` (``"softmax"``, ``"sigmoid"`` or ``"identity"``) and a
            method ``sample(n, generator=None) -> [n, n_params]`` (e.g. :mod:`lsn_ext.vi`).
        x: Images ``[N, C_in, *spatial]``.
        n_samples: Posterior samples (the LSN paper uses 50).
        generator: Random generator for reproducible samples.

    Returns:
        The predictive maps (:class:`SegmentationPrediction`).

    Raises:
        TypeError: If ``la`` is not a laplace-torch object.
        ValueError: If ``la`` is not fitted, ``n_samples < 2``, or the logits are not
            ``[N, C, *]``.
    """
    _check_fitted(la)
    if n_samples < 2:
        raise ValueError(f"n_samples must be at least 2 to estimate a variance, got {n_samples}")
    link = _link(la)
    named = _trainable(la)
    samples = la.sample(n_samples, generator=generator)
    sizes = [p.numel() for _, p in named]
    mean = m2 = expected_entropy = None
    for i, theta in enumerate(samples):
        params = {n: t.view_as(p) for (n, p), t in zip(named, theta.split(sizes), strict=True)}
        f = functional_call_all(la.model, params, (x,))
        if f.dim() < 2:
            raise ValueError(f"expected logits [N, C, *], got shape {tuple(f.shape)}")
        if link == "softmax":
            p = torch.softmax(f, 1)
        elif link == "sigmoid":
            p = torch.sigmoid(f)
        else:
            p = f
        if mean is None:
            mean, m2 = torch.zeros_like(p), torch.zeros_like(p)
            expected_entropy = torch.zeros_like(p[:, 0]) if link != "identity" else None
        delta = p - mean
        mean += delta / (i + 1)
        m2 += delta * (p - mean)
        if expected_entropy is not None:
            expected_entropy += (_entropy(p, link) - expected_entropy) / (i + 1)
    variance = m2 / (n_samples - 1)
    if link == "identity":
        return SegmentationPrediction(mean, variance, None, None, n_samples)
    entropy = _entropy(mean, link)
    mutual_information = (entropy - expected_entropy).clamp_min(0)
    return SegmentationPrediction(mean, variance, entropy, mutual_information, n_samples)


def _nll(prediction: SegmentationPrediction, y: Tensor, link: str) -> Tensor:
    """Summed negative log predictive probability of the targets."""
    tiny = torch.finfo(prediction.mean.dtype).tiny
    p = prediction.mean
    if link == "sigmoid":
        y = y.reshape(p.shape).to(p.dtype)
        return -(y * p.clamp_min(tiny).log() + (1 - y) * (1 - p).clamp_min(tiny).log()).sum()
    picked = p.gather(1, y.long().unsqueeze(1).clamp_min(0)).squeeze(1)
    valid = y >= 0
    return -(picked.clamp_min(tiny).log() * valid).sum()


def gridsearch_prior_precision(
    la: Any,
    val_loader: Iterable[tuple[Tensor, Tensor]],
    grid: Iterable[float] | None = None,
    n_samples: int = 10,
    *,
    seed: int = 0,
) -> tuple[float, dict[float, float]]:
    """Choose the prior precision by the per-pixel predictive NLL on validation data.

    For each value of ``grid`` (default: 21 values log-spaced from 1e-4 to 1e4) sets
    ``la.prior_precision``, computes :func:`predict` on ``val_loader`` with common random numbers
    (the same seed for every value), and keeps the value with the lowest mean negative log
    predictive probability per labelled pixel. ``la.prior_precision`` is left at the best value.

    Args:
        la: A fitted Laplace object with a classification likelihood.
        val_loader: Batches ``(x, y)``: class indices ``[N, *]`` (``-1`` or below ignored), or
            binary masks for a BCE backend.
        grid: Candidate prior precisions (positive).
        n_samples: Posterior samples per prediction.
        seed: Seed of the common random numbers.

    Returns:
        ``(best, {precision: mean NLL})``.

    Raises:
        ValueError: For regression, an empty grid or loader, or non-positive values.
    """
    _check_fitted(la)
    link = _link(la)
    if link == "identity":
        raise ValueError("gridsearch_prior_precision needs a classification likelihood")
    values = [10.0**k for k in torch.linspace(-4, 4, 21).tolist()] if grid is None else list(grid)
    if not values or min(values) <= 0:
        raise ValueError(f"grid must hold positive values, got {values}")
    scores: dict[float, float] = {}
    for value in values:
        la.prior_precision = value
        total, count = 0.0, 0
        for batch, (x, y) in enumerate(val_loader):
            gen = torch.Generator(device=x.device).manual_seed(seed + batch)
            pred = predict(la, x, n_samples, generator=gen)
            total += _nll(pred, y, link).item()
            count += int((y >= 0).sum()) if link == "softmax" else y.numel()
        if count == 0:
            raise ValueError("val_loader yielded no labelled pixels")
        scores[value] = total / count if math.isfinite(total) else math.inf
    best = min(scores, key=scores.__getitem__)
    la.prior_precision = best
    return best, scores
