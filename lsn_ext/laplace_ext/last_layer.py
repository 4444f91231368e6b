"""laplace-torch's Laplace classes for segmentation networks: last layer and per-pixel predictives.

- :class:`FullLastLayerLaplace`, :class:`KronLastLayerLaplace`, :class:`DiagLastLayerLaplace`:
  laplace-torch's ``FullLLLaplace`` / ``KronLLLaplace`` / ``DiagLLLaplace`` whose last layer may
  be a convolution (``1×1`` or ``k×k``, 1–3-D, transposed) or a ``Linear`` on tokens
  (:class:`~lsn_ext.laplace_ext.head.HeadFeatureExtractor`; laplace-torch accepts
  ``nn.Linear`` only). The curvature is the head's exact GGN (its KFAC for ``kron``) from
  :class:`~lsn_ext.DiagBackprop` (the default backend, :mod:`lsn_ext.laplace_ext.
  head_curvature`); fit, ``optimize_prior_precision(method="marglik")``, ``sample``,
  ``log_det_*`` and ``state_dict``/``load_state_dict`` are laplace-torch's. The user's model
  is not changed (laplace-torch fits a deep copy).
- :class:`DiagSegmentationLaplace`, :class:`KronSegmentationLaplace`,
  :class:`LowRankSegmentationLaplace`: posteriors over all weights (laplace-torch's
  ``DiagLaplace``, :class:`lsn_ext.kron.KronLaplaceND`, :class:`lsn_ext.lowrank.LowRankGGNLaplace`)
  with the same per-pixel predictive.
- :class:`PerPixelPredictive`: the mixin that gives them laplace-torch's predictive methods per
  pixel, classes on dim 1 (laplace-torch's own take the softmax over the *last* axis, the image
  width): ``la(x)``, ``la.predictive_samples(x)``, ``la.functional_samples(x)`` and
  ``la.optimize_prior_precision(method="gridsearch")`` go through :func:`lsn_ext.predict`,
  which uses the closed-form GLM predictive for last-layer posteriors
  (:mod:`lsn_ext.laplace_ext.head_posterior`: exact per-pixel logit covariances, no sampling).
  Other posterior classes can mix it in (``class X(PerPixelPredictive, KronLaplace)``).

:func:`lsn_ext.Laplace` (:mod:`lsn_ext.laplace_ext.factory`) picks among them by name.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils import parameters_to_vector

from lsn_ext._laplace import laplace
from lsn_ext.kron import KronLaplaceND, init_kron
from lsn_ext.laplace_ext.backend import DiagBackprop, link_of
from lsn_ext.laplace_ext.gridsearch import gridsearch_prior_precision
from lsn_ext.laplace_ext.head import HeadFeatureExtractor
from lsn_ext.laplace_ext.head_posterior import head_logit_moments
from lsn_ext.laplace_ext.predictive import LINK_APPROXES, PRED_TYPES, logit_draws, predict
from lsn_ext.links import inverse_link
from lsn_ext.lowrank import LowRankGGNLaplace

__all__ = [
    "DiagLastLayerLaplace",
    "DiagSegmentationLaplace",
    "FullLastLayerLaplace",
    "KronLastLayerLaplace",
    "PerPixelPredictive",
]

_base = laplace.baselaplace
_ll = laplace.lllaplace


class PerPixelPredictive:
    """laplace-torch's predictive methods for logits ``[N, C, *]``, classes on dim 1.

    Mix in before a laplace-torch ``ParametricLaplace`` class. Each method takes
    laplace-torch's arguments and returns laplace-torch's kind of result, per pixel:
    probabilities ``[N, C, *]`` (classification), ``(mean, variance)`` ``[N, C, *]`` each
    (regression: the per-output variance, as laplace-torch's ``diagonal_output=True``), or
    samples ``[S, N, C, *]``. ``[N, K]`` models get what laplace-torch gives them (up to the
    Monte-Carlo noise of ``link_approx="mc"``). ``joint=True``, ``link_approx="bridge_norm"``
    and model keyword arguments are refused.
    """

    def __call__(
        self,
        x: Tensor | MutableMapping[str, Any],
        pred_type: str = "glm",
        joint: bool = False,
        link_approx: str = "probit",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        **model_kwargs: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The posterior predictive, per pixel: :func:`lsn_ext.predict`'s ``mean``.

        Args:
            x: Inputs (or a dictionary batch, see :func:`lsn_ext.predict`).
            pred_type: ``"glm"`` (default) or ``"nn"``.
            joint: Must be ``False`` (a joint Gaussian over every pixel is not formed).
            link_approx: ``"probit"`` (default), ``"mc"`` or ``"bridge"``; ``"nn"`` takes
                ``"mc"`` only, as in laplace-torch. Ignored for regression.
            n_samples: Posterior samples (for ``"mc"``, and the variance maps).
            diagonal_output: Accepted for laplace-torch's signature; per pixel the output
                variance is always the diagonal.
            generator: Random generator of the samples.
            fitting: laplace-torch's reward-modelling switch (not used).
            **model_kwargs: Not supported.

        Returns:
            Probabilities ``[N, C, *]``, or for regression ``(mean, variance)``.
        """
        self._check_predictive(pred_type, link_approx, joint, model_kwargs)
        regression = link_of(self) == "identity"
        maps = predict(
            self,
            x,
            n_samples,
            pred_type=pred_type,
            link_approx="mc" if regression else link_approx,
            generator=generator,
        )
        return (maps.mean, maps.variance) if regression else maps.mean

    def functional_samples(
        self,
        x: Tensor | MutableMapping[str, Any],
        pred_type: str = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Logits at ``n_samples`` posterior draws, ``[S, N, C, *]`` (:func:`logit_draws`).

        Args:
            x: Inputs ``[N, C_in, *]`` (or a dictionary batch, see :func:`lsn_ext.predict`).
            pred_type: ``"glm"`` (linearised draws, default) or ``"nn"`` (the network at
                weight draws).
            n_samples: ``S``, the number of posterior draws.
            diagonal_output: Accepted for laplace-torch's signature; not used.
            generator: Random generator of the draws.

        Returns:
            ``[S, N, C, *]`` logits.

        Raises:
            ValueError: For an unknown ``pred_type``.
        """
        self._check_predictive(pred_type, "mc", False, {})
        return torch.stack(
            list(logit_draws(self, x, n_samples, pred_type=pred_type, generator=generator))
        )

    def predictive_samples(
        self,
        x: Tensor | MutableMapping[str, Any],
        pred_type: str = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Probabilities at ``n_samples`` posterior draws, ``[S, N, C, *]``.

        Softmax over the classes (dim 1 of each draw), sigmoid for a BCE backend, the logits
        for regression.

        Args:
            x: Inputs ``[N, C_in, *]`` (or a dictionary batch, see :func:`lsn_ext.predict`).
            pred_type: ``"glm"`` (linearised draws, default) or ``"nn"`` (the network at
                weight draws).
            n_samples: ``S``, the number of posterior draws.
            diagonal_output: Accepted for laplace-torch's signature; not used.
            generator: Random generator of the draws.

        Returns:
            ``[S, N, C, *]`` probabilities (logits for regression).

        Raises:
            ValueError: For an unknown ``pred_type``.
        """
        link = link_of(self)
        samples = self.functional_samples(x, pred_type, n_samples, diagonal_output, generator)
        return inverse_link(samples, link, dim=2)

    def optimize_prior_precision(
        self,
        pred_type: str = "glm",
        method: str = "marglik",
        n_steps: int = 100,
        lr: float = 1e-1,
        init_prior_prec: float | Tensor = 1.0,
        prior_structure: str = "scalar",
        val_loader: Any = None,
        loss: Any = None,
        log_prior_prec_min: float = -4,
        log_prior_prec_max: float = 4,
        grid_size: int = 100,
        link_approx: str = "probit",
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
        log_prior_prec_base: float = 10.0,
    ) -> None:
        """laplace-torch's prior tuning; ``method="gridsearch"`` scores the per-pixel NLL.

        ``"marglik"`` is laplace-torch's. ``"gridsearch"`` runs
        :func:`lsn_ext.gridsearch_prior_precision` with these arguments (laplace-torch's
        own grid search scores ``la(x)`` with a metric over the last axis); a custom ``loss``
        is refused there.

        Args:
            pred_type: ``"glm"`` or ``"nn"`` (grid search's predictive).
            method: ``"marglik"`` (laplace-torch's) or ``"gridsearch"``.
            n_steps: Optimiser steps of ``"marglik"``.
            lr: Learning rate of ``"marglik"``.
            init_prior_prec: Initial prior precision of ``"marglik"``.
            prior_structure: ``"scalar"``, ``"layerwise"`` or ``"diag"``.
            val_loader: Validation batches (``"gridsearch"`` only, required there).
            loss: laplace-torch's grid-search metric; must be ``None`` for ``"gridsearch"``.
            log_prior_prec_min: Lower end of the grid, ``log_base`` of the precision.
            log_prior_prec_max: Upper end of the grid.
            grid_size: Number of grid points.
            link_approx: Predictive link approximation of the grid search.
            n_samples: Posterior draws per grid point.
            verbose: Print each grid point's score.
            progress_bar: Show a progress bar over the grid.
            log_prior_prec_base: Base of the grid's logarithm (10).

        Raises:
            ValueError: For ``"gridsearch"`` with a custom ``loss`` or without ``val_loader``.
        """
        if method != "gridsearch":
            super().optimize_prior_precision(
                pred_type,
                method,
                n_steps,
                lr,
                init_prior_prec,
                prior_structure,
                val_loader,
                loss,
                log_prior_prec_min,
                log_prior_prec_max,
                grid_size,
                link_approx,
                n_samples,
                verbose,
                progress_bar,
                log_prior_prec_base=log_prior_prec_base,
            )
            return
        if loss is not None:
            raise ValueError(
                "method='gridsearch' scores the per-pixel predictive NLL "
                "(lsn_ext.gridsearch_prior_precision); a custom loss is not supported: leave "
                "loss out, or call gridsearch_prior_precision yourself"
            )
        if val_loader is None:
            raise ValueError("gridsearch requires a validation set DataLoader")
        gridsearch_prior_precision(
            self,
            val_loader,
            log_prior_prec_min=log_prior_prec_min,
            log_prior_prec_max=log_prior_prec_max,
            grid_size=grid_size,
            log_prior_prec_base=log_prior_prec_base,
            prior_structure=prior_structure,
            n_samples=n_samples,
            pred_type=pred_type,
            link_approx=link_approx,
            progress_bar=progress_bar,
            verbose=verbose,
        )

    @staticmethod
    def _check_predictive(
        pred_type: str, link_approx: str, joint: bool, model_kwargs: dict[str, Any]
    ) -> None:
        if pred_type not in PRED_TYPES:
            raise ValueError(f"pred_type must be one of {PRED_TYPES}, got {pred_type!r}")
        if link_approx not in LINK_APPROXES:
            raise ValueError(
                f"link_approx must be one of {LINK_APPROXES} for per-pixel predictives, got "
                f"{link_approx!r}"
            )
        if pred_type == "nn" and link_approx != "mc":
            raise ValueError("Only mc link approximation is supported for nn prediction type.")
        if joint:
            raise ValueError(
                "joint=True (one Gaussian over every output of the batch) is not available per "
                "pixel; use the per-pixel marginals (joint=False) or lsn_ext.predict"
            )
        if model_kwargs:
            raise TypeError(f"model keyword arguments are not supported: {sorted(model_kwargs)}")


class _AllWeights(PerPixelPredictive):
    """What the all-weights classes share: laplace-torch's arguments, ``backend=DiagBackprop``."""

    _laplace_class: type

    def __init__(self, model: Any, likelihood: str, *args: Any, **kwargs: Any) -> None:
        base = self._laplace_class
        base.__init__(self, **_bind(base, model, likelihood, args, kwargs))


class DiagSegmentationLaplace(_AllWeights, _base.DiagLaplace):
    """laplace-torch's ``DiagLaplace`` (all weights) with the per-pixel predictive.

    ``backend`` defaults to :class:`~lsn_ext.DiagBackprop`; everything else is
    ``DiagLaplace``'s.

    Args:
        model: The network (logits ``[N, C, *]``, classes on dim 1).
        likelihood: ``"classification"`` or ``"regression"``, as for laplace-torch.
        *args: laplace-torch's further positional arguments of ``DiagLaplace``.
        **kwargs: laplace-torch's keyword arguments of ``DiagLaplace`` (``backend`` defaults to
            :class:`~lsn_ext.DiagBackprop`).
    """

    # laplace.Laplace() maps the `_key` of every subclass to its class: a key of its own keeps
    # laplace-torch's own ("all", "diag") on DiagLaplace.
    _key = ("all", "diag (lsn_ext, per-pixel predictive)")
    _laplace_class = _base.DiagLaplace


class KronSegmentationLaplace(_AllWeights, KronLaplaceND):
    """KFAC over all weights (:func:`lsn_ext.kron.kron_curvature`) with the per-pixel predictive.

    laplace-torch's ``KronLaplace`` (through :class:`~lsn_ext.kron.KronLaplaceND`, so 3-D
    convolution weights work too); ``backend`` defaults to :class:`~lsn_ext.DiagBackprop`, whose
    ``backend_kwargs={"kron_mode": "reduce"}`` selects KFAC-reduce.

    Args:
        model: The network (logits ``[N, C, *]``, classes on dim 1).
        likelihood: ``"classification"`` or ``"regression"``, as for laplace-torch.
        *args: laplace-torch's further positional arguments of ``KronLaplace``.
        **kwargs: laplace-torch's keyword arguments of ``KronLaplace`` (``backend`` defaults to
            :class:`~lsn_ext.DiagBackprop`).
    """

    _key = ("all", "kron (lsn_ext, per-pixel predictive)")
    _laplace_class = KronLaplaceND


class LowRankSegmentationLaplace(_AllWeights, LowRankGGNLaplace):
    """Low-rank + diagonal GGN over all weights (:mod:`lsn_ext.lowrank`), per-pixel predictive.

    ``backend`` defaults to :class:`~lsn_ext.DiagBackprop` (its ``eig_lowrank``: Lanczos on
    GGN-vector products over the whole loader); everything else is
    :class:`~lsn_ext.lowrank.LowRankGGNLaplace`'s.

    Args:
        model: The network (logits ``[N, C, *]``, classes on dim 1).
        likelihood: ``"classification"`` or ``"regression"``, as for laplace-torch.
        *args: Further positional arguments of ``LowRankGGNLaplace``.
        **kwargs: Keyword arguments of ``LowRankGGNLaplace`` (``backend`` defaults to
            :class:`~lsn_ext.DiagBackprop`; ``rank``, ``energy``, ``diagonal``, …).
    """

    _key = ("all", "lowrank (lsn_ext, per-pixel predictive)")
    _laplace_class = LowRankGGNLaplace


def _bind(cls: type, model: Any, likelihood: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``cls.__init__``'s arguments by name, with ``backend`` defaulting to DiagBackprop."""
    bound = inspect.signature(cls.__init__).bind(None, model, likelihood, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(inspect.signature(cls.__init__).parameters)))
    if arguments.get("backend") is None:
        arguments["backend"] = DiagBackprop
    return arguments


class _LastLayer(PerPixelPredictive):
    """What the three last-layer classes share: the head extractor and the output count."""

    _laplace_class: type

    def __init__(self, model: Any, likelihood: str, *args: Any, **kwargs: Any) -> None:
        base = self._laplace_class
        arguments = _bind(base, model, likelihood, args, kwargs)
        name = arguments.pop("last_layer_name", None)
        reduction = arguments.pop("feature_reduction", None)
        base.__init__(self, **arguments)
        # laplace-torch wrapped a deep copy of the model in its FeatureExtractor, which
        # accepts nn.Linear only; the head extractor takes over that copy.
        self.model = HeadFeatureExtractor(
            self.model.model, enable_backprop=self.enable_backprop, feature_reduction=reduction
        )
        self._last_layer_name = name
        if name is not None:
            self.model.set_last_layer(name)
            self.n_params = len(parameters_to_vector(self.model.last_layer.parameters()))
            self.n_layers = len(list(self.model.last_layer.parameters()))
            self.prior_precision = self._prior_precision
            self.prior_mean = self._prior_mean
            self.mean = self.prior_mean
            self._init_H()

    def fit(self, train_loader: Any, override: bool = True, progress_bar: bool = False) -> None:
        """laplace-torch's ``fit``, then ``n_outputs`` from the output's shape.

        ``n_outputs`` counts the classes (dim 1), or for regression every output of a sample
        (laplace-torch takes the last axis, the image width, which makes the Gaussian
        normaliser of its log likelihood wrong for dense outputs).
        """
        super().fit(train_loader, override=override, progress_bar=progress_bar)
        shape = self.model.output_shape
        regression = link_of(self) == "identity"
        self.n_outputs = math.prod(shape) if regression else shape[0]
        self.model.output_size = self.n_outputs

    def _glm_predictive_distribution(
        self, X: Any, joint: bool = False, diagonal_output: bool = False
    ) -> tuple[Tensor, Tensor]:
        """laplace-torch's ``(f_mu [N, K], f_var [N, K, K])`` for ``[N, K]`` models.

        In closed form (:func:`~lsn_ext.laplace_ext.head_logit_moments`); per-pixel outputs
        are refused with a pointer to ``la(x)`` / ``lsn_ext.predict``.
        """
        if joint:
            return super()._glm_predictive_distribution(X, joint=True)
        f_mu, f_var = head_logit_moments(self, X, covariance=not diagonal_output)
        if f_mu.dim() != 2:
            raise ValueError(
                f"the logits are [N, {', '.join(map(str, f_mu.shape[1:]))}]: laplace-torch's "
                "GLM predictive assumes [N, K]. Use la(x) or lsn_ext.predict(la, x) for "
                "per-pixel maps (lsn_ext.laplace_ext.head_logit_moments for the logit moments)"
            )
        return f_mu, f_var


class FullLastLayerLaplace(_LastLayer, _ll.FullLLLaplace):
    """laplace-torch's ``FullLLLaplace`` for convolution and token heads (module docs).

    Takes ``FullLLLaplace``'s arguments; ``backend`` defaults to :class:`~lsn_ext.DiagBackprop`,
    whose ``full`` is the head's exact GGN. ``feature_reduction`` must be ``None``.

    Args:
        model: The network (logits ``[N, C, *]``, classes on dim 1).
        likelihood: ``"classification"`` or ``"regression"``, as for laplace-torch.
        *args: laplace-torch's further positional arguments of ``FullLLLaplace``.
        **kwargs: laplace-torch's keyword arguments of ``FullLLLaplace`` (``backend`` defaults to
            :class:`~lsn_ext.DiagBackprop`).
    """

    _key = ("last_layer", "full (lsn_ext, convolution heads)")
    _laplace_class = _ll.FullLLLaplace


class KronLastLayerLaplace(_LastLayer, _ll.KronLLLaplace):
    """laplace-torch's ``KronLLLaplace`` for convolution and token heads (module docs).

    KFAC-expand of the head's GGN in closed form (:mod:`lsn_ext.laplace_ext.head_curvature`);
    3-D convolution weights (5-D) are factored as ``[C, C_in·∏k]``
    (:func:`lsn_ext.kron.init_kron`). ``damping`` as in laplace-torch.

    Args:
        model: The network (logits ``[N, C, *]``, classes on dim 1).
        likelihood: ``"classification"`` or ``"regression"``, as for laplace-torch.
        *args: laplace-torch's further positional arguments of ``KronLLLaplace``.
        **kwargs: laplace-torch's keyword arguments of ``KronLLLaplace`` (``backend`` defaults to
            :class:`~lsn_ext.DiagBackprop`).
    """

    _key = ("last_layer", "kron (lsn_ext, convolution heads)")
    _laplace_class = _ll.KronLLLaplace

    def _init_H(self) -> None:
        self.H = init_kron(self.model.last_layer, self._device, self._dtype)


class DiagLastLayerLaplace(_LastLayer, _ll.DiagLLLaplace):
    """laplace-torch's ``DiagLLLaplace`` for convolution and token heads (module docs).

    The curvature is the diagonal of the head's exact GGN (exact, not an estimate).

    Args:
        model: The network (logits ``[N, C, *]``, classes on dim 1).
        likelihood: ``"classification"`` or ``"regression"``, as for laplace-torch.
        *args: laplace-torch's further positional arguments of ``DiagLLLaplace``.
        **kwargs: laplace-torch's keyword arguments of ``DiagLLLaplace`` (``backend`` defaults to
            :class:`~lsn_ext.DiagBackprop`).
    """

    _key = ("last_layer", "diag (lsn_ext, convolution heads)")
    _laplace_class = _ll.DiagLLLaplace
