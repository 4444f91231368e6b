"""Rule for batch normalisation in evaluation mode."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lsn_ext.rules.base import Rule, _total

__all__ = ["BatchNormRule"]

_BatchNorm = nn.modules.batchnorm._BatchNorm


class BatchNormRule(Rule):
    """Exact rule for ``BatchNorm1d/2d/3d`` with running statistics (evaluation mode).

    With ``s = γ / sqrt(σ² + ε)`` and ``x̂ = (x − μ) / sqrt(σ² + ε)`` per channel (dim 1), for
    ``x`` of shape ``[N, C, *]``:

    - input: ``m_in = s² · m``;
    - weight ``γ``: ``Σ_{N,*} m · x̂²``, shape ``[C]``;
    - bias ``β``: ``Σ_{N,*} m``, shape ``[C]``;
    - forward (linearised variance, exact): ``v_out = s² · v_in + x̂² · σ²_γ + σ²_β``, shape of
      ``x`` (``σ²_γ``, ``σ²_β`` broadcast over dim 1).

    In training mode the statistics depend on the whole batch and the Jacobian couples samples;
    the rule refuses it (call ``model.eval()``).
    """

    def check(self, module: _BatchNorm) -> None:
        if module.training or module.running_mean is None:
            raise ValueError(
                f"{type(module).__name__}({module.num_features}) normalises with batch "
                "statistics (training mode or track_running_stats=False), which couples the "
                "samples of a batch; call model.eval() and use running statistics"
            )

    def _stats(self, module: _BatchNorm, x: Tensor) -> tuple[Tensor, Tensor]:
        self.check(module)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        inv_std = torch.rsqrt(module.running_var + module.eps).reshape(shape)
        return module.running_mean.reshape(shape), inv_std

    def input_rule(self, module: _BatchNorm, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        _, inv_std = self._stats(module, x)
        scale = inv_std if module.weight is None else module.weight.reshape(inv_std.shape) * inv_std
        return scale.square() * m_out

    def param_rule(
        self, module: _BatchNorm, x: Tensor, y: Tensor, m_out: Tensor
    ) -> dict[str, Tensor]:
        if module.weight is None:
            return {}
        mean, inv_std = self._stats(module, x)
        dims = [0, *range(2, x.dim())]
        x_hat = (x - mean) * inv_std
        return {"weight": (m_out * x_hat.square()).sum(dims), "bias": m_out.sum(dims)}

    def forward_rule(
        self,
        module: _BatchNorm,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        mean, inv_std = self._stats(module, x)
        x = x.detach()
        var_w, var_b = param_var.get("weight"), param_var.get("bias")
        shape = inv_std.shape
        terms: list[Tensor | None] = [None, None, None]
        if v_in is not None:
            scale = inv_std
            if module.weight is not None:
                scale = module.weight.detach().reshape(shape) * inv_std
            terms[0] = scale.square() * v_in
        if module.weight is not None:
            if var_w is not None:
                terms[1] = ((x - mean) * inv_std).square() * var_w.reshape(shape)
            if var_b is not None:
                terms[2] = var_b.reshape(shape)
        return _total(y, terms)
