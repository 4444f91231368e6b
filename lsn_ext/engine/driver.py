"""The backprop driver: :func:`diag_backprop` and its result, :class:`DiagBackpropResult`.

One forward pass under a :class:`~lsn_ext.engine.session.Session`, then one
``torch.autograd.grad`` call that carries the loss Hessian's diagonal (and, for cross-entropy,
its per-position block through the head) back through the rule nodes; the parameters' DB
diagonals arrive as its "gradients".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from lsn_ext.engine.checks import (
    check_db_diagonals,
    check_finite_logits,
    check_inputs,
    check_logits,
    select_params,
)
from lsn_ext.engine.session import Session
from lsn_ext.rules.losses import CrossEntropy, Loss, as_loss

__all__ = ["DiagBackpropResult", "diag_backprop"]


@dataclass
class DiagBackpropResult:
    """What :func:`diag_backprop` returns.

    Attributes:
        loss: The loss on the batch (detached scalar).
        logits: The model output (detached), ``[N, C, *]`` or ``[N, K]``.
        diagonals: Parameter name → DB diagonal of the GGN, shaped like the parameter, in
            ``model.named_parameters()`` order (or the estimate of
            :func:`~lsn_ext.ggn_diagonal`'s other estimators).
        scales: For ``ggn_diagonal(..., estimator="db_calibrated")``: parameter name → the
            factor ``c_ℓ`` that rescaled DB's diagonal (``NaN`` where DB's trace is zero and the
            Monte-Carlo estimate was used instead); ``None`` otherwise.
        mc_paths: For the Monte-Carlo estimator (``"mc"``, ``"db_calibrated"``): parameter
            name → how its per-sample gradients were taken: ``"module"`` (captured at the leaf
            module that holds it), ``"block '<path>'"`` (the enclosing module replayed whole
            per sample, where the leaf's capture cannot serve) or ``"model"`` (the whole model
            per sample with ``torch.func``). The estimate means the same on every path; only
            the cost differs. ``None`` for DB.
    """

    loss: Tensor
    logits: Tensor
    diagonals: dict[str, Tensor]
    scales: dict[str, Tensor] | None = None
    mc_paths: dict[str, str] | None = None

    @property
    def vector(self) -> Tensor:
        """The diagonals flattened and concatenated in ``model.parameters()`` order."""
        return torch.cat([d.reshape(-1) for d in self.diagonals.values()])


def diag_backprop(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    loss: str | Loss | nn.Module = "ce",
    *,
    ce_first_step: Literal["exact", "diag"] = "exact",
    params: Sequence[Tensor] | None = None,
) -> DiagBackpropResult:
    """Diagonal backpropagation of the GGN for one batch.

    Computes ``Σ_n D(J_nᵀ H_n J_n)`` with ``D`` applied after every layer (LSN paper Eq. 22),
    where ``H_n`` is the Hessian of ``loss`` w.r.t. the logits of sample ``n``. Cost: one forward
    and one backward pass, linear in the number of pixels.

    For cross-entropy, ``ce_first_step="exact"`` (default) propagates the full per-position
    ``C×C`` block ``diag(p) − p pᵀ`` through the output layer, ``m = D(J_lastᵀ H J_last)``, and
    applies ``D`` from there on. Starting from ``D(H)`` instead (``"diag"``) drops the negative
    ``−p pᵀ`` terms and badly overestimates the curvature when the head mixes shared features
    into all classes; it is offered for comparison. The exact step needs the logits to be the
    output of a ``Linear`` or convolution module.

    Args:
        model: Any ``nn.Module`` built from supported modules (see
            :func:`lsn_ext.rules.supported_modules`) and structural operations.
        inputs: The model input, or a sequence of inputs passed as ``model(*inputs)``.
        targets: Targets for ``loss`` (class indices ``[N, *]`` for cross-entropy).
        loss: ``"ce"``, ``"bce"``, ``"mse"``, a :class:`~lsn_ext.rules.losses.Loss`, or a
            ``torch.nn`` loss (see :func:`~lsn_ext.rules.losses.as_loss`). Summed over the batch
            by default, as in laplace-torch.
        ce_first_step: ``"exact"`` or ``"diag"``, see above (cross-entropy only).
        params: Parameters to return diagonals for; default: all with ``requires_grad``.

    Returns:
        The loss, the logits and the diagonal per parameter.

    Raises:
        NotImplementedError: A module without a rule, or an operation in ``forward`` that DB
            cannot propagate through; the message names it and where it is.
        ValueError: Bad arguments, shapes or targets (NaN included); non-finite weights
            (naming the parameter) or inputs; an empty batch; a module in a mode without a
            valid rule (dropout or batch norm in training mode).
        TypeError: An integer input, or one whose dtype differs from the parameters'.
        FloatingPointError: Non-finite logits or diagonals (overflow), naming the parameter.
    """
    loss_fn = as_loss(loss)
    if ce_first_step not in ("exact", "diag"):
        raise ValueError(f"ce_first_step must be 'exact' or 'diag', got {ce_first_step!r}")
    named_params = list(model.named_parameters())
    names, chosen = select_params(model, params, named_params)
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    check_inputs(model, args, named_params)

    session = Session(model)
    with torch.enable_grad(), session:
        logits = model(*args)
    check_logits(logits)
    session.check_graph(logits, args)
    f = logits.detach()
    check_finite_logits(f)
    value = loss_fn.value(f, targets)
    # DB is linear in m. Squared derivatives shrink m quickly (saturated tanh: (1 − y²)² below
    # 1e-38), and float32 subnormals are ~10× slower on CPUs; a power-of-two scale keeps m in the
    # normal range and is undone exactly at the end.
    scale = 2.0 ** (math.frexp(torch.finfo(f.dtype).max)[1] // 4)
    h_diag = loss_fn.hessian_diag(f, targets).contiguous() * scale
    if isinstance(loss_fn, CrossEntropy) and ce_first_step == "exact":
        block = loss_fn.hessian_block(f, targets) * scale
        session.blocks.value = (session.head_indices(logits), block)
    try:
        grads = torch.autograd.grad(logits, chosen, grad_outputs=h_diag, allow_unused=True)
    except RuntimeError as err:
        if "modified by an inplace operation" not in str(err):
            raise
        raise RuntimeError(
            "an in-place operation in forward modified a tensor that diagonal backprop needs "
            "(the output of a Tanh or Sigmoid, or the input of a layer with a rule); write that "
            f"operation out of place. PyTorch reported: {err}"
        ) from None
    finally:
        session.blocks.value = None
    # One multi-tensor kernel undoes the scale (exactly: a power of two).
    found = [g for g in grads if g is not None]
    unscaled = iter(torch._foreach_div(found, scale) if found else ())
    diagonals = {
        n: torch.zeros_like(p) if g is None else next(unscaled)
        for n, p, g in zip(names, chosen, grads, strict=True)
    }
    check_db_diagonals(diagonals)
    return DiagBackpropResult(loss=value.detach(), logits=f, diagonals=diagonals)
