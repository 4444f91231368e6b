"""``lsn_ext.Laplace``: laplace-torch's ``Laplace(...)`` factory for segmentation networks.

Same signature and defaults as ``laplace.Laplace`` (``subset_of_weights="last_layer"``,
``hessian_structure="kron"``: what a laplace-torch user gets without asking), with
``backend=DiagBackprop`` by default and classes whose ``la(x)``, ``la.predictive_samples(x)``
and ``la.functional_samples(x)`` are per pixel (classes on dim 1;
:class:`~lsn_ext.laplace_ext.last_layer.PerPixelPredictive`). It picks the class from
:data:`LAPLACE_CLASSES`, a dictionary ``{(subset_of_weights, hessian_structure): class}`` that
other parts of lsn_ext extend with :func:`register_laplace` (e.g. a Kronecker-factored or
low-rank posterior over all weights). laplace-torch's own ``laplace.Laplace`` is unchanged.
"""

from __future__ import annotations

from typing import Any

from lsn_ext.laplace_ext.last_layer import (
    DiagLastLayerLaplace,
    DiagSegmentationLaplace,
    FullLastLayerLaplace,
    KronLastLayerLaplace,
    KronSegmentationLaplace,
    LowRankSegmentationLaplace,
)

__all__ = ["LAPLACE_CLASSES", "Laplace", "register_laplace"]

LAPLACE_CLASSES: dict[tuple[str, str], type] = {
    ("all", "diag"): DiagSegmentationLaplace,
    ("all", "kron"): KronSegmentationLaplace,
    ("all", "lowrank"): LowRankSegmentationLaplace,
    ("last_layer", "full"): FullLastLayerLaplace,
    ("last_layer", "kron"): KronLastLayerLaplace,
    ("last_layer", "diag"): DiagLastLayerLaplace,
}
"""The class :func:`Laplace` builds for each ``(subset_of_weights, hessian_structure)``."""


def register_laplace(subset_of_weights: str, hessian_structure: str, cls: type) -> None:
    """Make :func:`Laplace` build ``cls`` for ``(subset_of_weights, hessian_structure)``.

    ``cls`` takes laplace-torch's arguments ``(model, likelihood, *args, **kwargs)``; give it
    the per-pixel predictive by mixing in
    :class:`~lsn_ext.laplace_ext.last_layer.PerPixelPredictive`, and a ``_key`` of its own
    (laplace-torch's ``Laplace`` maps every subclass's ``_key`` to the class).

    Args:
        subset_of_weights: laplace-torch's ``subset_of_weights``, e.g. ``"last_layer"``.
        hessian_structure: laplace-torch's ``hessian_structure``, e.g. ``"diag"``.
        cls: The Laplace class to build for that pair (replaces an earlier registration).

    Raises:
        TypeError: If ``cls`` is not a class.
    """
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, got {type(cls).__name__}")
    LAPLACE_CLASSES[(str(subset_of_weights), str(hessian_structure))] = cls


def _name(value: Any) -> Any:
    """A laplace-torch enum member (``SubsetOfWeights.ALL``) as its string value."""
    return getattr(value, "value", value)


def Laplace(
    model: Any,
    likelihood: str,
    subset_of_weights: str = "last_layer",
    hessian_structure: str = "kron",
    *args: Any,
    **kwargs: Any,
) -> Any:
    """laplace-torch's ``Laplace(...)`` for segmentation networks (module documentation).

    ``Laplace(unet, "classification")`` is a last-layer Laplace approximation with a
    Kronecker-factored curvature of the head (a ``1×1``/``k×k`` convolution, 1–3-D, transposed,
    or a ``Linear`` on tokens), fitted by :class:`~lsn_ext.DiagBackprop`; ``"full"`` gives the
    head's exact GGN, ``"diag"`` its diagonal. ``subset_of_weights="all"`` with
    ``hessian_structure="diag"`` is the Monte-Carlo GGN diagonal over all weights, ``"kron"``
    KFAC over all weights (:mod:`lsn_ext.kron`), ``"lowrank"`` a low-rank + diagonal GGN from
    Lanczos (:mod:`lsn_ext.lowrank`). Every class
    returned predicts per pixel (``la(x)``: probabilities ``[N, C, *]``).

    Args:
        model: The trained network, logits ``[N, C, *]`` (or ``[N, K]``).
        likelihood: ``"classification"`` (softmax cross-entropy; BCE with one channel through
            ``backend_kwargs={"loss": "bce"}``) or ``"regression"``.
        subset_of_weights: ``"last_layer"`` (default) or ``"all"`` (see
            :data:`LAPLACE_CLASSES`).
        hessian_structure: ``"kron"`` (default), ``"full"`` (last layer), ``"diag"`` or
            ``"lowrank"`` (all weights).
        *args: laplace-torch's further positional arguments of the class.
        **kwargs: Its keyword arguments (``prior_precision``, ``temperature``,
            ``last_layer_name``, ``backend`` (default :class:`~lsn_ext.DiagBackprop`),
            ``backend_kwargs``, ...).

    Returns:
        The (unfitted) posterior.

    Raises:
        ValueError: For a combination not in :data:`LAPLACE_CLASSES` (the message lists them)
            and for ``functional_approximation`` (function-space Laplace is laplace-torch's).
    """
    key = (_name(subset_of_weights), _name(hessian_structure))
    if "functional_approximation" in kwargs:
        raise ValueError(
            "functional_approximation selects laplace-torch's function-space Laplace "
            "(hessian_structure='gp'), which lsn_ext.Laplace does not build: use laplace.Laplace"
        )
    cls = LAPLACE_CLASSES.get(key)
    if cls is None:
        supported = ", ".join(f"{s!r}/{h!r}" for s, h in sorted(LAPLACE_CLASSES))
        raise ValueError(
            f"lsn_ext.Laplace has no class for subset_of_weights={key[0]!r} with "
            f"hessian_structure={key[1]!r}; supported: {supported}. laplace.Laplace offers "
            "the others with laplace-torch's own backends (for [N, K] models)"
        )
    return cls(model, likelihood, *args, **kwargs)
