"""Rule for average pooling, ``nn.AvgPool1d/2d/3d``.

Max pooling has a 0/1 Jacobian and uses :class:`~lsn_ext.rules.structural.StructuralRule`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lsn_ext.rules.base import Rule

__all__ = ["AvgPoolRule"]

_AvgPool = nn.AvgPool1d | nn.AvgPool2d | nn.AvgPool3d


def _avg_pool(module: _AvgPool, x: Tensor, divisor_override: int | None) -> Tensor:
    """``module``'s average pooling of ``x`` (``[N, C, *spatial]``) with another divisor override.

    ``AvgPool1d`` (which has no ``divisor_override``) is evaluated as a 2-D pooling over a
    singleton height, the way PyTorch itself implements it.
    """
    if isinstance(module, nn.AvgPool1d):
        (k,), (s,), (p,) = module.kernel_size, module.stride, module.padding
        return F.avg_pool2d(
            x.unsqueeze(-2),
            (1, k),
            (1, s),
            (0, p),
            module.ceil_mode,
            module.count_include_pad,
            divisor_override,
        ).squeeze(-2)
    pool = F.avg_pool2d if isinstance(module, nn.AvgPool2d) else F.avg_pool3d
    return pool(
        x,
        module.kernel_size,
        module.stride,
        module.padding,
        module.ceil_mode,
        module.count_include_pad,
        divisor_override,
    )


class AvgPoolRule(Rule):
    r"""Exact rule for ``nn.AvgPool1d/2d/3d``, every option included.

    Output window ``w`` averages the real (non-padding) inputs it covers with the weight
    ``1/n_w``, where the divisor ``n_w`` is ``divisor_override`` if set, else the window size
    (``count_include_pad=True``, clipped to the padded input under ``ceil_mode``) or the number
    ``s_w`` of real inputs in the window (``count_include_pad=False``). So ``J[w, i] = 1/n_w`` for
    the inputs ``i`` of window ``w``, ``J ∘ J = J · diag(1/n_w)`` and

    .. math::

        m_{in} = J^\top (m_{out} / n), \qquad 1/n_w = \operatorname{avgpool}(1)_w / s_w,

    where ``s_w = sumpool(1)_w`` is the pooling of a ones tensor with ``divisor_override=1``
    (padding contributes zeros, so it counts the real inputs); windows without real inputs get
    0. ``J^T`` is the pooling's own backward pass (a VJP), which also sums ``m`` over
    overlapping windows.

    Forward (linearised variance, exact): ``(J ∘ J) v = diag(1/n) J v``, i.e.
    ``v_out = avgpool(v_in) / n`` — the pooling itself, its weights ``1/n_w`` squared.

    Shapes: ``x``, ``m_in`` and ``v_in`` are ``[N, C, *spatial]`` (or unbatched ``[C, *spatial]``),
    ``y``, ``m_out`` and ``v_out`` ``[N, C, *spatial_out]``, with 1 to 3 spatial dimensions.
    """

    @staticmethod
    def _inverse_divisor(module: _AvgPool, x: Tensor, dtype: torch.dtype) -> Tensor:
        """``1/n_w`` per window (0 for windows without real inputs), broadcastable to ``y``.

        Raises:
            TypeError: If ``module`` is not an ``nn.AvgPool1d/2d/3d``.
        """
        if not isinstance(module, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
            raise TypeError(
                f"AvgPoolRule handles nn.AvgPool1d/2d/3d, got {type(module).__qualname__}"
            )
        divisor = getattr(module, "divisor_override", None)
        ndim = (
            1 if isinstance(module, nn.AvgPool1d) else 2 if isinstance(module, nn.AvgPool2d) else 3
        )
        # The weights depend on the spatial shape only; broadcast them over batch and channels.
        shape = (1,) * (x.dim() - ndim) + tuple(x.shape[-ndim:])
        ones = torch.ones(shape, dtype=dtype, device=x.device)
        with torch.no_grad():
            mean_of_ones = _avg_pool(module, ones, divisor)  # s_w / n_w
            count = _avg_pool(module, ones, 1)  # s_w
        return torch.where(count > 0, mean_of_ones / count.clamp(min=1), 0.0)

    def input_rule(self, module: _AvgPool, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        """Return ``m_in = J^T (m_out / n)``, shaped like ``x`` (see the class docstring).

        Args:
            module: The ``nn.AvgPool1d/2d/3d``.
            x: Its input ``[N, C, *]``.
            y: Its output ``[N, C, *]``.
            m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.

        Returns:
            ``m_in``, shaped like ``x`` (exact for the layer).

        Raises:
            TypeError: If ``module`` is not an ``nn.AvgPool1d/2d/3d``.
        """
        inv_n = self._inverse_divisor(module, x, m_out.dtype)
        divisor = getattr(module, "divisor_override", None)
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            out = _avg_pool(module, xg, divisor)
            (m_in,) = torch.autograd.grad(out, xg, m_out * inv_n)
        return m_in

    def forward_rule(
        self,
        module: _AvgPool,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        """Return ``v_out = avgpool(v_in) / n``, shaped like ``y`` (see the class docstring).

        Args:
            module: The ``nn.AvgPool1d/2d/3d``.
            x: Its input ``[N, C, *]``.
            y: Its output ``[N, C, *]``.
            v_in: Variance of ``x``, shaped like ``x``; ``None`` means zero.
            param_var: Unused (no parameters).

        Returns:
            ``v_out``, shaped like ``y`` (exact for the layer).

        Raises:
            TypeError: If ``module`` is not an ``nn.AvgPool1d/2d/3d``.
        """
        inv_n = self._inverse_divisor(module, x, y.dtype)
        if v_in is None:
            return torch.zeros(y.shape, dtype=y.dtype, device=y.device)
        return _avg_pool(module, v_in, getattr(module, "divisor_override", None)) * inv_n
