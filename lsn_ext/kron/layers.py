r"""The two sides of KFAC for each weight-sharing layer: Linear, Conv1–3d, ConvTranspose1–3d.

A weight ``W`` is seen as a matrix ``[R, D]``: ``R = W.shape[0]`` rows and
``D = ∏ W.shape[1:]`` columns, the layout of laplace-torch's ``Kron`` (``kron(F_row, F_col)``
over ``W.flatten()``). For each sample ``n`` and weight-sharing position ``t`` (a pixel, a voxel,
a token) the layer pairs a *row vector* ``r_{n,t} ∈ ℝ^R`` with a *column vector*
``c_{n,t} ∈ ℝ^{D}`` so that the gradient of a backward pass is

.. math:: \nabla_W = \sum_{n,t} r_{n,t}\, c_{n,t}^\top .

========================  ===================================  ===================================
layer                     rows ``r`` (``R``)                   columns ``c`` (``D``)
========================  ===================================  ===================================
``Linear`` on ``[N,*,I]``  output gradient ``g[n, *, :]``        input ``x[n, *, :]``
``ConvNd``                output gradient at output position   input patch at that position
                          ``t``, ``g[n, :, t]``                (``C_in/groups · ∏k``, im2col)
``ConvTransposeNd``       input ``x[n, :, t]`` at *input*       output gradient patch at ``t``:
                          position ``t``                       ``g[n, o, t·s + k·d − p]`` over
                                                               ``(o, k)`` (``C_out/groups · ∏k``)
========================  ===================================  ===================================

A transposed convolution scatters each input position ``t`` into an output patch through ``W``
(``y[o, t·s + k·d − p] += W[c, o, k] x[c, t]``), so its weight-sharing positions are the *input*
positions, its rows the inputs and its columns the im2col patches of the output gradient. This
keeps ``W``'s own layout ``[C_in, C_out/groups, *k]`` (laplace-torch's ``Kron`` needs the factor
of ``W.shape[0]`` first); the view of a transposed convolution as a convolution of the
zero-stuffed input would put ``C_out`` first, a factorisation that ``W.flatten()`` cannot host.

With ``groups > 1`` the rows of group ``j`` pair with the columns of group ``j`` only: the columns
come as ``[N, T, groups, D]`` and the rows ``[N, T, R]`` split into ``groups`` consecutive
blocks. KFAC keeps one column factor for all groups, the mean over groups of the per-group
moments (curvlinops instead averages the patches over groups before the outer product, which
scales the factor down by up to ``1/groups`` where groups are uncorrelated).

Everything here is a view or a reshape; the moments are taken in :mod:`lsn_ext.kron.factors`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "CHUNK",
    "CONV",
    "KFAC_TYPES",
    "TRANSPOSED",
    "Columns",
    "check_input",
    "columns",
    "describe",
    "groups_of",
    "output_rows",
    "projected_columns",
    "rows",
]

CONV: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED: tuple[type[nn.Module], ...] = (
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
KFAC_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, *CONV, *TRANSPOSED)
"""Exact classes with Kronecker factors (a subclass may compute something else in ``forward``)."""
CHUNK = 1 << 22
"""Entries of one gathered chunk of patches in :meth:`Columns.gram` (16 MiB in float32)."""


def describe(module: nn.Module, path: str) -> str:
    """``'path' (Conv2d, weight [8, 3, 3, 3])`` for messages."""
    weight = getattr(module, "weight", None)
    shape = f", weight {list(weight.shape)}" if isinstance(weight, Tensor) else ""
    return f"'{path}' ({type(module).__name__}{shape})"


def _spatial(module: nn.Module, x: Tensor, path: str) -> int:
    """Number of spatial dims of a convolution, checked against a batched input."""
    d = len(module.kernel_size)
    if x.dim() != d + 2:
        raise ValueError(
            f"{describe(module, path)} got an input of shape {tuple(x.shape)}: KFAC needs a "
            f"batched input [N, C, {', '.join('*' * d)}] with the samples on dim 0"
        )
    return d


def _conv_pads(module: nn.Module, d: int) -> list[tuple[int, int]]:
    """``(left, right)`` zero or mode padding per spatial dim, as ``module`` pads its input."""
    padding = module.padding
    if padding == "valid":
        return [(0, 0)] * d
    if padding == "same":
        pads = []
        for k, dil in zip(module.kernel_size, module.dilation, strict=True):
            total = dil * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in padding]


def _transposed_pads(module: nn.Module, x: Tensor, g: Tensor) -> list[tuple[int, int]]:
    """Pads of a transposed convolution's output gradient whose windows are its input positions.

    ``y[o, t·s + k·d − p]`` gets ``W[c, o, k] x[c, t]``: the output-gradient patch of input
    position ``t`` starts at ``t·s − p``. The output ends ``extra`` (``output_padding``, or what
    ``output_size=`` asked for) beyond ``(S_in − 1)·s − 2p + d(k − 1) + 1``, i.e. ``p − extra``
    short of the last patch (a negative pad crops).
    """
    pads = []
    for i, (k, s, dil, p) in enumerate(
        zip(module.kernel_size, module.stride, module.dilation, module.padding, strict=True)
    ):
        extra = g.shape[2 + i] - ((x.shape[2 + i] - 1) * s - 2 * p + dil * (k - 1) + 1)
        pads.append((p, p - extra))
    return pads


def _pad(x: Tensor, pads: Sequence[tuple[int, int]], mode: str = "zeros") -> Tensor:
    """``x`` ``[N, C, *S]`` padded by ``(left, right)`` per spatial dim (negative pads crop)."""
    flat = [p for pair in reversed(pads) for p in pair]
    if not any(flat):
        return x
    return F.pad(x, flat, mode="constant" if mode == "zeros" else mode)


def _windows(
    x: Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> Tensor:
    """im2col of a padded ``x`` ``[N, C, *S]`` as a view ``[N, *O, C, *K]`` (no copy).

    ``out[n, o, c, k] = x[n, c, o·s + k·d]``.
    """
    d = len(kernel)
    for i, (k, s, dil) in enumerate(zip(kernel, stride, dilation, strict=True)):
        x = x.unfold(2 + i, dil * (k - 1) + 1, s)
    # [N, C, *O, *W]: keep every dil-th tap of each window
    taps = (slice(None),) * (2 + d) + tuple(slice(None, None, dil) for dil in dilation)
    x = x[taps]
    order = [0, *range(2, 2 + d), 1, *range(2 + d, 2 + 2 * d)]
    return x.permute(order)


@dataclass
class Columns:
    """The column vectors of one call as a view ``[N, *P, ...]`` (``*P``: the positions).

    Attributes:
        view: ``Linear``: the input ``[N, *tokens, I]`` (``[N, 1, I]`` for ``[N, I]``);
            convolutions: the im2col view ``[N, *O, C_in, *k]``; transposed convolutions:
            ``[N, *S_in, C_out, *k]`` of the output gradient.
        dims: ``len(P)``, the weight-sharing dims after the batch.
        groups: Channel groups (1 for ``Linear``).
        padded: Convolutions: the padded tensor ``[N, C, *S]`` that ``view`` windows (``None``
            for ``Linear``); with ``kernel``, ``stride`` and ``dilation`` it lets :meth:`gram`
            gather the patches tap by tap.
    """

    view: Tensor
    dims: int
    groups: int
    padded: Tensor | None = None
    kernel: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()

    @property
    def positions(self) -> int:
        """Weight-sharing positions per sample, ``∏ P``."""
        return math.prod(self.view.shape[1 : 1 + self.dims])

    @property
    def width(self) -> int:
        """``groups · D``, the entries of one position."""
        return math.prod(self.view.shape[1 + self.dims :])

    def total(self) -> Tensor:
        """``[N, 1, groups, D]``: the sum over all positions (no copy of the patches)."""
        s = self.view.sum(tuple(range(1, 1 + self.dims)))
        return s.reshape(s.shape[0], 1, self.groups, self.width // self.groups)

    def gram(self, fraction: float = 1.0, generator: torch.Generator | None = None) -> Tensor:
        """``Σ_{n,t,j} c_{n,t,j} c_{n,t,j}ᵀ`` ``[D, D]`` over the positions and groups.

        With ``fraction < 1`` each sample keeps ``T' = ⌈fraction · T⌉`` of its ``T`` positions,
        drawn uniformly without replacement and independently per sample (``generator``), and
        the sum over them is weighted by ``T/T'``: every position is kept with probability
        ``T'/T``, so the result is an unbiased estimate of the full moment.

        Convolutions gather the patches from :attr:`padded` by kernel tap, as ``[groups, D,
        n·t]`` matrices (whole rows of strided slices, in chunks of about :data:`CHUNK` entries
        of the first position dim; or the kept positions by one ``gather``), which is cheaper
        than copying the im2col view.
        """
        if fraction < 1.0:
            return self._sampled_gram(fraction, generator)
        D = self.width // self.groups
        if self.padded is None:  # Linear: the input itself
            flat = self.view.reshape(-1, D)
            return flat.T @ flat
        xt = self.padded.transpose(0, 1)  # [C, N, *S]
        N = xt.shape[1]
        out_size = self.view.shape[1 : 1 + self.dims]
        rest = math.prod(out_size[1:])
        step = max(1, CHUNK // max(1, self.width * N * rest))
        gram = None
        for a in range(0, out_size[0], step):
            b = min(a + step, out_size[0])
            slices = []
            for tap in itertools.product(*map(range, self.kernel)):
                first = [k * d for k, d in zip(tap, self.dilation, strict=True)]
                first[0] += a * self.stride[0]
                counts = [b - a, *out_size[1:]]
                index = tuple(
                    slice(f, f + (n - 1) * s + 1, s)
                    for f, n, s in zip(first, counts, self.stride, strict=True)
                )
                slices.append(xt[(slice(None), slice(None), *index)])
            M = torch.stack(slices, 1).reshape(self.groups, D, -1)  # [(c, k), (n, t)] per group
            part = _group_gram(M)
            gram = part if gram is None else gram.add_(part)
        return gram

    def _sampled_gram(self, fraction: float, generator: torch.Generator | None) -> Tensor:
        """:meth:`gram` over a random ``fraction`` of each sample's positions, weighted.

        The kept positions are gathered in chunks of about :data:`CHUNK` entries.
        """
        N, T = self.view.shape[0], self.positions
        kept = min(T, math.ceil(fraction * T))
        device = self.view.device
        order = torch.rand(N, T, generator=generator, device=device).argsort(dim=1)[:, :kept]
        D = self.width // self.groups
        step = max(1, CHUNK // max(1, self.width * N))
        if self.padded is None:  # Linear on tokens: [N, T, I]
            flat = self.view.reshape(N, T, -1)
        else:
            # linear index into the padded positions of position o and tap k:
            # Σ_i (o_i s_i + k_i d_i) · (stride of padded spatial dim i)
            spatial = self.padded.shape[2:]
            steps = [math.prod(spatial[i + 1 :]) for i in range(self.dims)]
            taps = torch.tensor(
                [
                    sum(k * d * st for k, d, st in zip(tap, self.dilation, steps, strict=True))
                    for tap in itertools.product(*map(range, self.kernel))
                ],
                device=device,
            )
            flat = self.padded.reshape(N, self.padded.shape[1], -1)
        gram = None
        for a in range(0, kept, step):
            part_order = order[:, a : a + step]
            t = part_order.shape[1]
            if self.padded is None:
                index = part_order.unsqueeze(2).expand(N, t, flat.shape[2])
                M = torch.gather(flat, 1, index).reshape(-1, D).T.unsqueeze(0)
            else:
                where = torch.unravel_index(part_order, self.view.shape[1 : 1 + self.dims])
                base = sum(o * (s * st) for o, s, st in zip(where, self.stride, steps, strict=True))
                index = (taps.view(1, -1, 1) + base.unsqueeze(1)).reshape(N, 1, -1)  # [N, 1, K t]
                part = torch.gather(flat, 2, index.expand(N, flat.shape[1], -1))  # [N, C, K t]
                M = part.unflatten(2, (len(taps), t)).permute(1, 2, 0, 3)  # [C, K, N, t]
                M = M.reshape(self.groups, D, -1)
            piece = _group_gram(M)
            gram = piece if gram is None else gram.add_(piece)
        return gram.mul_(T / kept)


def _group_gram(M: Tensor) -> Tensor:
    """``Σ_j M_j M_jᵀ`` of ``[groups, D, m]``."""
    return M[0] @ M[0].T if M.shape[0] == 1 else torch.einsum("jdt,jet->de", M, M)


def columns(module: nn.Module, path: str, x: Tensor, g: Tensor | None = None) -> Columns:
    """The column vectors of one call of ``module`` (see the module documentation).

    Args:
        module: A module of :data:`KFAC_TYPES`.
        path: Its name in the model, for messages.
        x: The module's input.
        g: The gradient at the module's output (transposed convolutions only: their columns
            come from it).
    """
    if type(module) is nn.Linear:
        view = x.unsqueeze(1) if x.dim() == 2 else x
        return Columns(view, view.dim() - 2, 1)
    d = _spatial(module, x, path)
    if type(module) in CONV:
        padded = _pad(x, _conv_pads(module, d), module.padding_mode)
    elif g is None:
        raise ValueError(f"{describe(module, path)}: a transposed convolution's columns need g")
    else:
        padded = _pad(g, _transposed_pads(module, x, g))
    geometry = (tuple(module.kernel_size), tuple(module.stride), tuple(module.dilation))
    view = _windows(padded, *geometry)
    if type(module) in TRANSPOSED and tuple(view.shape[1 : 1 + d]) != tuple(x.shape[2:]):
        raise ValueError(
            f"{describe(module, path)}: input {tuple(x.shape)} and output gradient "
            f"{tuple(g.shape)} do not fit a transposed convolution with this module's settings"
        )
    return Columns(view, d, module.groups, padded, *geometry)


def projected_columns(module: nn.Module, path: str, x: Tensor, g: Tensor, v: Tensor) -> Tensor:
    """``c_{n,t,j} · v_j`` for every position, ``[N, T, groups]``, without the patches.

    The layer's own operation with ``v`` as a one-channel-per-group kernel: a matrix-vector
    product (``Linear``), a convolution of the padded input (``ConvNd``), or of the padded
    output gradient (``ConvTransposeNd``, whose columns are its patches).

    Args:
        module: A module of :data:`KFAC_TYPES`.
        path: Its name, for messages.
        x: The module's input.
        g: The gradient at its output.
        v: ``[groups, D]``.
    """
    if type(module) is nn.Linear:
        return (x @ v[0]).reshape(x.shape[0], -1, 1)
    d = _spatial(module, x, path)
    conv = (F.conv1d, F.conv2d, F.conv3d)[d - 1]
    kernel = v.reshape(v.shape[0], -1, *module.kernel_size)
    if type(module) in CONV:
        source = _pad(x, _conv_pads(module, d), module.padding_mode)
    else:
        source = _pad(g, _transposed_pads(module, x, g))
    out = conv(source, kernel, stride=module.stride, dilation=module.dilation, groups=module.groups)
    return out.flatten(2).transpose(1, 2)


def rows(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """The row vectors ``[N, T, R]``: the output gradient, or a transposed conv's input."""
    if type(module) is nn.Linear:
        return g.reshape(g.shape[0], -1, g.shape[-1])
    v = x if type(module) in TRANSPOSED else g
    return v.flatten(2).transpose(1, 2)


def output_rows(module: nn.Module, g: Tensor) -> Tensor:
    """The output gradient per output position ``[N, T_out, C_out]`` (the bias's vectors)."""
    if type(module) is nn.Linear:
        return g.reshape(g.shape[0], -1, g.shape[-1])
    return g.flatten(2).transpose(1, 2)


def groups_of(module: nn.Module) -> int:
    """The channel groups that split rows and columns (1 for ``Linear``)."""
    return 1 if type(module) is nn.Linear else module.groups


def check_input(module: nn.Module, path: str, x: Tensor, batch: int) -> None:
    """Refuse inputs without the batch on dim 0 (named, with shapes)."""
    if type(module) is nn.Linear:
        if x.dim() < 2 or x.shape[0] != batch:
            raise ValueError(
                f"{describe(module, path)} got an input of shape {tuple(x.shape)}: KFAC needs "
                f"the {batch} samples on dim 0 ([N, *, in_features])"
            )
        return
    _spatial(module, x, path)
    if x.shape[0] != batch:
        raise ValueError(
            f"{describe(module, path)} got an input of shape {tuple(x.shape)} whose dim 0 is "
            f"not the batch ({batch}): KFAC needs the samples on dim 0"
        )
