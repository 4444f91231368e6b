"""The public entry of the estimators: :func:`ggn_diagonal` and its argument checks.

See :mod:`lsn_ext.estimators` for what each estimator computes and costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from lsn_ext.engine import DiagBackpropResult, diag_backprop
from lsn_ext.estimators.monte_carlo import monte_carlo
from lsn_ext.rules.losses import Loss, as_loss

Estimator = Literal["db", "db_calibrated", "mc"]
ESTIMATORS: tuple[str, ...] = ("db", "db_calibrated", "mc")


def ggn_diagonal(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    loss: str | Loss | nn.Module = "ce",
    *,
    estimator: Estimator = "mc",
    mc_samples: int = 1,
    shrinkage: float = 0.0,
    generator: torch.Generator | None = None,
    ce_first_step: Literal["exact", "diag"] = "exact",
    params: Sequence[Tensor] | None = None,
) -> DiagBackpropResult:
    """The GGN diagonal of one batch by diagonal backprop, Monte Carlo, or calibrated DB.

    Args:
        model: The network, as for :func:`~lsn_ext.diag_backprop` (``"db"`` and
            ``"db_calibrated"``); ``"mc"`` runs on any model whose forward treats the samples
            of the batch independently (transformer U-Nets, parametrizations and instance-level
            ``forward`` overrides included; see ``mc_paths`` of the result for how each
            parameter's per-sample gradients were taken).
        inputs: The model input, or a sequence of inputs passed as ``model(*inputs)``.
        targets: Targets for ``loss``.
        loss: ``"ce"``, ``"bce"``, ``"mse"``, a :class:`~lsn_ext.Loss` or a ``torch.nn`` loss.
        estimator: ``"mc"`` (default), ``"db"`` or ``"db_calibrated"`` (see the module
            documentation).
        mc_samples: Monte-Carlo vectors ``S`` per sample (``"mc"``, ``"db_calibrated"``).
        shrinkage: ``λ ∈ [0, 1]``, the weight of the Monte-Carlo estimate in
            ``"db_calibrated"``.
        generator: Random generator for the Rademacher vectors (on the device of the logits).
        ce_first_step: For DB with cross-entropy, see :func:`~lsn_ext.diag_backprop`.
        params: Parameters to return diagonals for; default: all with ``requires_grad``.

    Returns:
        The loss, the logits and the diagonal per parameter; for ``"db_calibrated"`` also the
        scale ``c_ℓ`` per parameter tensor (``scales``).

    Raises:
        ValueError: An unknown estimator, ``mc_samples < 1`` or more draws than the device's
            memory holds (naming the memory they need), ``shrinkage`` outside
            ``[0, 1]``, non-finite weights (naming the parameter) or inputs, an empty batch,
            bad targets, or anything :func:`~lsn_ext.diag_backprop` refuses.
        NotImplementedError: For ``"mc"``, a forward that mixes the samples (naming the module,
            the block or the model whose output or input depends on other samples), a replay
            that torch cannot run per sample, or dropout in training mode in ``forward``
            (``F.dropout(x, training=True)``). A parameter tied across modules is supported: its
            per-sample gradients from all modules and calls are summed before squaring.
        TypeError: An integer input, or one whose dtype differs from the parameters'.
        FloatingPointError: Non-finite logits or diagonals (overflow), naming the parameter.
    """
    check_estimator(estimator, mc_samples, shrinkage)
    if estimator == "db":
        return diag_backprop(
            model, inputs, targets, loss, ce_first_step=ce_first_step, params=params
        )
    mc = monte_carlo(model, inputs, targets, as_loss(loss), mc_samples, generator, params)
    if estimator == "mc":
        return mc
    db = diag_backprop(model, inputs, targets, loss, ce_first_step=ce_first_step, params=params)
    diagonals, scales = {}, {}
    for name, d in db.diagonals.items():
        m = mc.diagonals[name]
        trace = d.sum()
        if trace > 0:
            scales[name] = m.sum() / trace
            diagonals[name] = (1 - shrinkage) * scales[name] * d + shrinkage * m
        else:
            # DB sees no curvature in this tensor: there is no shape to rescale.
            scales[name] = torch.full_like(trace, float("nan"))
            diagonals[name] = m
    return DiagBackpropResult(db.loss, db.logits, diagonals, scales, mc.mc_paths)


def check_estimator(estimator: str, mc_samples: int, shrinkage: float) -> None:
    """Raise a ``ValueError`` naming a bad estimator, sample count or shrinkage."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; use one of {ESTIMATORS}")
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive int, got {mc_samples!r}")
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must lie in [0, 1], got {shrinkage}")
    if shrinkage and estimator != "db_calibrated":
        raise ValueError("shrinkage applies to estimator='db_calibrated' only")
