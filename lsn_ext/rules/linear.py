"""Rule for ``nn.Linear``: ``y = x W^T + b`` on the last dimension."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lsn_ext.rules.base import Rule, total_variance

__all__ = ["LinearRule"]


class LinearRule(Rule):
    """Exact rule for ``nn.Linear`` applied to ``x`` of shape ``[*, in_features]``.

    With ``m`` of shape ``[*, out_features]`` and the sums running over all leading dims ``*``:

    - input: ``m_in = m (W ∘ W)``, shape ``[*, in_features]``;
    - weight: ``Σ_* m^T (x ∘ x)``, shape ``[out_features, in_features]``;
    - bias: ``Σ_* m``, shape ``[out_features]``.

    Forward (linearised variance, exact for the layer): with ``v`` the input variance
    ``[*, in_features]`` and ``σ²_W``, ``σ²_b`` the parameter variances,
    ``v_out = v (W ∘ W)^T + (x ∘ x) σ²_W^T + σ²_b``, shape ``[*, out_features]``.

    The block rule (for ``[N, K]`` logits, classes on the last dim) is
    ``m_in[n, i] = Σ_{c,c'} H[n, c, c'] W[c, i] W[c', i]``.
    """

    per_sample_kernel = "linear"

    def input_rule(self, module: nn.Linear, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        W = module.weight.detach()
        return m_out @ (W * W)

    def param_rule(
        self, module: nn.Linear, x: Tensor, y: Tensor, m_out: Tensor
    ) -> dict[str, Tensor]:
        m2 = m_out.reshape(-1, m_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        diags = {"weight": m2.T @ (x2 * x2)}
        if module.bias is not None:
            diags["bias"] = m2.sum(0)
        return diags

    def forward_rule(
        self,
        module: nn.Linear,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        W = module.weight.detach()
        x = x.detach()
        var_w, var_b = param_var.get("weight"), param_var.get("bias")
        return total_variance(
            y,
            [
                None if v_in is None else v_in @ (W * W).T,
                None if var_w is None else (x * x) @ var_w.T,
                None if var_b is None or module.bias is None else var_b,
            ],
        )

    def input_rule_block(self, module: nn.Linear, x: Tensor, y: Tensor, h_block: Tensor) -> Tensor:
        if y.dim() != 2:
            raise ValueError(
                "the block rule of Linear needs 2-D logits [N, K]; got output shape "
                f"{tuple(y.shape)}"
            )
        W = module.weight.detach()
        # Clamped: round-off only, see Rule.input_rule_block.
        return torch.einsum("ncd,ci,di->ni", h_block, W, W).clamp_min(0)
