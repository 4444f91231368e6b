"""The network driver of the StochMan adapter: :func:`diag_backprop_nnj`, through the engine.

There is one DB driver in lsn_ext, the native engine's :func:`lsn_ext.diag_backprop`: after
:func:`lsn_ext.stochman_ext.register` StochMan's ``nnj`` layers have rules, and the engine's
autograd pass over :class:`~lsn_ext.stochman_ext.Sequential` and
:class:`~lsn_ext.stochman_ext.SkipConnection` is the recursion of LSN appendix A.7 (a chain is
the chain rule; at a skip connection autograd sums the two branches of ``cat([x, F(x)])``,
which is LSN Eq. (27)). :func:`diag_backprop_nnj` adds what a StochMan network promises on top
of it: the structure it accepts (:func:`~lsn_ext.stochman_ext.containers.check_network`), one
tensor input, and the cross-entropy head checked before any work, each with an error that names
the module and its path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import Tensor, nn

from lsn_ext.engine import DiagBackpropResult, diag_backprop
from lsn_ext.rules import RULES
from lsn_ext.rules.losses import CrossEntropy, Loss, as_loss
from lsn_ext.stochman_ext.containers import check_network, head_of, is_skip

__all__ = ["diag_backprop_nnj"]


def diag_backprop_nnj(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss: str | Loss | nn.Module = "ce",
    *,
    ce_first_step: Literal["exact", "diag"] = "exact",
    params: Sequence[Tensor] | None = None,
) -> DiagBackpropResult:
    """Diagonal backpropagation of the GGN through a StochMan ``nnj`` network, for one batch.

    Computes ``Σ_n D(J_nᵀ H_n J_n)`` with ``D`` after every layer (LSN Eq. 22) by the recursion
    of LSN appendix A.7: ``m = diag(H)`` at the logits, then for each module in reverse
    ``d_θ += (J_θ ∘ J_θ)ᵀ m`` and ``m ← (J_x ∘ J_x)ᵀ m`` from its rule, Eq. (27) at skip
    connections. For cross-entropy, ``ce_first_step="exact"`` sends the full per-position block
    ``diag(p) − p pᵀ`` through the head (``m = D(J_headᵀ H J_head)``). The pass is the native
    engine's, :func:`lsn_ext.diag_backprop` on ``model``, after the checks of the network's
    structure and head below.

    Args:
        model: An ``nnj.Sequential`` / :class:`Sequential` / ``nn.Sequential`` of registered
            layers and :class:`SkipConnection` s (nested as needed), or one such module.
        inputs: The input ``[N, *]``.
        targets: Targets for ``loss`` (class indices ``[N, *]`` for cross-entropy).
        loss: ``"ce"``, ``"bce"``, ``"mse"``, a :class:`~lsn_ext.Loss` or a ``torch.nn`` loss
            (see :func:`~lsn_ext.rules.losses.as_loss`), summed over the batch by default.
        ce_first_step: ``"exact"`` or ``"diag"`` (cross-entropy only), see
            :func:`lsn_ext.diag_backprop`.
        params: Parameters to return diagonals for; default: all with ``requires_grad``.

    Returns:
        The loss, the logits and ``{name: diagonal}`` in ``model.named_parameters()`` order
        (``.vector`` concatenates them), as :class:`lsn_ext.DiagBackpropResult`.

    Raises:
        NotImplementedError: A module without a rule, or a container whose forward is not a
            plain chain or a :class:`SkipConnection`; the message names it and its path.
        ValueError: Bad arguments, shapes or targets; a layer in a mode without a valid rule
            (dropout or batch norm in training mode); the exact cross-entropy step with logits
            that are not the output of a ``Linear`` or convolution; non-finite weights or
            inputs, or an empty batch (:func:`lsn_ext.diag_backprop`).
        TypeError: An input that is not one tensor, or whose dtype differs from the
            parameters'.
        FloatingPointError: A non-finite diagonal (overflow).
    """
    loss_fn = as_loss(loss)
    if ce_first_step not in ("exact", "diag"):
        raise ValueError(f"ce_first_step must be 'exact' or 'diag', got {ce_first_step!r}")
    if not isinstance(inputs, Tensor):
        raise TypeError(f"nnj networks take one tensor input, got {type(inputs).__name__}")
    check_network(model)
    if isinstance(loss_fn, CrossEntropy) and ce_first_step == "exact":
        head, path = head_of(model)
        if is_skip(head) or not (type(head) in RULES and RULES[type(head)].has_block_rule()):
            raise ValueError(
                "the exact cross-entropy first step needs the logits to be the direct output of "
                f"a Linear or convolution module (e.g. MeanHead), but they come from '{path}' "
                f"({type(head).__name__}). End the network with the head, or pass "
                "ce_first_step='diag' (starts from diag(H), which overestimates the curvature)"
            )
    return diag_backprop(
        model, inputs, targets, loss_fn, ce_first_step=ce_first_step, params=params
    )
