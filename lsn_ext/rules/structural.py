"""Rules for layers whose input Jacobian has only 0/1 entries (selection, copy, reshape).

For such a layer ``J ∘ J = J``, so ``m_in = J^T m_out``: the ordinary backward pass (a VJP) already
is the exact DB step. Max pooling belongs here, overlapping windows included: an input that is
the maximum of several windows receives the sum of their ``m``, which is ``Σ_o J_oi² m_o``.

Forward, likewise ``(J ∘ J) v = J v``: the layer's forward-mode derivative (a JVP) applied to the
variance is the exact forward step. For max pooling the JVP selects at the maximum of ``x``, not of
``v``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lsn_ext.rules.base import Rule

__all__ = ["DropoutRule", "StructuralRule"]


class StructuralRule(Rule):
    """Exact rule for parameter-free 0/1-Jacobian layers: ``m_in = J^T m_out`` (a VJP).

    Covers ``Identity``, ``Flatten``, ``Unflatten``, ``MaxPool1d/2d/3d`` (also with
    ``return_indices=True``; the indices carry no curvature), ``ReLU6`` and ``Hardtanh``.
    Forward: ``v_out = J v_in``, the JVP of the module at ``x`` (exact); shapes of ``x`` and
    ``y``.
    """

    autograd_exact = True

    def input_rule(self, module: nn.Module, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            out = module(xg)
            if isinstance(out, tuple):
                out = out[0]
            (m_in,) = torch.autograd.grad(out, xg, m_out)
        return m_in

    def forward_rule(
        self,
        module: nn.Module,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        if v_in is None:
            return torch.zeros(y.shape, dtype=y.dtype, device=y.device)

        def first(t: Tensor) -> Tensor:
            out = module(t)
            return out[0] if isinstance(out, tuple) else out

        return torch.func.jvp(first, (x.detach(),), (v_in,))[1]


class DropoutRule(StructuralRule):
    """Dropout in evaluation mode is the identity: ``m_in = m_out`` (exact).

    In training mode the Jacobian is a random mask scaled by ``1/(1 − p)``; DB is then not a
    property of the model, so the rule refuses and asks for ``model.eval()``. Forward:
    ``v_out = v_in``.
    """

    def check(self, module: nn.Module) -> None:
        if module.training and module.p > 0:
            raise ValueError(
                f"{type(module).__name__}(p={module.p}) is in training mode, where its Jacobian "
                "is a random mask; call model.eval() before computing the curvature"
            )

    def input_rule(self, module: nn.Module, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        self.check(module)
        return m_out

    def forward_rule(
        self,
        module: nn.Module,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        self.check(module)
        if v_in is None:
            return torch.zeros(y.shape, dtype=y.dtype, device=y.device)
        return v_in
