r"""Rules for a softmax and a log-softmax over one dimension (exact for the layer).

Both couple the entries along their dimension ``d`` (the classes, dim 1 of ``[N, C, *]``); every
other position is independent. Write ``p = softmax(x)`` along ``d`` and sums ``Σ_j`` along ``d``.

- ``nn.Softmax``: ``J_ji = ∂y_j/∂x_i = y_j (δ_ji − y_i)``, so

  .. math::

      m_{in,i} = Σ_j J_{ji}^2 m_j = y_i^2 \big((1 − 2 y_i) m_i + Σ_j y_j^2 m_j\big),
      \qquad v_{out,j} = Σ_i J_{ji}^2 v_i = y_j^2 \big((1 − 2 y_j) v_j + Σ_i y_i^2 v_i\big).

- ``nn.LogSoftmax``: ``J_ji = δ_ji − p_i``, so

  .. math::

      m_{in,i} = (1 − 2 p_i) m_i + p_i^2 Σ_j m_j,
      \qquad v_{out,j} = (1 − 2 p_j) v_j + Σ_i p_i^2 v_i.

Each is exact for the layer given a diagonal ``m_out`` (or independent input errors ``v_in``); in
a network DB takes the diagonal again after it, like after every layer. Both sides are sums of
non-negative terms (``y_i²(1 − y_i)² m_i + y_i² Σ_{j≠i} y_j² m_j`` and so on), so the results are
clamped at 0 against round-off of the rearranged form. ``nn.Softmax2d`` is the softmax over dim
``−3``. Shapes: ``x``, ``y``, ``m`` and ``v`` all ``[N, *]``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from lsn_ext.rules.base import Rule

__all__ = ["LogSoftmaxRule", "SoftmaxRule"]


def _dim(module: nn.Module) -> int:
    if isinstance(module, nn.Softmax2d):
        return -3
    return module.dim


def _check_dim(module: nn.Module) -> None:
    if not isinstance(module, nn.Softmax2d) and module.dim is None:
        raise ValueError(
            f"{type(module).__name__}(dim=None) picks its dimension from the input's rank "
            "(deprecated in torch); give the dimension explicitly, e.g. "
            f"nn.{type(module).__name__}(dim=1) for the classes of [N, C, H, W]"
        )


class _OverDimRule(Rule):
    """A parameter-free map along one dimension whose rule reads only its output ``y``."""

    needs_input = False
    needs_output = True

    def check(self, module: nn.Module) -> None:
        _check_dim(module)

    def squared(self, y: Tensor, m: Tensor, dim: int, backward: bool) -> Tensor:
        """``(J ∘ J)ᵀ m`` (``backward``) or ``(J ∘ J) m`` along ``dim``."""
        raise NotImplementedError

    def input_rule(self, module: nn.Module, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        return self.squared(y, m_out, _dim(module), backward=True)

    def forward_rule(
        self,
        module: nn.Module,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        if v_in is None:
            return y.new_zeros(y.shape)
        return self.squared(y, v_in, _dim(module), backward=False)


class SoftmaxRule(_OverDimRule):
    """``nn.Softmax(dim)`` and ``nn.Softmax2d``: exact (see the module docstring)."""

    def squared(self, y: Tensor, m: Tensor, dim: int, backward: bool) -> Tensor:
        return _softmax_squared(y, m, dim)  # the same form in both directions


class LogSoftmaxRule(_OverDimRule):
    """``nn.LogSoftmax(dim)``: exact (see the module docstring)."""

    def squared(self, y: Tensor, m: Tensor, dim: int, backward: bool) -> Tensor:
        p = y.exp()
        mixed = p * p * m.sum(dim, keepdim=True) if backward else (p * p * m).sum(dim, keepdim=True)
        return ((1 - 2 * p) * m + mixed).clamp_min(0)


def _softmax_squared(y: Tensor, m: Tensor, dim: int) -> Tensor:
    """``y² ⊙ ((1 − 2y) ⊙ m + Σ_dim y² m)``: both directions of the softmax rule."""
    y2 = y * y
    return (y2 * ((1 - 2 * y) * m + (y2 * m).sum(dim, keepdim=True))).clamp_min(0)
