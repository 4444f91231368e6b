r"""Rules for normalisation layers: batch, instance, group and layer norm.

Two kinds of layer are covered.

**Fixed statistics** (``BatchNorm*d`` in evaluation mode, ``InstanceNorm*d`` with
``track_running_stats=True`` in evaluation mode): the running mean and variance are constants,
so the layer is elementwise, ``y = s · x + c`` per channel, and its rules are those of a scaling.

**Statistics of the input** (``InstanceNorm*d`` by default, ``GroupNorm``, ``LayerNorm``): the
entries are split into groups of ``n`` (InstanceNorm: one sample and channel; GroupNorm: one
sample and ``C/G`` channels; LayerNorm: one sample's ``normalized_shape``), and each group is
normalised with its own mean ``μ`` and biased variance: ``σ̃ = sqrt(var + ε)``,
``x̂ = (x − μ)/σ̃``, ``y_i = γ_i x̂_i + β_i``. Including the dependence of ``μ`` and ``σ̃`` on
``x``, the input Jacobian within a group is (zero across groups)

.. math::

    J_{ij} = \frac{γ_i}{σ̃}\, a_{ij}, \qquad a_{ij} = δ_{ij} − \frac{1 + x̂_i x̂_j}{n}.

``a`` is symmetric, and for a vector ``u`` on the group
``Σ_i a_{ij}² u_i = u_j (1 − c_j/n)² + (Q_j − u_j c_j²)/n²`` with ``c_j = 1 + x̂_j²`` and
``Q_j = Σ_i u_i (1 + x̂_i x̂_j)² = U_0 + 2 x̂_j U_1 + x̂_j² U_2``, ``U_k = Σ_i u_i x̂_i^k``: three
sums per group, so the rules cost ``O(n)`` per group and memory linear in the input. The second
term is the sum over ``i ≠ j``; expanded, this is the form of the specification,
``u_j (1 − 2 c_j / n) + Q_j / n²``. Hence, with ``w = γ² m``,

- input: ``m_in_j = (1/σ̃²) [w_j (1 − c_j/n)² + (W_0 + 2 x̂_j W_1 + x̂_j² W_2 − w_j c_j²)/n²]``;
- weight ``γ``: ``Σ x̂² m``, bias ``β``: ``Σ m``, over the entries (of all samples) each scales;
- forward: ``v_out_i = (γ_i²/σ̃²) [v_i (1 − c_i/n)² + (V_0 + 2 x̂_i V_1 + x̂_i² V_2 −
  v_i c_i²)/n²] + x̂_i² σ²_γ + σ²_β`` (``V_k = Σ_j v_j x̂_j^k`` of the input variance ``v``).

Every rule here is exact for its layer (the full Jacobian of the group, squared); like every
rule, it takes the diagonal of the curvature at the layer's input.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lsn_ext.rules.base import Rule, total_variance

__all__ = ["BatchNormRule", "GroupNormRule", "InstanceNormRule", "LayerNormRule"]

_BatchNorm = nn.modules.batchnorm._BatchNorm
_InstanceNorm = nn.modules.instancenorm._InstanceNorm
_Norm = _BatchNorm | _InstanceNorm | nn.GroupNorm | nn.LayerNorm


# -- fixed (running) statistics: an elementwise layer ---------------------------------------------


def _running_stats(module: _BatchNorm | _InstanceNorm, x: Tensor) -> tuple[Tensor, Tensor]:
    """Running mean and ``1/sqrt(var + ε)``, shaped to broadcast against ``x`` ``[N, C, *]``."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    inv_std = torch.rsqrt(module.running_var + module.eps).reshape(shape)
    return module.running_mean.reshape(shape), inv_std


def _running_standardised(module: _BatchNorm | _InstanceNorm, x: Tensor) -> Tensor:
    """``x̂ = (x − μ) / sqrt(var + ε)`` with the running statistics, ``x`` ``[N, C, *]``.

    For the per-sample gradients of Monte Carlo (``standardised``); the rule steps below
    compute it inline, beside the ``1/σ`` they also need.
    """
    mean, inv_std = _running_stats(module, x)
    return (x.detach() - mean) * inv_std


def _running_scale(module: _BatchNorm | _InstanceNorm, inv_std: Tensor) -> Tensor:
    """``s = γ / sqrt(var + ε)`` (``1 / sqrt(var + ε)`` without ``γ``), shaped like ``inv_std``."""
    if module.weight is None:
        return inv_std
    return module.weight.detach().reshape(inv_std.shape) * inv_std


def _running_backward(
    module: _BatchNorm | _InstanceNorm,
    x: Tensor,
    m_out: Tensor,
    need_input: bool,
    need_params: bool,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Both rules of ``y = s · x + c`` per channel, ``x`` and ``m_out`` ``[N, C, *]``."""
    mean, inv_std = _running_stats(module, x)
    m_in = _running_scale(module, inv_std).square() * m_out if need_input else None
    diags: dict[str, Tensor] = {}
    if need_params:
        dims = [0, *range(2, x.dim())]
        if module.weight is not None:
            diags["weight"] = (m_out * ((x - mean) * inv_std).square()).sum(dims)
        if module.bias is not None:
            diags["bias"] = m_out.sum(dims)
    return m_in, diags


def _running_forward(
    module: _BatchNorm | _InstanceNorm,
    x: Tensor,
    y: Tensor,
    v_in: Tensor | None,
    param_var: Mapping[str, Tensor],
) -> Tensor:
    """``v_out = s² · v_in + x̂² · σ²_γ + σ²_β``, ``x``, ``y`` and ``v_in`` ``[N, C, *]``."""
    mean, inv_std = _running_stats(module, x)
    shape = inv_std.shape
    var_w, var_b = param_var.get("weight"), param_var.get("bias")
    terms: list[Tensor | None] = [None, None, None]
    if v_in is not None:
        terms[0] = _running_scale(module, inv_std).square() * v_in
    if module.weight is not None and var_w is not None:
        terms[1] = ((x.detach() - mean) * inv_std).square() * var_w.reshape(shape)
    if module.bias is not None and var_b is not None:
        terms[2] = var_b.reshape(shape)
    return total_variance(y, terms)


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

    per_sample_kernel = "norm"

    def check(self, module: _BatchNorm) -> None:
        if module.training or module.running_mean is None:
            raise ValueError(
                f"{type(module).__name__}({module.num_features}) normalises with batch "
                "statistics (training mode or track_running_stats=False), which couples the "
                "samples of a batch; call model.eval() and use running statistics"
            )

    def standardised(self, module: _BatchNorm, x: Tensor) -> Tensor:
        """``x̂ = (x − μ) / sqrt(σ² + ε)`` with the running statistics, shaped like ``x``.

        Args:
            module: The batch norm (in eval mode, or without running statistics' updates).
            x: Its input ``[N, C, *]``.

        Returns:
            ``x̂``, shaped like ``x``.
        """
        self.check(module)
        return _running_standardised(module, x)

    def input_rule(self, module: _BatchNorm, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        return self.backward(module, x, y, m_out, need_params=False)[0]

    def param_rule(
        self, module: _BatchNorm, x: Tensor, y: Tensor, m_out: Tensor
    ) -> dict[str, Tensor]:
        return self.backward(module, x, y, m_out, need_input=False)[1]

    def backward(
        self,
        module: _BatchNorm,
        x: Tensor,
        y: Tensor,
        m_out: Tensor,
        need_input: bool = True,
        need_params: bool = True,
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        self.check(module)
        return _running_backward(module, x.detach(), m_out, need_input, need_params)

    def forward_rule(
        self,
        module: _BatchNorm,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        self.check(module)
        return _running_forward(module, x, y, v_in, param_var)


# -- statistics of the input: groups of n entries -------------------------------------------------


def _spread(u: Tensor, x_hat: Tensor) -> Tensor:
    """``Σ_i a_ij² u_i`` per group, ``a_ij = δ_ij − (1 + x̂_i x̂_j)/n`` (see the module docs).

    ``u`` and ``x_hat`` are ``[B, G, K, S]``, a group being dims 2 and 3 (``n = K·S``); the result
    has that shape too. ``a`` is symmetric, so this serves the input rule and the forward rule.
    Computed in the expanded form ``u_j (1 − 2 c_j/n) + (U_0 + 2 x̂_j U_1 + x̂_j² U_2)/n²``, which
    needs half the passes over the group's entries; the three sums are scaled while small.
    """
    n = x_hat.shape[2] * x_hat.shape[3]
    dims = (2, 3)
    x2 = x_hat.square()
    s = 1.0 / (n * n)
    u0 = u.sum(dims, keepdim=True).mul_(s)
    u1 = (u * x_hat).sum(dims, keepdim=True).mul_(2 * s)
    u2 = (u * x2).sum(dims, keepdim=True).mul_(s)
    q = torch.addcmul(u0, x_hat, u1).addcmul_(x2, u2)
    return q.addcmul_(u, x2.mul_(-2 / n).add_(1 - 2 / n))


class _GroupStatsRule(Rule):
    """Exact rule for a layer normalising groups of its input (see the module docs).

    Subclasses give :meth:`_view`: the shape ``[B, G, K, S]`` in which ``x`` is viewed so that a
    group spans dims 2 and 3 and ``γ``, ``β`` (of ``G·K`` entries) are indexed by dims 1 and 2.
    The layer's ``eps``, ``weight`` and ``bias`` attributes are read (``None``: absent).
    """

    per_sample_kernel = "norm"

    def _view(self, module: _Norm, x: Tensor) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def _standardise(self, module: _Norm, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x̂`` ``[B, G, K, S]`` and ``1/σ̃`` ``[B, G, 1, 1]``, in the dtype of ``x``.

        One fused ``aten.native_group_norm`` (without affine parameters) over the view: the
        same biased variance and ``ε`` as the layer's forward pass. The kernel needs a contiguous
        input: a permuted batch of one (``LayerNorm(C)`` after ``x.permute(0, 2, 3, 1)``)
        reshapes to a strided view, so it is copied first.
        """
        _, G, K, S = self._view(module, x)
        B = x.numel() // (G * K * S)
        x_hat, _, rstd = torch.ops.aten.native_group_norm(
            x.detach().reshape(B, G * K, S).contiguous(), None, None, B, G * K, S, G, module.eps
        )
        return x_hat.view(B, G, K, S), rstd.view(B, G, 1, 1).to(x.dtype)

    def standardised(self, module: _Norm, x: Tensor) -> Tensor:
        """``x̂``, each group standardised with its own statistics, shaped like ``x``."""
        return self._standardise(module, x)[0].reshape(x.shape)

    @staticmethod
    def _affine(p: Tensor, x_hat: Tensor) -> Tensor:
        """A per-channel tensor (``γ``, ``σ²_γ``, …) viewed as ``[1, G, K, 1]``."""
        return p.detach().reshape(1, x_hat.shape[1], x_hat.shape[2], 1)

    def input_rule(self, module: _Norm, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        return self.backward(module, x, y, m_out, need_params=False)[0]

    def param_rule(self, module: _Norm, x: Tensor, y: Tensor, m_out: Tensor) -> dict[str, Tensor]:
        return self.backward(module, x, y, m_out, need_input=False)[1]

    def backward(
        self,
        module: _Norm,
        x: Tensor,
        y: Tensor,
        m_out: Tensor,
        need_input: bool = True,
        need_params: bool = True,
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        x_hat, inv_std = self._standardise(module, x)
        m = m_out.reshape(x_hat.shape)
        m_in = None
        if need_input:
            # 1/σ̃² is constant on a group, so it scales w before the spread: one pass fewer.
            scale = inv_std.square()
            if module.weight is not None:
                scale = self._affine(module.weight, x_hat).square() * scale
            m_in = _spread(scale * m, x_hat).reshape(x.shape)
        diags: dict[str, Tensor] = {}
        if need_params:
            if module.weight is not None:
                diags["weight"] = (m * x_hat.square()).sum((0, 3)).reshape(module.weight.shape)
            if module.bias is not None:
                diags["bias"] = m.sum((0, 3)).reshape(module.bias.shape)
        return m_in, diags

    def forward_rule(
        self,
        module: _Norm,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        x_hat, inv_std = self._standardise(module, x)
        var_w, var_b = param_var.get("weight"), param_var.get("bias")
        terms: list[Tensor | None] = [None, None, None]
        if v_in is not None:
            scale = inv_std.square()
            if module.weight is not None:
                scale = self._affine(module.weight, x_hat).square() * scale
            terms[0] = scale * _spread(v_in.reshape(x_hat.shape), x_hat)
        if module.weight is not None and var_w is not None:
            terms[1] = x_hat.square() * self._affine(var_w, x_hat)
        if module.bias is not None and var_b is not None:
            terms[2] = self._affine(var_b, x_hat)
        return total_variance(x_hat, terms).reshape(y.shape)


class InstanceNormRule(_GroupStatsRule):
    """Exact rule for ``InstanceNorm1d/2d/3d``, ``x`` of shape ``[N, C, *]`` (or ``[C, *]``).

    With the statistics of the input (the default, also in evaluation mode; torch's
    ``use_input_stats = training or not track_running_stats``) each sample and channel is one
    group of ``n = |*|`` entries: with ``w = γ² m``, ``c = 1 + x̂²`` and ``W_k = Σ_* w x̂^k``,

    - input: ``m_in = (1/σ̃²) [w (1 − c/n)² + (W_0 + 2 x̂ W_1 + x̂² W_2 − w c²)/n²]``;
    - weight ``γ``: ``Σ_{N,*} m · x̂²``, bias ``β``: ``Σ_{N,*} m``, shape ``[C]``;
    - forward (linearised variance): ``v_out = (γ²/σ̃²) [v (1 − c/n)² + (V_0 + 2 x̂ V_1 +
      x̂² V_2 − v c²)/n²] + x̂² σ²_γ + σ²_β``, ``V_k = Σ_* v x̂^k``.

    With ``track_running_stats=True`` in evaluation mode the running statistics make it
    elementwise, with the rules of :class:`BatchNormRule`. In training mode that configuration
    would update the running statistics in the forward pass; the rule refuses it (call
    ``model.eval()``). ``affine`` and ``bias`` are honoured; only parameters present get a
    diagonal.
    """

    def check(self, module: _InstanceNorm) -> None:
        if module.training and module.track_running_stats:
            raise ValueError(
                f"{type(module).__name__}({module.num_features}) has "
                "track_running_stats=True and is in training mode, so every forward pass "
                "updates its running statistics (lsn_ext never changes the model); call "
                "model.eval() to normalise with the running statistics, or build it with "
                "track_running_stats=False"
            )

    @staticmethod
    def _running(module: _InstanceNorm) -> bool:
        """Whether torch normalises with the running statistics (``not use_input_stats``)."""
        return not (module.training or not module.track_running_stats)

    @staticmethod
    def _batched(module: _InstanceNorm, x: Tensor) -> bool:
        return x.dim() != module._get_no_batch_dim()

    def standardised(self, module: _InstanceNorm, x: Tensor) -> Tensor:
        self.check(module)
        if not self._running(module):
            return super().standardised(module, x)
        batched = x if self._batched(module, x) else x.unsqueeze(0)
        return _running_standardised(module, batched).reshape(x.shape)

    def _view(self, module: _InstanceNorm, x: Tensor) -> tuple[int, int, int, int]:
        channel = 1 if self._batched(module, x) else 0
        return (-1, x.shape[channel], 1, x.shape[channel + 1 :].numel())

    def backward(
        self,
        module: _InstanceNorm,
        x: Tensor,
        y: Tensor,
        m_out: Tensor,
        need_input: bool = True,
        need_params: bool = True,
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        self.check(module)
        if not self._running(module):
            return super().backward(module, x, y, m_out, need_input, need_params)
        if self._batched(module, x):
            return _running_backward(module, x.detach(), m_out, need_input, need_params)
        m_in, diags = _running_backward(
            module, x.detach().unsqueeze(0), m_out.unsqueeze(0), need_input, need_params
        )
        return (None if m_in is None else m_in.squeeze(0)), diags

    def forward_rule(
        self,
        module: _InstanceNorm,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        self.check(module)
        if not self._running(module):
            return super().forward_rule(module, x, y, v_in, param_var)
        if self._batched(module, x):
            return _running_forward(module, x, y, v_in, param_var)
        v = None if v_in is None else v_in.unsqueeze(0)
        return _running_forward(module, x.unsqueeze(0), y.unsqueeze(0), v, param_var).squeeze(0)


class GroupNormRule(_GroupStatsRule):
    """Exact rule for ``GroupNorm(G, C)``, ``x`` of shape ``[N, C, *]``.

    Each sample and group of ``C/G`` channels is one group of ``n = (C/G)·|*|`` entries; ``γ``
    and ``β`` are per channel. With ``w = γ² m``, ``c = 1 + x̂²`` and ``W_k`` the sums of
    ``w x̂^k`` over the group,

    - input: ``m_in = (1/σ̃²) [w (1 − c/n)² + (W_0 + 2 x̂ W_1 + x̂² W_2 − w c²)/n²]``;
    - weight ``γ``: ``Σ_{N,*} m · x̂²``, bias ``β``: ``Σ_{N,*} m``, shape ``[C]``;
    - forward (linearised variance): ``v_out = (γ²/σ̃²) [v (1 − c/n)² + (V_0 + 2 x̂ V_1 +
      x̂² V_2 − v c²)/n²] + x̂² σ²_γ + σ²_β``, ``V_k`` the sums of ``v x̂^k`` over the group.

    ``G = C`` is instance norm with per-channel affine parameters, ``G = 1`` normalises each
    sample as a whole.
    """

    def _view(self, module: nn.GroupNorm, x: Tensor) -> tuple[int, int, int, int]:
        G = module.num_groups
        return (x.shape[0], G, x.shape[1] // G, x.shape[2:].numel())


class LayerNormRule(_GroupStatsRule):
    """Exact rule for ``LayerNorm(normalized_shape)``, ``x`` of shape ``[*, *normalized_shape]``.

    The trailing ``normalized_shape`` dims of each leading index form one group of
    ``n = |normalized_shape|`` entries; the elementwise affine ``γ``, ``β`` have the shape
    ``normalized_shape``. With ``w = γ² m``, ``c = 1 + x̂²`` and ``W_k`` the sums of ``w x̂^k``
    over the group,

    - input: ``m_in = (1/σ̃²) [w (1 − c/n)² + (W_0 + 2 x̂ W_1 + x̂² W_2 − w c²)/n²]``;
    - weight ``γ``: ``Σ_* m · x̂²``, bias ``β``: ``Σ_* m`` over the leading dims;
    - forward (linearised variance): ``v_out = (γ²/σ̃²) [v (1 − c/n)² + (V_0 + 2 x̂ V_1 +
      x̂² V_2 − v c²)/n²] + x̂² σ²_γ + σ²_β``.

    ``elementwise_affine=False`` (no parameters) and ``bias=False`` (weight only) are covered.
    """

    def _view(self, module: nn.LayerNorm, x: Tensor) -> tuple[int, int, int, int]:
        return (-1, 1, torch.Size(module.normalized_shape).numel(), 1)
