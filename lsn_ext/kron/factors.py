r"""Moments that become Kronecker factors, and the blocks of parameters without a KFAC layer.

KFAC-expand and KFAC-reduce (Eschenhagen et al., NeurIPS 2023) differ in how the
weight-sharing positions ``t`` of a sample enter a side's second moment:

.. math:: \text{expand: } \sum_{n,t} v_{n,t} v_{n,t}^\top, \qquad
          \text{reduce: } \sum_n \Big(\sum_t v_{n,t}\Big)\Big(\sum_t v_{n,t}\Big)^\top .

:class:`Moment` accumulates either over chunks of positions and calls; the normalisation (means
over positions, groups, data and draws) is applied by :mod:`lsn_ext.kron.curvature`.

A parameter outside a KFAC layer gets a block from per-sample (or batch) gradients
``γ`` (:class:`OtherBlock`), in the layout laplace-torch's ``Kron.init_from_model`` gives it,
so that ``KronLaplace`` can add it to its zero-initialised ``Kron``:

=====================  ========================  ==============================================
parameter              ``numel ≤ full_limit``    larger
=====================  ========================  ==============================================
0-D / 1-D (``[P]``)    ``full``: ``[Σ γ γᵀ]``     ``diagonal``: ``[diag(Σ γ²)]``, stored dense
≥ 2-D (``[R, *D]``)    ``nearest kron``: the      ``kron moments``: ``[Σ Γ Γᵀ, c · Σ Γᵀ Γ]``
                       Frobenius-nearest          with ``Γ = γ.reshape(R, D)`` and ``c`` making
                       Kronecker product of the   the second factor's trace ``M/N`` (hence the
                       full block (Van Loan and   product's trace ``(M/N) Σ ‖Γ‖²``, the exact
                       Pitsianis)                 block's times ``M/N``, as for KFAC pairs)
=====================  ========================  ==============================================

A ``Kron`` entry of a 1-D parameter must be a dense ``[P, P]`` matrix: ``KronLaplace`` adds the
backend's factors to dense zeros factor by factor, and a vector would broadcast into a wrong
matrix without an error. A ≥ 2-D parameter's entry must be two factors of sizes ``R`` and ``D``,
which a general full block is not: the nearest Kronecker product is the closest one can give.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = ["Mode", "Moment", "OtherBlock", "kind_of", "nearest_kron", "psd"]

Mode = Literal["expand", "reduce"]


class Moment:
    """One side's second moment over positions, by KFAC-expand or -reduce (un-normalised).

    Args:
        mode: ``"expand"``: ``Σ_{n,t,j} v vᵀ``; ``"reduce"``: ``Σ_{n,j} s sᵀ`` with
            ``s = Σ_t v`` summed over every call added before :meth:`take`.
    """

    def __init__(self, mode: Mode):
        self.mode = mode
        self.gram: Tensor | None = None
        self.sums: Tensor | None = None

    def add(self, v: Tensor) -> None:
        """Add vectors ``[N, t, k, D]`` (``k`` groups, each its own vector of length ``D``)."""
        if self.mode == "expand":
            flat = v.reshape(-1, v.shape[-1])
            self.add_gram(flat.T @ flat)
        else:
            s = v.sum(1)
            self.sums = s if self.sums is None else self.sums.add_(s)

    def add_gram(self, gram: Tensor) -> None:
        """Add a KFAC-expand moment ``Σ v vᵀ`` ``[D, D]`` computed elsewhere."""
        if self.mode != "expand":
            raise ValueError("KFAC-reduce needs the vectors' sums, not their outer products")
        self.gram = gram if self.gram is None else self.gram.add_(gram)

    def take(self) -> Tensor | None:
        """The moment ``[D, D]`` so far (``None`` if nothing was added); resets."""
        if self.mode == "expand":
            out, self.gram = self.gram, None
            return out
        if self.sums is None:
            return None
        flat = self.sums.reshape(-1, self.sums.shape[-1])
        self.sums = None
        return flat.T @ flat


BlockKind = Literal["full", "diagonal", "nearest kron", "kron moments"]


def kind_of(shape: torch.Size, full_limit: int) -> BlockKind:
    """The block a parameter of this shape gets outside a KFAC layer (module table)."""
    small = math.prod(shape) <= full_limit
    if len(shape) <= 1:
        return "full" if small else "diagonal"
    return "nearest kron" if small else "kron moments"


class OtherBlock:
    """The curvature block of one parameter outside a KFAC layer, summed over gradients ``γ``.

    ``Σ γ γᵀ`` over per-sample gradients (and draws) is an unbiased estimate of the parameter's
    GGN block ``Σ_n J_nᵀ H_n J_n``, and so is ``γ γᵀ`` for the batch gradient
    ``γ = Σ_n J_nᵀ s_n`` (the cross terms ``J_nᵀ s_n s_mᵀ J_m``, ``n ≠ m``, have mean zero
    because the draws of different samples are independent), with more variance.

    Args:
        shape: The parameter's shape.
        kind: From :func:`kind_of`.
    """

    def __init__(self, shape: torch.Size, kind: BlockKind):
        self.shape, self.kind = shape, kind
        self.rows = shape[0] if len(shape) >= 2 else 1
        self.sums: list[Tensor | None] = [None, None, None]

    def _add(self, i: int, t: Tensor) -> None:
        self.sums[i] = t if self.sums[i] is None else self.sums[i].add_(t)

    def add(self, grads: Tensor) -> None:
        """Add gradients ``[k, *shape]`` (``k`` per-sample gradients, or one batch gradient)."""
        flat = grads.reshape(grads.shape[0], -1)
        if self.kind in ("full", "nearest kron"):
            self._add(0, flat.T @ flat)
        elif self.kind == "diagonal":
            self._add(0, flat.square().sum(0))
        else:
            G = flat.reshape(flat.shape[0], self.rows, -1)
            self._add(0, torch.einsum("kid,kjd->ij", G, G))
            self._add(1, torch.einsum("kri,krj->ij", G, G))
            self._add(2, flat.square().sum())

    def factors(self, draws: int, mean_scale: float, like: Tensor) -> list[Tensor]:
        """The ``Kron`` entry: the sums over ``draws`` draws, averaged.

        Args:
            draws: Monte-Carlo draws added.
            mean_scale: ``M/N``, the trace of a ≥ 2-D block's second factor. As in a KFAC pair,
                the first factor sums over the batch and the second is a mean scaled by ``M/N``,
                so the product is ``M/N`` times the batch's block and laplace-torch's sum of
                the factors over all batches approximates the data set's block.
            like: A tensor with the dtype and device of the result.
        """
        P = math.prod(self.shape)
        if self.kind in ("full", "diagonal"):
            s = self.sums[0]
            if s is None:
                return [like.new_zeros(P, P)]
            s = s / draws
            return [s if self.kind == "full" else torch.diag(s)]
        D = P // self.rows
        if self.sums[0] is None:
            return [like.new_zeros(self.rows, self.rows), like.new_zeros(D, D)]
        if self.kind == "nearest kron":
            return nearest_kron(self.sums[0] / draws, self.rows, D, mean_scale)
        left, right, total = (s / draws for s in self.sums)
        trace = right.trace()
        if float(total) <= 0 or float(trace) <= 0:
            return [like.new_zeros(self.rows, self.rows), like.new_zeros(D, D)]
        return [left, right * (mean_scale / trace)]


def psd(M: Tensor) -> Tensor:
    """The nearest symmetric positive semi-definite matrix (eigenvalues clipped at 0)."""
    M = (M + M.T) / 2
    vals, vecs = torch.linalg.eigh(M)
    return (vecs * vals.clamp_min(0)) @ vecs.T


def nearest_kron(B: Tensor, R: int, D: int, mean_scale: float) -> list[Tensor]:
    """``[F0, F1]`` minimising ``‖B − F0 ⊗ F1‖_F`` (Van Loan and Pitsianis, 1993).

    The rearrangement ``ℛ(B)[(i, i'), (j, j')] = B[(i, j), (i', j')]`` turns the Kronecker
    product into the rank-1 matrix ``vec F0 vec F1ᵀ``; its leading singular pair gives the
    factors. For a symmetric positive semi-definite ``B`` both can be taken symmetric positive
    semi-definite; rounding is removed by :func:`psd`. ``F1``'s trace is set to ``mean_scale``
    (``F0 ⊗ F1 ≈ (M/N) B``, as a KFAC pair of one batch: see :meth:`OtherBlock.factors`).

    Args:
        B: ``[R·D, R·D]``.
        R: Rows of the parameter (size of ``F0``).
        D: Columns (size of ``F1``).
        mean_scale: The trace of ``F1`` (see :meth:`OtherBlock.factors`).
    """
    rearranged = B.reshape(R, D, R, D).permute(0, 2, 1, 3).reshape(R * R, D * D)
    U, S, Vh = torch.linalg.svd(rearranged, full_matrices=False)
    F0 = (U[:, 0] * S[0]).reshape(R, R)
    F1 = Vh[0].reshape(D, D)
    if float(F1.trace()) < 0:
        F0, F1 = -F0, -F1
    F0, F1 = psd(F0), psd(F1)
    trace = F1.trace()
    if float(trace) <= 0:
        return [torch.zeros_like(F0), torch.zeros_like(F1)]
    return [F0 * trace, F1 * (mean_scale / trace)]
