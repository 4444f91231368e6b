"""Converting :class:`lsn_ext.models.UNet` into its StochMan form, :func:`to_nnj`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lsn_ext.models import UNet
from lsn_ext.stochman_ext.containers import Sequential, SkipConnection, join_path
from lsn_ext.stochman_ext.layers import (
    ELU,
    Conv2d,
    ConvTranspose2d,
    LeakyReLU,
    MaxPool2d,
    MeanHead,
    ReLU,
    Sigmoid,
    Softplus,
    Tanh,
    Upsample,
)

__all__ = ["to_nnj"]


def _share(new: nn.Module, old: nn.Module) -> nn.Module:
    for name, p in old.named_parameters(recurse=False):
        setattr(new, name, p)
    return new


_CONVERTERS: dict[type[nn.Module], Callable[[Any], nn.Module]] = {
    nn.Conv2d: lambda m: _share(
        Conv2d(
            m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
            m.groups, m.bias is not None, m.padding_mode,
        ),
        m,
    ),
    nn.ConvTranspose2d: lambda m: _share(
        ConvTranspose2d(
            m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.output_padding,
            m.groups, m.bias is not None, m.dilation, m.padding_mode,
        ),
        m,
    ),
    nn.MaxPool2d: lambda m: MaxPool2d(
        m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode
    ),
    nn.Upsample: lambda m: Upsample(
        m.size, m.scale_factor, m.mode, m.align_corners, m.recompute_scale_factor
    ),
    nn.Tanh: lambda m: Tanh(),
    nn.Sigmoid: lambda m: Sigmoid(),
    nn.ReLU: lambda m: ReLU(m.inplace),
    nn.LeakyReLU: lambda m: LeakyReLU(m.negative_slope, m.inplace),
    nn.ELU: lambda m: ELU(m.alpha, m.inplace),
    nn.Softplus: lambda m: Softplus(m.beta, m.threshold),
    nn.Dropout2d: lambda m: nn.Dropout2d(m.p),
}  # fmt: skip


def _convert(module: nn.Module, path: str) -> nn.Module:
    if type(module) is nn.Sequential:
        return Sequential(*(_convert(c, join_path(path, n)) for n, c in module.named_children()))
    try:
        convert = _CONVERTERS[type(module)]
    except KeyError:
        raise TypeError(
            f"to_nnj cannot convert '{path}' ({type(module).__name__}); it converts "
            f"{', '.join(c.__name__ for c in _CONVERTERS)} and nn.Sequential"
        ) from None
    return convert(module).train(module.training)


def to_nnj(unet: UNet) -> Sequential:
    """The nnj form of an :class:`lsn_ext.models.UNet`, sharing its parameters.

    With encoder blocks ``E_l``, pools ``P_l``, upsamplings ``U_l`` and decoder blocks ``D_l``
    (level ``l = 0`` at full resolution, ``L`` levels), the U-Net is nested skip connections::

        S_{L-2} = SkipConnection(P_{L-2}, E_{L-1}, U_{L-2})
        S_l     = SkipConnection(P_l, E_{l+1}, S_{l+1}, D_{l+1}, U_l)        (l < L − 2)
        net     = Sequential(Sequential(E_0, S_0, D_0), MeanHead)

    so that ``net`` = ``Sequential(backbone, mean_head)``, the LSN mean network, computes
    ``unet(x)`` exactly. The parameter *objects* are shared (training one trains the other;
    ``copy.deepcopy`` the result for an independent copy), so diagonals can be matched by
    parameter identity.

    Args:
        unet: The U-Net. Its ``head`` must be the 1×1 convolution it builds.

    Returns:
        ``Sequential(backbone, MeanHead)``.

    Raises:
        TypeError: If ``unet`` is not a :class:`~lsn_ext.models.UNet`, or contains a layer this
            converter does not know (the message names it).
    """
    if not isinstance(unet, UNet):
        raise TypeError(f"to_nnj converts lsn_ext.models.UNet, got {type(unet).__name__}")
    levels = len(unet.widths)
    enc = [_convert(e, f"encoders.{i}") for i, e in enumerate(unet.encoders)]
    pools = [_convert(p, f"pools.{i}") for i, p in enumerate(unet.pools)]
    # ups / decoders are stored from the bottleneck upwards: index j serves level L − 2 − j.
    ups = {levels - 2 - j: _convert(u, f"ups.{j}") for j, u in enumerate(unet.ups)}
    dec = {levels - 2 - j: _convert(d, f"decoders.{j}") for j, d in enumerate(unet.decoders)}
    inner: SkipConnection | None = None
    for level in range(levels - 2, -1, -1):
        layers = [pools[level], enc[level + 1]]
        if inner is not None:
            layers += [inner, dec[level + 1]]
        inner = SkipConnection(*layers, ups[level], dim=1, order="skip-first")
    backbone = Sequential(enc[0]) if inner is None else Sequential(enc[0], inner, dec[0])
    head = unet.head
    mean_head = _share(MeanHead(head.in_channels, head.out_channels, head.bias is not None), head)
    return Sequential(backbone, mean_head).train(unet.training)
