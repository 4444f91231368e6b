"""Prior-precision grid search by the per-pixel predictive NLL on validation data.

:func:`gridsearch_prior_precision` is the per-pixel counterpart of laplace-torch's
``la.optimize_prior_precision(method="gridsearch")``, scoring :func:`predict`'s maps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import tqdm
from torch import Tensor

from lsn_ext import distributed as _dist
from lsn_ext._laplace import BaseLaplace, fix_prior_prec_structure
from lsn_ext.laplace_ext.backend import DiagBackprop, link_of
from lsn_ext.laplace_ext.checks import (
    check_choice,
    check_finite,
    check_fitted,
    check_images,
    check_n_samples,
    dict_input,
)
from lsn_ext.laplace_ext.predictive import (
    LINK_APPROXES,
    PRED_TYPES,
    NonFinitePredictiveError,
    SegmentationPrediction,
    predict,
)
from lsn_ext.outputs import plain_tensor
from lsn_ext.rules.losses import CrossEntropy

__all__ = ["GridSearchResult", "gridsearch_prior_precision"]


def _nll(
    prediction: SegmentationPrediction, y: Tensor, link: str, ignore_index: int | None
) -> tuple[float, int]:
    """Summed negative log predictive probability of the targets and the number counted."""
    if not isinstance(y, Tensor):
        raise TypeError(f"targets must be a tensor, got {type(y).__name__}")
    p = prediction.mean
    tiny = torch.finfo(p.dtype).tiny
    if link == "sigmoid":
        if y.shape != p.shape and y.shape == p[:, 0].shape and p.shape[1] == 1:
            y = y.unsqueeze(1)
        if y.shape != p.shape:
            raise ValueError(
                f"binary targets of shape {tuple(y.shape)} do not match the predictions "
                f"{tuple(p.shape)}; give masks [N, 1, *] or [N, *]"
            )
        check_finite("the validation targets", y)
        valid = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
        y = y.to(p.dtype)
        bad = valid & ((y < 0) | (y > 1))
        if bad.any():
            raise ValueError(
                f"binary target {y[bad][0].item()} is outside [0, 1] and not "
                f"ignore_index={ignore_index}; pass ignore_index= for the value that marks "
                "unlabelled pixels"
            )
        y = torch.where(valid, y, 0)
        nll = -(y * p.clamp_min(tiny).log() + (1 - y) * (1 - p).clamp_min(tiny).log())
        return float((nll * valid).sum()), int(valid.sum())
    expected = p.shape[:1] + p.shape[2:]
    if y.dim() == p.dim() > 2 and y.shape[1] == 1 and y.shape[:1] + y.shape[2:] == expected:
        y = y[:, 0]  # MONAI's label maps [N, 1, *spatial]
    if y.shape != expected:
        raise ValueError(
            f"class targets must have shape {tuple(expected)} for predictions "
            f"{tuple(p.shape)}; got {tuple(y.shape)}"
        )
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"class targets must be integer class indices, got dtype {y.dtype}")
    C = p.shape[1]
    valid = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
    bad = valid & ((y < 0) | (y >= C))
    if bad.any():
        raise ValueError(
            f"class target {y[bad][0].item()} is outside [0, {C}) and not "
            f"ignore_index={ignore_index}; pass ignore_index= for the value that marks "
            "unlabelled pixels (e.g. 255)"
        )
    picked = p.gather(1, torch.where(valid, y, 0).long().unsqueeze(1)).squeeze(1)
    return float(-(picked.clamp_min(tiny).log() * valid).sum()), int(valid.sum())


@dataclass
class GridSearchResult:
    """What :func:`gridsearch_prior_precision` found (``la.prior_precision`` is already set).

    Attributes:
        prior_precision: The chosen value.
        grid: The candidates, in the order tried.
        scores: Mean negative log predictive probability per labelled pixel for each candidate
            (``inf`` where it was not finite).
    """

    prior_precision: float
    grid: list[float]
    scores: list[float]


_STRUCTURES = ("scalar", "layerwise", "diag")


def _grid(
    grid: Iterable[float] | None,
    log_prior_prec_min: float,
    log_prior_prec_max: float,
    grid_size: int,
    log_prior_prec_base: float,
) -> list[float]:
    if grid is None:
        if isinstance(grid_size, bool) or not isinstance(grid_size, int) or grid_size < 1:
            raise ValueError(f"grid_size must be a positive int, got {grid_size!r}")
        bounds = (log_prior_prec_min, log_prior_prec_max, log_prior_prec_base)
        if not all(math.isfinite(b) for b in bounds) or log_prior_prec_min > log_prior_prec_max:
            raise ValueError(
                "log_prior_prec_min <= log_prior_prec_max must be finite, got "
                f"{log_prior_prec_min} and {log_prior_prec_max}"
            )
        if log_prior_prec_base <= 0 or log_prior_prec_base == 1:
            raise ValueError(
                f"log_prior_prec_base must be positive and not 1, got {log_prior_prec_base}"
            )
        grid = torch.logspace(
            log_prior_prec_min,
            log_prior_prec_max,
            grid_size,
            base=log_prior_prec_base,
            dtype=torch.float64,
        ).tolist()
    values = [float(v) for v in grid]
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"grid must hold finite positive prior precisions, got {values}")
    return values


def gridsearch_prior_precision(
    la: BaseLaplace,
    val_loader: Iterable[Sequence[Tensor]],
    *,
    log_prior_prec_min: float = -4.0,
    log_prior_prec_max: float = 4.0,
    grid_size: int = 21,
    log_prior_prec_base: float = 10.0,
    grid: Iterable[float] | None = None,
    prior_structure: Literal["scalar", "layerwise", "diag"] = "scalar",
    n_samples: int = 10,
    pred_type: Literal["glm", "nn"] = "nn",
    link_approx: Literal["mc", "probit", "bridge"] = "mc",
    ignore_index: int | None = None,
    progress_bar: bool = False,
    verbose: bool = False,
    seed: int = 0,
    distributed: bool | None = None,
) -> GridSearchResult:
    """Choose the prior precision by the per-pixel predictive NLL on validation data.

    The per-pixel counterpart of ``la.optimize_prior_precision(method="gridsearch", ...)``
    (same argument names; laplace-torch's own grid search goes through ``la(x)``, which does not
    support segmentation). Candidates are ``grid``, or ``grid_size`` values log-spaced from
    ``log_prior_prec_base**log_prior_prec_min`` to ``log_prior_prec_base**log_prior_prec_max``.
    For each, sets ``la.prior_precision``, computes :func:`predict` on ``val_loader`` with
    common random numbers (the same seed for every candidate) and scores the mean negative log
    predictive probability per labelled pixel; a candidate whose predictive is not finite (a
    posterior too wide for the dtype) scores ``inf``. Like laplace-torch, it leaves
    ``la.prior_precision`` at the best value (in ``prior_structure``); unlike laplace-torch it
    also returns the scores. On an error the previous prior precision is restored.

    Data-parallel (``torch.distributed`` initialised, more than one rank): each rank scores its
    own shard of the validation data and the NLL sums and pixel counts are all-reduced per
    candidate (one collective each), so every rank chooses the same prior precision.

    Args:
        la: A fitted laplace-torch ``Laplace`` with a classification likelihood.
        val_loader: Batches ``(x, y)``: class indices ``[N, *]`` (integer), or binary masks
            ``[N, 1, *]`` / ``[N, *]`` in ``[0, 1]`` for a BCE backend.
        log_prior_prec_min: Exponent of the smallest candidate.
        log_prior_prec_max: Exponent of the largest candidate.
        grid_size: Number of candidates.
        log_prior_prec_base: Base of the exponents.
        grid: Explicit candidates (positive), instead of the log-spaced ones.
        prior_structure: Shape of the prior precision that is set: ``"scalar"`` (one value),
            ``"layerwise"`` or ``"diag"`` (the chosen value repeated per parameter tensor or
            parameter, e.g. as a start for ``method="marglik"``); every candidate is a single
            value either way.
        n_samples: Posterior samples per prediction (at least 2).
        pred_type: The predictive whose NLL is scored (:func:`predict`): tune the prior for
            the predictive you will use.
        link_approx: Its link approximation (:func:`predict`).
        ignore_index: Target value of unlabelled pixels (e.g. ``255``), not scored. Default:
            the cross-entropy loss's ``ignore_index`` (``-100``) for multi-class models, none
            for binary ones.
        progress_bar: Show a progress bar over the candidates.
        verbose: Print the chosen prior precision.
        seed: Seed of the common random numbers (the same on every rank).
        distributed: Sum the scores over the ranks. Default: as the backend's ``distributed``
            option for :class:`DiagBackprop`, else ``True``; ignored for one process.

    Returns:
        The :class:`GridSearchResult` (chosen value, candidates, scores).

    Raises:
        TypeError: If ``la`` is not a laplace-torch ``Laplace`` or a batch is not ``(x, y)``.
        ValueError: For regression, an unfitted ``la``, bad grid options, an empty loader or
            no labelled pixels, targets that are NaN, of the wrong shape or dtype, or outside
            the classes and not ``ignore_index``.
    """
    if not isinstance(la, BaseLaplace):
        raise TypeError(
            "gridsearch_prior_precision tunes a laplace-torch Laplace object's prior precision; "
            f"got {type(la).__name__}"
        )
    check_fitted(la)
    link = link_of(la)
    if link == "identity":
        raise ValueError(
            "gridsearch_prior_precision needs a classification likelihood; for regression (and "
            "reward_modeling, whose predictive is a regression) use "
            "la.optimize_prior_precision(method='marglik')"
        )
    check_n_samples(n_samples)
    check_choice("pred_type", pred_type, PRED_TYPES)
    check_choice("link_approx", link_approx, LINK_APPROXES)
    if prior_structure not in _STRUCTURES:
        raise ValueError(f"prior_structure must be one of {_STRUCTURES}, got {prior_structure!r}")
    values = _grid(grid, log_prior_prec_min, log_prior_prec_max, grid_size, log_prior_prec_base)
    if ignore_index is None and link == "softmax":
        loss = la.backend.loss_fn if isinstance(la.backend, DiagBackprop) else None
        ignore_index = loss.ignore_index if isinstance(loss, CrossEntropy) else -100

    def structured(value: float) -> Tensor:
        return fix_prior_prec_structure(
            value, prior_structure, la.n_layers, la.n_params, la._device, la._dtype
        )

    if distributed is None:
        distributed = getattr(la.backend, "distributed", True)
    reduce = bool(distributed) and _dist.world() is not None
    previous = la.prior_precision.clone()
    scores: list[float] = []
    try:
        pbar = tqdm.tqdm(values, disable=not progress_bar)
        for value in pbar:
            la.prior_precision = value
            total, count, n_batches = 0.0, 0, 0
            for batch, data in enumerate(val_loader):
                if isinstance(data, Mapping):
                    if la.dict_key_y not in data:
                        raise ValueError(
                            f"the validation batch has no key dict_key_y={la.dict_key_y!r} "
                            f"(keys: {sorted(map(str, data))})"
                        )
                    x = dict_input(la.model, data, la.dict_key_x, "gridsearch_prior_precision")
                    y = data[la.dict_key_y]
                elif len(data) != 2:
                    raise TypeError(
                        "val_loader must yield (x, y) pairs of tensors (or dictionary batches "
                        f"with dict_key_x and dict_key_y), got a {type(data).__name__}"
                    )
                else:
                    x, y = data
                x, y = check_images(plain_tensor(x)), plain_tensor(y)
                gen = torch.Generator(device=x.device).manual_seed(seed + batch)
                try:
                    pred = predict(
                        la,
                        x,
                        n_samples,
                        pred_type=pred_type,
                        link_approx=link_approx,
                        generator=gen,
                    )
                except NonFinitePredictiveError:
                    total, n_batches = math.inf, n_batches + 1
                    continue
                nll, labelled = _nll(pred, y, link, ignore_index)
                total, count, n_batches = total + nll, count + labelled, n_batches + 1
            if reduce:
                sums = torch.tensor([total, count, n_batches], dtype=torch.float64)
                sums = _dist.all_reduce_sum(sums.to(_dist.collective_device(la.mean)))
                total, n_labelled, n_seen = sums.tolist()
                count, n_batches = round(n_labelled), round(n_seen)
            if n_batches == 0:
                raise ValueError("val_loader yielded no batches")
            if count == 0 and math.isfinite(total):
                raise ValueError(
                    f"val_loader holds no labelled pixels (all targets are ignore_index="
                    f"{ignore_index})"
                )
            scores.append(total / count if math.isfinite(total) else math.inf)
            if progress_bar:
                pbar.set_description(
                    f"[Grid search | prior_prec: {value:.3e}, NLL: {scores[-1]:.3f}]"
                )
        if not any(math.isfinite(s) for s in scores):
            raise ValueError(f"every prior precision in {values} gave a non-finite validation NLL")
    except BaseException:
        la.prior_precision = previous
        raise
    best = values[min(range(len(values)), key=scores.__getitem__)]
    la.prior_precision = structured(best)
    if verbose:
        print(f"Optimized prior precision is {best}.")
    return GridSearchResult(best, values, scores)
