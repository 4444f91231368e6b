r"""The exact GGN of a network's head on one batch: full, diagonal, and its Kronecker factors.

With the head's per-position features ``φ̃`` (:mod:`lsn_ext.laplace_ext.head`) and the loss
Hessian w.r.t. the logits at each position, ``Λ_{n,p} [C, C]`` (:meth:`~lsn_ext.Loss.
hessian_block`: ``w_y (diag p − p pᵀ)`` for softmax cross-entropy; diagonal
:meth:`~lsn_ext.Loss.hessian_diag` for BCE, one entry per channel, and for MSE), the GGN of the
head's parameters is, in the canonical order ``θ[c, d]`` (shape legend: ``N`` samples, ``P``
positions, ``C`` channels, ``D̃`` features)

.. math:: H_{(c,d),(c',e)} = \sum_{n,p} \Lambda_{n,p}[c, c']\, \tilde\phi_{n,d,p}\,
          \tilde\phi_{n,e,p}
          \quad (= \textstyle\sum_{n,p} J_{n,p}^\top \Lambda_{n,p} J_{n,p},\
          J_{n,p} = I_C \otimes \tilde\phi_{n,p}^\top),

exactly (no sampling), with laplace-torch's conventions: the loss summed over the data, the
temperature and ``σ²`` applied by laplace-torch (``_H_factor``), ``N`` (the data-set size) only
in the Kronecker factors. ``"full"`` returns it in ``parameters_to_vector`` order,
``"diag"`` its diagonal. Cost ``O(N P C² D̃²)``, memory ``O(C² D̃²)`` plus chunks of at most
2²⁴ numbers.

``"kron"``: KFAC-expand (Eschenhagen et al., 2023: the positions are a weight-sharing
dimension of a per-position loss) in laplace-torch's ``Kron`` layout, the expectation of
:func:`lsn_ext.kron.kron_curvature`'s Monte-Carlo factors taken in closed form. For a
``Linear``/``Conv`` head (weight ``[C, D]``)

.. math:: G = \sum_{n,p} \Lambda_{n,p}, \qquad A = \frac{1}{N_\text{data} P}
          \sum_{n,p} \phi_{n,p} \phi_{n,p}^\top, \qquad H_W \approx G \otimes A,

and the bias's block ``G`` (its exact GGN block). For a transposed convolution (weight
``[C_in, C, *k]``, laplace-torch's first factor over ``C_in``) the rows are the head's inputs
``x_{n,t}`` at the input positions ``t`` and the columns the output-space patches:
``F_0 = Σ_{n,t} x xᵀ``, ``F_1[(c,k),(c',k')] = δ_{kk'} / (N_data T) · Σ_{n,t} Λ_{n,
q(t,k)}[c, c']`` with ``q(t,k) = t·s + k·d − p`` the output position tap ``k`` of input ``t``
reaches (zero outside the output).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lsn_ext._laplace import laplace
from lsn_ext.laplace_ext.head import (
    TRANSPOSED_HEADS,
    HeadBatch,
    capture_head,
    head_permutation,
)
from lsn_ext.rules.losses import CrossEntropy, Loss

__all__ = ["STRUCTURES", "head_curvature", "loss_blocks"]

Kron = laplace.utils.matrix.Kron
STRUCTURES = ("full", "diag", "kron")
CHUNK = 1 << 24  # numbers in one chunk of intermediate products


def loss_blocks(loss: Loss, f: Tensor, y: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """The loss and its Hessian w.r.t. the logits, per position.

    Returns:
        ``(value, block, diagonal)``: the summed loss; ``Λ [N, C, C, P]`` or ``None`` where
        it is diagonal; its diagonal ``[N, C, P]``.
    """
    N, C = f.shape[:2]
    value = loss.value(f, y)
    block = loss.hessian_block(f, y)
    if block is not None:
        block = block.reshape(N, C, C, -1)
        return value, block, block.diagonal(dim1=1, dim2=2).movedim(-1, 1)
    return value, None, loss.hessian_diag(f, y).reshape(N, C, -1)


def _rows(t: Tensor) -> Tensor:
    """``[N, K, P]`` → ``[N·P, K]``: one row per position."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def _full(batch: HeadBatch, block: Tensor | None, diagonal: Tensor) -> Tensor:
    """``H`` in canonical order, ``[C·D̃, C·D̃]``."""
    C, Dt = batch.classes, batch.features.shape[1]
    rows = _rows(batch.features)
    H = rows.new_zeros(C, Dt, C, Dt)
    if block is None:
        lam = _rows(diagonal)
        step = max(1, CHUNK // (C * Dt))
        for s in range(0, rows.shape[0], step):
            r, w = rows[s : s + step], lam[s : s + step]
            blocks = torch.einsum("mc,md,me->cde", w, r, r)
            H[torch.arange(C), :, torch.arange(C), :] += blocks
    else:
        lam = block.permute(0, 3, 1, 2).reshape(-1, C, C)
        step = max(1, CHUNK // (C * C * Dt))
        for s in range(0, rows.shape[0], step):
            r, w = rows[s : s + step], lam[s : s + step]
            H += torch.einsum("mcC,md,me->cdCe", w, r, r)
    return H.reshape(C * Dt, C * Dt)


def _kron_conv(batch: HeadBatch, lam_sum: Tensor, N: int) -> list[list[Tensor]]:
    """``[[G, A]]`` (and ``[G]`` for the bias) of a ``Linear``/``Conv`` head."""
    D = batch.features.shape[1] - int(batch.has_bias)
    phi = _rows(batch.features[:, :D])
    positions = batch.features.shape[2]
    A = phi.T @ phi / (N * positions)
    return [[lam_sum, A], *([[lam_sum.clone()]] if batch.has_bias else [])]


def _kron_transposed(
    head: nn.Module, batch: HeadBatch, lam: Tensor, lam_sum: Tensor, N: int
) -> list[list[Tensor]]:
    """``[[F_0, F_1]]`` (and ``[G]`` for the bias) of a transposed-convolution head."""
    x = batch.inputs
    c_in, spatial = x.shape[1], x.shape[2:]
    rows = x.transpose(0, 1).reshape(c_in, -1)
    F0 = rows @ rows.T
    C = batch.classes
    kernel = tuple(head.kernel_size)
    taps = math.prod(kernel)
    conv = (F.conv1d, F.conv2d, F.conv3d)[len(kernel) - 1]
    eye = torch.eye(taps, dtype=lam.dtype, device=lam.device).reshape(taps, 1, *kernel)
    out_spatial = batch.logits.shape[2:]
    # Λ at q(t, k) = t·s + k·d − p for every input position t and tap k: a strided convolution
    # of Λ (zero padded, so taps outside the output add nothing) with one-hot kernels.
    gathered = conv(
        lam.reshape(-1, 1, *out_spatial),
        eye,
        stride=head.stride,
        padding=head.padding,
        dilation=head.dilation,
    )
    crop = (slice(None), slice(None), *(slice(0, n) for n in spatial))
    per_tap = gathered[crop].flatten(2).sum(-1).reshape(-1, C, C, taps).sum(0)  # [C, C, K]
    F1 = torch.einsum("cCk,kl->ckCl", per_tap, eye.reshape(taps, taps))
    F1 = F1.reshape(C * taps, C * taps) / (N * math.prod(spatial))
    return [[F0, F1], *([[lam_sum]] if batch.has_bias else [])]


def head_curvature(
    network: nn.Module,
    head: nn.Module,
    x: Any,
    y: Tensor,
    loss: Loss,
    structure: Literal["full", "diag", "kron"],
    N: int | None = None,
    name: str = "head",
) -> tuple[Tensor, Any]:
    """``(loss, H)`` of one batch for the head's parameters, laplace-torch's backend contract.

    Args:
        network: The network; ``network(x)`` returns the logits ``[N, C, *]``.
        head: Its head (:func:`~lsn_ext.laplace_ext.head.capture_head`).
        x: The batch's inputs.
        y: Its targets, as ``loss`` takes them.
        loss: The loss, summed over the data.
        structure: ``"full"`` (``[P, P]``), ``"diag"`` (``[P]``) or ``"kron"`` (``Kron``),
            ``P`` the head's parameters in ``parameters_to_vector`` order.
        N: The data-set size (``"kron"`` only; default: the batch size).
        name: The head's name, for messages.

    Returns:
        The summed loss (detached) and the curvature.

    Raises:
        ValueError: For an unknown structure, cross-entropy over one logit channel, and what
            :func:`~lsn_ext.laplace_ext.head.capture_head` and the loss refuse.
    """
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    with torch.no_grad():
        batch = capture_head(network, head, x, name)
        f = batch.logits
        if isinstance(loss, CrossEntropy) and batch.classes == 1:
            raise ValueError(
                f"cross-entropy over one logit channel (output {tuple(f.shape)}) is constant: "
                "for binary segmentation with one channel pass backend_kwargs={'loss': 'bce'}"
            )
        value, block, diagonal = loss_blocks(loss, f, y)
        perm = head_permutation(head)
        if structure == "diag":
            H = torch.einsum("ncp,ndp->cd", diagonal, batch.features.square()).reshape(-1)
            out = torch.empty_like(H)
            out[perm] = H
            return value.detach(), out
        if structure == "full":
            H = _full(batch, block, diagonal)
            out = torch.empty_like(H)
            out[perm.unsqueeze(1), perm.unsqueeze(0)] = H
            return value.detach(), out
        N = f.shape[0] if N is None else N
        lam = block if block is not None else torch.diag_embed(diagonal.transpose(1, 2))
        if block is None:
            lam = lam.permute(0, 2, 3, 1)  # [N, C, C, P]
        lam_sum = lam.sum((0, 3))
        if isinstance(head, TRANSPOSED_HEADS):
            kfacs = _kron_transposed(head, batch, lam, lam_sum, N)
        else:
            kfacs = _kron_conv(batch, lam_sum, N)
        names = [n for n, _ in head.named_parameters()]
        order = {"weight": kfacs[0], "bias": kfacs[1] if len(kfacs) > 1 else None}
        return value.detach(), Kron([order[n] for n in names])
