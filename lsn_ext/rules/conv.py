"""Rule for convolutions: ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d``.

A convolution is linear in its input and in its weight, and every entry of either Jacobian is a
single weight or a single input value (for fixed output and input positions at most one kernel
tap connects them). Squaring the Jacobian therefore squares the kernel or the input, and the DB
step is the layer's own backward pass with squared operands. One call of
``torch.ops.aten.convolution_backward(m, x², W²)`` yields the input, weight and bias diagonals
together; at stride 1 on CPU the input diagonal may come from a forward convolution instead, where
that is faster (timed once per signature).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lsn_ext._kernels import choose, timing_applies
from lsn_ext.rules.base import Rule, total_variance

__all__ = ["ConvRule"]

_ConvNd = nn.modules.conv._ConvNd


@dataclass(frozen=True)
class _Geometry:
    """What ``convolution_backward`` needs, after padding and batching are made explicit.

    Attributes:
        x: The batched input the convolution sees, ``[N, C_in, *spatial']``; explicitly padded
            when ``pad`` is set.
        x_shape: The batched shape of the layer's own input ``[N, C_in, *spatial]``.
        padding: The (symmetric) zero padding passed to the convolution itself.
        output_padding: The transposed convolution's output padding (zeros otherwise).
        pad: The ``F.pad`` spec applied to the input before the convolution, or ``None``.
        mode: The ``F.pad`` mode of ``pad`` (``'constant'`` for zeros).
        unbatched: Whether the layer's input had no batch dimension.
    """

    x: Tensor
    x_shape: torch.Size
    padding: list[int]
    output_padding: list[int]
    pad: list[int] | None
    mode: str
    unbatched: bool

    def batch(self, t: Tensor) -> Tensor:
        """Add the batch dimension to an output-side tensor if the input had none."""
        return t.unsqueeze(0) if self.unbatched else t

    def from_input(self, v: Tensor) -> Tensor:
        """Map an input-side tensor forward through the batch dimension and the explicit padding.

        The forward counterpart of :meth:`to_input`: the padding's Jacobian has entries 0 and 1,
        so ``F.pad(v, pad, mode)`` (zeros outside for zero padding, copies of the reflected,
        replicated or wrapped entries otherwise) is its exact forward variance step.
        """
        v = v.unsqueeze(0) if self.unbatched else v
        return F.pad(v, self.pad, mode=self.mode) if self.pad is not None else v

    def unbatch(self, t: Tensor) -> Tensor:
        """Remove the batch dimension of an output-side tensor if the input had none."""
        return t.squeeze(0) if self.unbatched else t

    def to_input(self, m: Tensor) -> Tensor:
        """Map a diagonal on ``x`` back through the explicit padding and the batch dimension.

        The padding's Jacobian has entries 0 and 1, so its transposed product (its ordinary VJP:
        slicing for zero padding, a scatter-add of the reflected, replicated or wrapped positions
        otherwise) is its exact DB step.
        """
        if self.pad is not None:
            m = _pad_vjp(m, self.x_shape, self.pad, self.mode)
        return m.squeeze(0) if self.unbatched else m


def _pad_vjp(m: Tensor, x_shape: torch.Size, pad: list[int], mode: str) -> Tensor:
    """VJP of ``F.pad(x, pad, mode)`` for ``x`` of shape ``x_shape`` (non-negative ``pad``).

    All four modes index each spatial dimension independently, so the VJP is one scatter-add (or a
    slice, for constant padding) per padded dimension.
    """
    d = len(x_shape) - 2
    for i in range(d):
        left, right = pad[2 * (d - 1 - i)], pad[2 * (d - 1 - i) + 1]
        if left == 0 and right == 0:
            continue
        dim, n = 2 + i, x_shape[2 + i]
        if mode == "constant":
            m = m.narrow(dim, left, n)
            continue
        pos = torch.arange(-left, n + right, device=m.device)
        if mode == "reflect":
            idx = pos.abs()
            idx = torch.where(idx > n - 1, 2 * (n - 1) - idx, idx)
        elif mode == "replicate":
            idx = pos.clamp(0, n - 1)
        elif mode == "circular":
            idx = pos.remainder(n)
        else:
            raise ValueError(f"unknown padding mode {mode!r}")
        shape = list(m.shape)
        shape[dim] = n
        m = m.new_zeros(shape).index_add_(dim, idx, m)
    return m


def _geometry(module: _ConvNd, x: Tensor, y: Tensor) -> _Geometry:
    """Validate the shapes and make batching and all padding of ``module`` explicit."""
    if not isinstance(module, _ConvNd):
        raise TypeError(f"ConvRule expects a torch.nn convolution, got {type(module).__name__}")
    name = type(module).__name__
    d = len(module.kernel_size)
    if x.dim() not in (d + 1, d + 2) or y.dim() != x.dim():
        raise ValueError(
            f"{name} expects an input [N, C_in, *spatial] or [C_in, *spatial] with {d} spatial "
            f"dims and an output of the same rank; got input {tuple(x.shape)} and output/"
            f"curvature {tuple(y.shape)}"
        )
    unbatched = x.dim() == d + 1
    if unbatched:
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    if x.shape[1] != module.in_channels or y.shape[:2] != (x.shape[0], module.out_channels):
        raise ValueError(
            f"{name}({module.in_channels}, {module.out_channels}) does not fit input "
            f"{tuple(x.shape)} and output/curvature {tuple(y.shape)}"
        )
    x_shape = x.shape
    k, s, dil = module.kernel_size, module.stride, module.dilation

    pad: list[int] | None = None
    mode = "constant"
    if module.padding_mode != "zeros":
        # Padding is its own structural layer followed by an unpadded convolution, exactly as in
        # the module's forward.
        pad, mode = list(module._reversed_padding_repeated_twice), module.padding_mode
        padding = [0] * d
    elif module.padding == "valid":
        padding = [0] * d
    elif module.padding == "same":
        # PyTorch pads total = dilation·(kernel − 1) with the smaller half on the left; when the
        # halves differ it zero-pads the extra right part explicitly first (F.pad), then convolves
        # with the left half as symmetric padding. Do the same.
        total = [di * (ki - 1) for di, ki in zip(dil, k, strict=True)]
        padding = [t // 2 for t in total]
        extra = [t - 2 * p for t, p in zip(total, padding, strict=True)]
        if any(extra):
            pad = [v for e in reversed(extra) for v in (0, e)]
    else:
        padding = list(module.padding)
    if pad is not None and any(pad):
        x = F.pad(x, pad, mode=mode)
    else:
        pad = None

    sp_in, sp_out = x.shape[2:], y.shape[2:]
    if module.transposed:
        base = [
            (n - 1) * si - 2 * p + di * (ki - 1) + 1
            for n, si, p, di, ki in zip(sp_in, s, padding, dil, k, strict=True)
        ]
        output_padding = [o - b for o, b in zip(sp_out, base, strict=True)]
        ok = all(0 <= op < max(si, di) for op, si, di in zip(output_padding, s, dil, strict=True))
    else:
        output_padding = [0] * d
        expected = [
            (n + 2 * p - di * (ki - 1) - 1) // si + 1
            for n, si, p, di, ki in zip(sp_in, s, padding, dil, k, strict=True)
        ]
        ok = list(sp_out) == expected
    if not ok:
        raise ValueError(
            f"{module} cannot map an input of spatial size {tuple(x_shape[2:])} to an output "
            f"of spatial size {tuple(sp_out)}"
        )
    return _Geometry(x, x_shape, padding, output_padding, pad, mode, unbatched)


_SPLIT_FASTER: dict[tuple, bool] = {}
"""Per CPU convolution signature: whether the input rule as a forward convolution is faster.

Keyed by the module class, shapes, geometry, dtype and thread count (:func:`_signature`), never
by a model: both formulations are exact, so a stale entry changes the speed only.
"""


def _forward_conv_applies(module: _ConvNd, geo: _Geometry) -> bool:
    """Whether :func:`_input_by_forward_conv` computes the input rule of ``module``.

    For a convolution (not transposed) with stride 1 whose padding is at most the dilated
    kernel's extent less one in every dim, so that the adjoint's padding is not negative.
    """
    return (
        not module.transposed
        and all(s == 1 for s in module.stride)
        and all(
            p <= d * (k - 1)
            for p, d, k in zip(geo.padding, module.dilation, module.kernel_size, strict=True)
        )
    )


def _input_by_forward_conv(module: _ConvNd, geo: _Geometry, m: Tensor, w_sq: Tensor) -> Tensor:
    """``∂_x conv(m; W ∘ W)`` as a forward convolution of ``m``, ``[N, C_in, *spatial']``.

    For stride 1 the input gradient of a convolution is the convolution of the output gradient
    with the kernel flipped in space and with input and output channels swapped (per group),
    dilated alike and padded by ``dilation · (kernel − 1) − padding``. Exact, like the fused
    kernel; oneDNN's forward kernels are up to several times faster than its input-gradient
    kernels at some shapes (few channels at high resolution) and a little slower at others, so
    :meth:`ConvRule.backward` times both once per signature on CPU.
    """
    g, d = module.groups, len(module.kernel_size)
    c_out = w_sq.shape[0]
    if g == 1:
        kernel = w_sq.transpose(0, 1)
    else:
        kernel = (
            w_sq.reshape(g, c_out // g, *w_sq.shape[1:])
            .transpose(1, 2)
            .reshape(w_sq.shape[1] * g, c_out // g, *w_sq.shape[2:])
        )
    kernel = kernel.flip(list(range(2, 2 + d)))
    padding = [
        di * (k - 1) - p
        for di, k, p in zip(module.dilation, module.kernel_size, geo.padding, strict=True)
    ]
    conv = (F.conv1d, F.conv2d, F.conv3d)[d - 1]
    return conv(m, kernel, None, 1, padding, module.dilation, g)


def _signature(module: _ConvNd, geo: _Geometry, m: Tensor, need_params: bool) -> tuple:
    """What the faster of two convolution kernels depends on (see :data:`_SPLIT_FASTER`)."""
    return (
        type(module), geo.x.shape, m.shape, module.weight.shape, module.bias is None,
        tuple(geo.padding), module.dilation, module.groups, module.transposed, module.stride,
        need_params, m.dtype, torch.get_num_threads(),
    )  # fmt: skip


class ConvRule(Rule):
    """Exact rule for ``Conv1d/2d/3d`` and ``ConvTranspose1d/2d/3d`` with any geometry.

    Shapes, with ``*spatial`` one to three dims and ``g`` the number of groups: input ``x`` is
    ``[N, C_in, *spatial]``, output and ``m`` are ``[N, C_out, *spatial_out]``; the weight is
    ``[C_out, C_in/g, *kernel]`` (convolution) or ``[C_in, C_out/g, *kernel]`` (transposed), the
    bias ``[C_out]``. Unbatched inputs ``[C_in, *spatial]`` are accepted as well. Writing
    ``∂_x conv(g_out; W)`` for the layer's input-gradient op and ``∂_W conv(g_out; x)`` for its
    weight-gradient op (summed over the batch), the rules are

    - input: ``m_in = ∂_x conv(m; W ∘ W)``, shape ``[N, C_in, *spatial]``;
    - weight: ``∂_W conv(m; x ∘ x)``, shape of the weight;
    - bias: ``Σ_{N, *spatial_out} m``, shape ``[C_out]``;
    - block (cross-entropy head, ``h_block`` of shape ``[N, C_out, C_out, *spatial_out]``):
      ``diag(J_x^T H J_x) = ∂_x conv(h; K)`` with ``h`` reshaped to
      ``[N, C_out², *spatial_out]`` and the pairwise kernel
      ``K[(c, c'), i, t] = W[c, i, t] · W[c', i, t]`` (pairs within a group; for transposed
      convolutions the pairs run over the weight's dim 1).

    Forward (linearised variance; ``v`` the input variance, ``σ²_W``, ``σ²_b`` the parameter
    variances; ``conv(·; K)`` the layer's own forward op with kernel ``K`` and no bias):

    - ``v_out = conv(v; W ∘ W) + conv(x ∘ x; σ²_W) + σ²_b``, the bias term broadcast over batch
      and space; shape ``[N, C_out, *spatial_out]``.

    All are exact, because each Jacobian entry is a single weight (input rule) or a single input
    value (weight rule). Stride, dilation, groups, ``output_padding`` (taken from the actual output
    shape, so ``forward(x, output_size=...)`` works), integer, tuple, ``'valid'`` and ``'same'``
    padding (asymmetric for even effective kernels, like PyTorch) are handled inside the
    convolution, exactly for the whole module.

    Granularity for ``padding_mode`` in ``{'reflect', 'replicate', 'circular'}``: the padding is
    its own structural layer followed by an unpadded convolution, as in the module's ``forward``
    (``F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)``). The
    convolution's rule is applied to the padded input, and the diagonal is mapped back through the
    padding by its ordinary VJP, which is the padding's exact DB step (its Jacobian is 0/1);
    forward, ``v`` is padded with the same ``F.pad`` (the padding's exact forward step) before
    the squared convolution.
    Because DB takes the diagonal in between, the border entries of ``m_in`` differ from
    ``(J_x ∘ J_x)^T m`` for the Jacobian of the whole module: an input pixel that appears at two
    padded positions gets ``Σ_p (J_p ∘ J_p)^T m`` instead of ``((Σ_p J_p) ∘ (Σ_p J_p))^T m`` (and
    forward, the covariance of two copies of an input pixel under one kernel is dropped). The
    parameter diagonals and the parameters' forward variance are exact for the whole module.
    """

    per_sample_kernel = "convolution"

    def backward(
        self,
        module: _ConvNd,
        x: Tensor,
        y: Tensor,
        m_out: Tensor,
        need_input: bool = True,
        need_params: bool = True,
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """All diagonals from ``convolution_backward(m_out, x², W²)``.

        One call gives all three. For convolutions with stride 1 on CPU, the input diagonal may
        instead come from a forward convolution (:func:`_input_by_forward_conv`) beside a call
        for the parameters only, where that was faster when timed on the first call of the
        signature (shapes, padding, dilation, groups, dtype, threads).

        Args:
            module: The convolution.
            x: Its input ``[N, C_in, *spatial]`` (or ``[C_in, *spatial]``).
            y: Its output ``[N, C_out, *spatial_out]``; only its shape is used.
            m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.
            need_input: Compute ``m_in``; otherwise it is ``None``.
            need_params: Compute the parameter diagonals; otherwise they are ``{}``.

        Returns:
            ``(m_in, {"weight": ..., "bias": ...})``; ``"bias"`` only when the module has one.

        Raises:
            ValueError: If the shapes of ``x`` and ``m_out`` do not fit the module.
        """
        geo = _geometry(module, x, m_out)
        has_bias = module.bias is not None
        mask = [need_input, need_params, need_params and has_bias]
        if not any(mask):
            return None, {}
        m = geo.batch(m_out.detach())
        x_in = geo.x.detach()
        x_sq = x_in * x_in if need_params else x_in
        w = module.weight.detach()
        w_sq = w * w

        def squared_backward(out_mask: list[bool]) -> tuple[Tensor | None, ...]:
            return torch.ops.aten.convolution_backward(
                m, x_sq, w_sq, [module.out_channels] if has_bias else None,
                list(module.stride), geo.padding, list(module.dilation), module.transposed,
                geo.output_padding, module.groups, out_mask,
            )  # fmt: skip

        def split() -> tuple[Tensor | None, ...]:
            params = squared_backward([False, *mask[1:]]) if need_params else (None,) * 3
            return _input_by_forward_conv(module, geo, m, w_sq), *params[1:]

        def fused() -> tuple[Tensor | None, ...]:
            return squared_backward(mask)

        split_serves = (
            need_input
            and timing_applies(m)
            and choose(
                _SPLIT_FASTER,
                _signature(module, geo, m, need_params),
                split,
                fused,
                when=lambda: _forward_conv_applies(module, geo),
            )
        )
        grad_in, grad_w, grad_b = split() if split_serves else fused()
        m_in = geo.to_input(grad_in) if need_input else None
        diags: dict[str, Tensor] = {}
        if need_params:
            diags["weight"] = grad_w
            if has_bias:
                diags["bias"] = grad_b
        return m_in, diags

    def forward_rule(
        self,
        module: _ConvNd,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        """``v_out = conv(v_in; W ∘ W) + conv(x ∘ x; σ²_W) + σ²_b``; see the class docstring.

        Args:
            module: The convolution.
            x: Its input ``[N, C_in, *spatial]`` (or ``[C_in, *spatial]``).
            y: Its output ``[N, C_out, *spatial_out]``; only its shape is used.
            v_in: Variance of ``x``, shaped like ``x``, or ``None`` (zero).
            param_var: ``{"weight": σ²_W, "bias": σ²_b}``, each shaped like its parameter;
                missing entries are zero.

        Returns:
            ``v_out``, shaped like ``y``.

        Raises:
            ValueError: If the shapes of ``x`` and ``y`` do not fit the module.
        """
        geo = _geometry(module, x, y)
        var_w, var_b = param_var.get("weight"), param_var.get("bias")

        def conv(inp: Tensor, kernel: Tensor) -> Tensor:
            return torch.convolution(
                inp,
                kernel,
                None,
                list(module.stride),
                geo.padding,
                list(module.dilation),
                module.transposed,
                geo.output_padding,
                module.groups,
            )

        W = module.weight.detach()
        x_in = geo.x.detach()
        y_b = geo.batch(y)
        bias_shape = (1, -1) + (1,) * (y_b.dim() - 2)
        v_out = total_variance(
            y_b,
            [
                None if v_in is None else conv(geo.from_input(v_in), W * W),
                None if var_w is None else conv(x_in * x_in, var_w),
                None if var_b is None or module.bias is None else var_b.reshape(bias_shape),
            ],
        )
        return geo.unbatch(v_out)

    def input_rule(self, module: _ConvNd, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        """``m_in = ∂_x conv(m_out; W ∘ W)``, shaped like ``x``; see the class docstring.

        Args:
            module: The convolution (``nn.Conv1–3d`` or ``nn.ConvTranspose1–3d``).
            x: Its input ``[N, C_in, *]``.
            y: Its output ``[N, C_out, *]``.
            m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.

        Returns:
            ``m_in``, shaped like ``x`` (exact for the layer).
        """
        return self.backward(module, x, y, m_out, need_params=False)[0]

    def param_rule(self, module: _ConvNd, x: Tensor, y: Tensor, m_out: Tensor) -> dict[str, Tensor]:
        """``{"weight": ∂_W conv(m_out; x ∘ x), "bias": Σ m_out}``; see the class docstring.

        Args:
            module: The convolution (``nn.Conv1–3d`` or ``nn.ConvTranspose1–3d``).
            x: Its input ``[N, C_in, *]``.
            y: Its output ``[N, C_out, *]``.
            m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.

        Returns:
            ``{"weight": ..., "bias": ...}`` shaped like ``module.weight`` and ``module.bias``
            (no ``"bias"`` without one), summed over the batch (exact for the layer).
        """
        return self.backward(module, x, y, m_out, need_input=False)[1]

    def input_rule_block(self, module: _ConvNd, x: Tensor, y: Tensor, h_block: Tensor) -> Tensor:
        """``diag(J_x^T H J_x)`` for ``H`` coupling the output channels at each position.

        Entry ``(n, i, u)`` is ``Σ_{p, c, c'} H[n, c, c', p] W[c, i, t] W[c', i, t]``, where ``t``
        is the tap linking input position ``u`` to output position ``p``; this is the input
        gradient of the convolution with the pairwise kernel ``K`` of the class docstring applied
        to ``h_block``. A pair ``(c, c')`` from different groups never shares an input channel, so
        only pairs within a group enter, and the convolution keeps its ``groups``. Exact for the
        module (for non-zero ``padding_mode`` up to the granularity in the class docstring).

        Args:
            module: The convolution.
            x: Its input ``[N, C_in, *spatial]`` (or ``[C_in, *spatial]``).
            y: Its output ``[N, C_out, *spatial_out]``; only its shape is used.
            h_block: Per-position blocks ``[N, C_out, C_out, *spatial_out]`` (or
                ``[C_out, C_out, *spatial_out]`` for an unbatched input).

        Returns:
            The diagonal, shaped like ``x``, clamped at 0 (see :meth:`Rule.input_rule_block`).

        Raises:
            ValueError: If the shapes of ``x``, ``y`` and ``h_block`` do not fit the module.
        """
        geo = _geometry(module, x, y)
        h = geo.batch(h_block.detach())
        N, C, g = geo.x.shape[0], module.out_channels, module.groups
        sp_out = geo.batch(y).shape[2:]
        if h.shape != (N, C, C, *sp_out):
            raise ValueError(
                f"h_block must have shape [N, C_out, C_out, *spatial_out] = "
                f"{[N, C, C, *sp_out]} for output {tuple(y.shape)}; got {tuple(h_block.shape)}"
            )
        cg = C // g
        # The within-group pairs: [N, g, cg, cg, *sp] -> [N, g·cg², *sp].
        h = h.reshape(N, g, cg, g, cg, *sp_out).diagonal(dim1=1, dim2=3).movedim(-1, 1)
        h = h.reshape(N, g * cg * cg, *sp_out)
        W = module.weight.detach()
        kernel = W.shape[2:]
        if module.transposed:
            # [C_in, cg, *k] -> K[i, (c, c'), *k] = W[i, c] W[i, c'], shape [C_in, cg², *k].
            K = (W[:, :, None] * W[:, None, :]).reshape(W.shape[0], cg * cg, *kernel)
        else:
            # [C_out, C_in/g, *k] as [g, cg, C_in/g, *k] -> [g·cg², C_in/g, *k].
            Wg = W.reshape(g, cg, *W.shape[1:])
            K = (Wg[:, :, None] * Wg[:, None, :]).reshape(g * cg * cg, *W.shape[1:])
        grad_in = torch.ops.aten.convolution_backward(
            h,
            geo.x.detach(),
            K,
            None,
            list(module.stride),
            geo.padding,
            list(module.dilation),
            module.transposed,
            geo.output_padding,
            g,
            [True, False, False],
        )[0]
        return geo.to_input(grad_in).clamp_min(0)  # round-off only: Rule.input_rule_block
