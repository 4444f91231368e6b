"""Rules for interpolation: ``nn.Upsample`` and its subclasses, and ``F.interpolate``.

Covers ``nn.Upsample``, ``nn.UpsamplingNearest2d``, ``nn.UpsamplingBilinear2d`` and the functional
form.

The maths lives in :func:`interpolate_rule` (backward) and :func:`interpolate_forward_rule` (the
forward counterpart: linearised variance); the module rule only reads the module's settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lsn_ext.rules.base import Rule

__all__ = ["UpsampleRule", "interpolate_forward_rule", "interpolate_rule", "interpolation_matrix"]

_NEAREST_MODES = ("nearest", "nearest-exact")


def _per_axis(value: float | Sequence[float], ndim: int) -> tuple:
    """``value`` repeated for ``ndim`` spatial axes, or a sequence of that length as a tuple."""
    if isinstance(value, Sequence):
        if len(value) != ndim:
            raise ValueError(
                f"interpolate got {len(value)} sizes or scale factors for {ndim} spatial dims"
            )
        return tuple(value)
    return (value,) * ndim


def interpolation_matrix(
    x: Tensor,
    axis: int,
    *,
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Tensor:
    """The 1-D interpolation matrix ``A`` (``[out_d, in_d]``) of spatial axis ``axis`` of ``x``.

    PyTorch's interpolation modes are separable: the weight of input ``i`` in output ``o`` is the
    product of per-axis weights. ``A`` is obtained from PyTorch itself, by interpolating, with the
    same arguments, a batch of ``in_d`` unit vectors along ``axis`` that are constant along every
    other spatial axis, which is kept at size 2 with scale 1 (an exact identity for every mode).
    So every option (``size`` or ``scale_factor``, ``align_corners``, ``recompute_scale_factor``,
    ``antialias``) is reproduced exactly. (Size 1 would do mathematically, but the forward pass of
    PyTorch's CPU ``antialias=True`` kernel, torch 2.13, repeats the first output row over the
    height when the output width is 1; its backward pass is right. Size 2, and inputs constant
    along the other axes, keep that bug out of ``A``.)

    Args:
        x: The interpolation's input ``[N, C, *spatial]``; only its shape, dtype and device are
            used.
        axis: The spatial axis, ``0 ≤ axis < len(spatial)``.
        size: ``size`` of :func:`torch.nn.functional.interpolate`.
        scale_factor: ``scale_factor`` of ``interpolate``.
        mode: ``mode`` of ``interpolate``; one of the separable, interpolating modes.
        align_corners: ``align_corners`` of ``interpolate``.
        recompute_scale_factor: ``recompute_scale_factor`` of ``interpolate``.
        antialias: ``antialias`` of ``interpolate``.

    Returns:
        ``A`` of shape ``[out_d, in_d]``, in the dtype and on the device of ``x``.
    """
    ndim = x.dim() - 2
    n_in = x.shape[2 + axis]
    eye = torch.eye(n_in, dtype=x.dtype, device=x.device)
    shape = tuple(n_in if d == axis else 2 for d in range(ndim))
    view = tuple(n_in if d == axis else 1 for d in range(ndim))
    basis = eye.reshape((n_in, 1, *view)).expand((n_in, 1, *shape)).contiguous()
    if size is not None:
        sizes = _per_axis(size, ndim)
        size = tuple(sizes[d] if d == axis else 2 for d in range(ndim))
    if scale_factor is not None:
        scales = _per_axis(scale_factor, ndim)
        scale_factor = tuple(float(scales[d]) if d == axis else 1.0 for d in range(ndim))
    out = F.interpolate(
        basis,
        size=size,
        scale_factor=scale_factor,
        mode=mode,
        align_corners=align_corners,
        recompute_scale_factor=recompute_scale_factor,
        antialias=antialias,
    )
    index = tuple(slice(None) if d == axis else 0 for d in range(ndim))
    return out[(slice(None), 0, *index)].T


def _interpolate_kwargs(
    size: int | Sequence[int] | None,
    scale_factor: float | Sequence[float] | None,
    mode: str,
    align_corners: bool | None,
    recompute_scale_factor: bool | None,
    antialias: bool,
) -> dict[str, Any]:
    """The keyword arguments of :func:`torch.nn.functional.interpolate`, as one dict."""
    return {
        "size": size,
        "scale_factor": scale_factor,
        "mode": mode,
        "align_corners": align_corners,
        "recompute_scale_factor": recompute_scale_factor,
        "antialias": antialias,
    }


def interpolate_rule(
    x: Tensor,
    y: Tensor,
    m_out: Tensor,
    *,
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Tensor:
    r"""Exact DB step ``m_in = (J ∘ J)^T m_out`` for ``y = F.interpolate(x, ...)``.

    - ``'nearest'`` and ``'nearest-exact'``: every output copies one input, ``J`` is 0/1 and
      ``m_in = J^T m_out`` is the interpolation's own backward pass (a VJP).
    - ``'linear'``, ``'bilinear'``, ``'bicubic'``, ``'trilinear'``, ``'area'`` (also with
      ``antialias``): the interpolation is separable, ``J = A_1 ⊗ … ⊗ A_D`` over the spatial
      axes and the same for every sample and channel, so
      ``J ∘ J = (A_1 ∘ A_1) ⊗ … ⊗ (A_D ∘ A_D)`` and

      .. math::

          m_{in}[n, c, i_1, …, i_D] = \sum_{o_1, …, o_D} A_1[o_1, i_1]^2 \cdots
          A_D[o_D, i_D]^2 \, m_{out}[n, c, o_1, …, o_D],

      with each ``A_d`` from :func:`interpolation_matrix`. Channels are never mixed.

    Args:
        x: The input ``[N, C, *spatial]`` (1 to 3 spatial dims).
        y: The output ``[N, C, *spatial_out]``.
        m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.
        size: ``size`` as given to :func:`torch.nn.functional.interpolate`.
        scale_factor: ``scale_factor`` as given to ``interpolate``.
        mode: ``mode`` as given to ``interpolate``.
        align_corners: ``align_corners`` as given to ``interpolate``.
        recompute_scale_factor: ``recompute_scale_factor`` as given to ``interpolate``.
        antialias: ``antialias`` as given to ``interpolate``.

    Returns:
        ``m_in`` shaped like ``x``, in the dtype of ``m_out``.

    Raises:
        ValueError: If ``m_out`` is not shaped like ``y`` or the arguments do not reproduce ``y``'s
            spatial shape from ``x``.
    """
    if m_out.shape != y.shape:
        raise ValueError(
            f"interpolate_rule: m_out has shape {tuple(m_out.shape)}, the output {tuple(y.shape)}"
        )
    kwargs = _interpolate_kwargs(
        size, scale_factor, mode, align_corners, recompute_scale_factor, antialias
    )
    if mode in _NEAREST_MODES:
        with torch.enable_grad():
            xg = x.detach().to(m_out.dtype).requires_grad_(True)
            (m_in,) = torch.autograd.grad(F.interpolate(xg, **kwargs), xg, m_out)
        return m_in
    return _squared_separable(m_out, x, y, kwargs, forward=False)


def interpolate_forward_rule(
    x: Tensor,
    y: Tensor,
    v_in: Tensor | None,
    *,
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Tensor:
    r"""Exact forward step ``v_out = (J ∘ J) v_in`` for ``y = F.interpolate(x, ...)``.

    The forward counterpart of :func:`interpolate_rule` (linearised variance):

    - ``'nearest'`` and ``'nearest-exact'``: ``J`` is 0/1 and linear, so
      ``v_out = J v_in = F.interpolate(v_in, ...)``.
    - interpolating modes: with the per-axis matrices ``A_d`` of :func:`interpolation_matrix`,

      .. math::

          v_{out}[n, c, o_1, …, o_D] = \sum_{i_1, …, i_D} A_1[o_1, i_1]^2 \cdots
          A_D[o_D, i_D]^2 \, v_{in}[n, c, i_1, …, i_D].

    Args:
        x: The input ``[N, C, *spatial]`` (1 to 3 spatial dims); only its shape is used.
        y: The output ``[N, C, *spatial_out]``.
        v_in: Variance of ``x``, shaped like ``x``; ``None`` means zero.
        size: ``size`` as given to :func:`torch.nn.functional.interpolate`.
        scale_factor: ``scale_factor`` as given to ``interpolate``.
        mode: ``mode`` as given to ``interpolate``.
        align_corners: ``align_corners`` as given to ``interpolate``.
        recompute_scale_factor: ``recompute_scale_factor`` as given to ``interpolate``.
        antialias: ``antialias`` as given to ``interpolate``.

    Returns:
        ``v_out`` shaped like ``y``, in the dtype of ``v_in`` (of ``y`` for ``v_in = None``).

    Raises:
        ValueError: If ``v_in`` is not shaped like ``x`` or the arguments do not reproduce
            ``y``'s spatial shape from ``x``.
    """
    if v_in is None:
        return torch.zeros(y.shape, dtype=y.dtype, device=y.device)
    if v_in.shape != x.shape:
        raise ValueError(
            f"interpolate_forward_rule: v_in has shape {tuple(v_in.shape)}, the input "
            f"{tuple(x.shape)}"
        )
    kwargs = _interpolate_kwargs(
        size, scale_factor, mode, align_corners, recompute_scale_factor, antialias
    )
    if mode in _NEAREST_MODES:
        return F.interpolate(v_in, **kwargs)
    return _squared_separable(v_in, x, y, kwargs, forward=True)


def _squared_separable(m: Tensor, x: Tensor, y: Tensor, kwargs: dict, *, forward: bool) -> Tensor:
    """Apply ``(A_1 ∘ A_1) ⊗ … ⊗ (A_D ∘ A_D)`` to ``m``, or its transpose (``forward=False``).

    ``m`` lives on the output side (``[N, C, *spatial_out]``) when ``forward`` is false and on the
    input side when it is true; each axis is one matrix product with the squared interpolation
    matrix (channels and samples are never mixed).
    """
    ref = x.detach().to(m.dtype)
    for axis in range(x.dim() - 2):
        A = interpolation_matrix(ref, axis, **kwargs)
        if A.shape != (y.shape[2 + axis], x.shape[2 + axis]):
            raise ValueError(
                f"interpolate_rule: the arguments {kwargs} map spatial axis {axis} of size "
                f"{x.shape[2 + axis]} to {A.shape[0]}, but the output has {y.shape[2 + axis]}"
            )
        dim = 2 + axis
        A2 = A.square()
        m = (m.movedim(dim, -1) @ (A2.T if forward else A2)).movedim(-1, dim)
    return m


def _module_settings(module: nn.Upsample) -> dict[str, Any]:
    """The :func:`torch.nn.functional.interpolate` arguments an ``nn.Upsample`` passes."""
    return {
        "size": module.size,
        "scale_factor": module.scale_factor,
        "mode": module.mode,
        "align_corners": module.align_corners,
        "recompute_scale_factor": module.recompute_scale_factor,
    }


class UpsampleRule(Rule):
    """Exact rule for ``nn.Upsample``, ``nn.UpsamplingNearest2d`` and ``nn.UpsamplingBilinear2d``.

    Calls :func:`interpolate_rule` with the module's ``size``, ``scale_factor``, ``mode``,
    ``align_corners`` and ``recompute_scale_factor``; see there for the formula. Shapes: ``x``
    and ``m_in`` are ``[N, C, *spatial]``, ``y`` and ``m_out`` ``[N, C, *spatial_out]``, with 1 to
    3 spatial dimensions as the mode allows. Nearest modes have a 0/1 Jacobian, but the class is
    not marked ``autograd_exact`` because the interpolating modes are not. Forward:
    :func:`interpolate_forward_rule`, ``v_out = (J ∘ J) v_in`` (exact).
    """

    def is_autograd_exact(self, module: nn.Upsample) -> bool:
        """Nearest modes copy inputs (a 0/1 Jacobian): their backward pass is the DB step.

        Args:
            module: The ``nn.Upsample``.

        Returns:
            ``True`` for ``"nearest"`` and ``"nearest-exact"``, ``False`` for the interpolating
            modes.
        """
        return module.mode in _NEAREST_MODES

    def input_rule(self, module: nn.Upsample, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        """Return ``m_in = (J ∘ J)^T m_out``, shaped like ``x`` (see :func:`interpolate_rule`).

        Args:
            module: The ``nn.Upsample``.
            x: Its input ``[N, C, *]``.
            y: Its output ``[N, C, *]``.
            m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.

        Returns:
            ``m_in``, shaped like ``x`` (exact for the layer).
        """
        return interpolate_rule(x, y, m_out, **_module_settings(module))

    def forward_rule(
        self,
        module: nn.Upsample,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        """Return ``v_out = (J ∘ J) v_in``, shaped like ``y`` (:func:`interpolate_forward_rule`).

        Args:
            module: The ``nn.Upsample``.
            x: Its input ``[N, C, *]``.
            y: Its output ``[N, C, *]``.
            v_in: Variance of ``x``, shaped like ``x``; ``None`` means zero.
            param_var: Unused (no parameters).

        Returns:
            ``v_out``, shaped like ``y`` (exact for the layer).
        """
        return interpolate_forward_rule(x, y, v_in, **_module_settings(module))
