r"""Rule for the elementwise product of two branches, ``y = a ⊙ b`` (attention gates, SE blocks).

Both factors depend on the parameters (an attention gate multiplies features by a sigmoid map
computed from them; squeeze-and-excitation scales channels by weights computed from the
features). With broadcasting (``a`` ``[N, C, H, W]``, ``b`` ``[N, 1, H, W]`` or ``[N, C, 1, 1]``)
the Jacobians are ``∂y/∂a = diag(b)`` and ``∂y/∂b = diag(a)``, with copies where a factor is
broadcast, so the squared-Jacobian steps are

.. math::

    m_a = \textstyle\sum_{\text{broadcast}} b^2 m_y, \qquad
    m_b = \textstyle\sum_{\text{broadcast}} a^2 m_y .

Each step is exact for its branch. What DB drops is the cross term between the branches: the
exact ``D(Jᵀ M J)`` of the product, followed back to a tensor that feeds both ``a`` and ``b``,
also contains ``2 a b m_y`` (the two paths add before squaring). That is the same approximation
as for the fan-out of a residual sum (LSN Eq. 27) and part of what diagonal backprop is.

Forward (linearised variance): ``v_y = b² v_a + a² v_b`` (independent factors, the diagonal
counterpart).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["product_forward_rule", "product_rule"]


def product_rule(m_out: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(m_a, m_b)`` for ``y = a ⊙ b``, shaped like ``a`` and ``b`` (see the module docs).

    Args:
        m_out: ``m`` w.r.t. ``y``, shape ``broadcast(a, b)``.
        a: The first factor.
        b: The second factor.
    """
    return (m_out * b.square()).sum_to_size(a.shape), (m_out * a.square()).sum_to_size(b.shape)


def product_forward_rule(v_a: Tensor | None, v_b: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """``v_y = b² v_a + a² v_b`` for ``y = a ⊙ b``; ``None`` is zero variance.

    Args:
        v_a: Variance of ``a`` (shape of ``a``) or ``None``.
        v_b: Variance of ``b`` (shape of ``b``) or ``None``.
        a: The first factor.
        b: The second factor.

    Returns:
        The variance of ``y``, shape ``broadcast(a, b)``.
    """
    shape = torch.broadcast_shapes(a.shape, b.shape)
    out = torch.zeros(shape, dtype=a.dtype, device=a.device)
    if v_a is not None:
        out = out + b.square() * v_a
    if v_b is not None:
        out = out + a.square() * v_b
    return out
