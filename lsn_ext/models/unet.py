"""A configurable U-Net written the way users write one: plain modules and ``torch.cat`` skips.

Shape legend: ``N`` batch, ``C`` channels, ``H``/``W`` height and width, ``L`` number of levels
(``len(widths)``), ``K`` output channels (classes, or 1 for binary segmentation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["UNet"]

_UPSAMPLING = ("nearest", "bilinear", "transposed")


def _block(
    in_channels: int,
    out_channels: int,
    activation: Callable[[], nn.Module],
    convs: int,
    dropout: float,
) -> nn.Sequential:
    """``convs`` × (3×3 convolution with padding 1, activation[, ``Dropout2d``])."""
    layers: list[nn.Module] = []
    for i in range(convs):
        layers.append(
            nn.Conv2d(in_channels if i == 0 else out_channels, out_channels, 3, padding=1)
        )
        layers.append(activation())
        if dropout > 0:
            layers.append(nn.Dropout2d(dropout))
    return nn.Sequential(*layers)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class UNet(nn.Module):
    """U-Net (Ronneberger et al. 2015) with the LSN paper's backbone as default.

    Encoder level ``l`` is a block of ``convs_per_block`` × (3×3 conv, padding 1, activation) with
    ``widths[l]`` channels; ``nn.MaxPool2d(2)`` goes down a level. The decoder upsamples by 2,
    concatenates the encoder feature map of the same level in front (``torch.cat([skip, up],
    dim=1)``) and applies a block with ``widths[l]`` channels. A 1×1 convolution maps the last
    feature map to ``out_channels`` logits.

    The defaults are the backbone of the Laplacian Segmentation Network (Zepf et al. 2024,
    §4 and supplementary §1): five levels with 8-16-32-64-128 feature maps, two convolutions
    with ``tanh`` per block. The paper does not state the upsampling; the authors' public code
    builds the LSN mean network from StochMan ``nnj.Upsample(scale_factor=2)``, i.e. *nearest*
    upsampling (their plain U-Net baseline interpolates bilinearly), so ``"nearest"`` is the
    default here. Nearest upsampling has a 0/1 Jacobian, so diagonal backpropagation through it
    is exact; ``"bilinear"`` (``align_corners=False``) is not.

    Every non-linearity is a module, a fresh instance per use, so hooks and rule tables see each
    one (no functional calls in :meth:`forward`).

    Args:
        in_channels: Channels of the input image.
        out_channels: Channels of the output logits (1 for binary segmentation with BCE,
            the number of classes for cross-entropy).
        widths: Feature maps per level, from the top (full resolution) to the bottleneck.
            ``len(widths)`` levels need ``H`` and ``W`` divisible by ``2 ** (len(widths) - 1)``.
        activation: Zero-argument callable returning an activation module (a class such as
            ``nn.Tanh`` or ``nn.ReLU``, or e.g. ``functools.partial(nn.LeakyReLU, 0.1)``).
        convs_per_block: Convolutions (each followed by the activation) per block.
        upsampling: ``"nearest"`` or ``"bilinear"`` (``nn.Upsample(scale_factor=2)``), or
            ``"transposed"`` (``nn.ConvTranspose2d`` with kernel 2, stride 2, halving the
            channels to the skip's width).
        dropout: If positive, an ``nn.Dropout2d(dropout)`` after every activation (for
            MC-dropout baselines); 0 adds no dropout modules.

    Raises:
        ValueError: For non-positive channel counts or widths, an empty ``widths``, an unknown
            ``upsampling``, ``convs_per_block < 1`` or ``dropout`` outside ``[0, 1)``.
        TypeError: If ``activation()`` does not return an ``nn.Module``.

    Example:
        >>> net = UNet(3, 1)
        >>> net(torch.zeros(2, 3, 64, 64)).shape
        torch.Size([2, 1, 64, 64])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        widths: Sequence[int] = (8, 16, 32, 64, 128),
        activation: Callable[[], nn.Module] = nn.Tanh,
        convs_per_block: int = 2,
        upsampling: str = "nearest",
        dropout: float = 0.0,
    ):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels)):
            if not _is_positive_int(value):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        widths = tuple(widths)
        if not widths or not all(_is_positive_int(w) for w in widths):
            raise ValueError(
                f"widths must be a non-empty sequence of positive ints, got {widths!r}"
            )
        if not _is_positive_int(convs_per_block):
            raise ValueError(f"convs_per_block must be a positive int, got {convs_per_block!r}")
        if upsampling not in _UPSAMPLING:
            raise ValueError(f"upsampling must be one of {_UPSAMPLING}, got {upsampling!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout!r}")
        probe = activation()
        if not isinstance(probe, nn.Module):
            raise TypeError(
                f"activation() must return an nn.Module (e.g. pass nn.Tanh, not torch.tanh); "
                f"got {type(probe).__name__}"
            )

        self.in_channels, self.out_channels = in_channels, out_channels
        self.widths, self.upsampling = widths, upsampling

        self.encoders = nn.ModuleList()
        self.pools = nn.ModuleList()
        c_in = in_channels
        for level, width in enumerate(widths):
            if level > 0:
                self.pools.append(nn.MaxPool2d(2))
            self.encoders.append(_block(c_in, width, activation, convs_per_block, dropout))
            c_in = width

        # Decoder modules are stored from the bottleneck upwards, in the order forward uses them.
        self.ups = nn.ModuleList()
        self.decoders = nn.ModuleList()
        for level in range(len(widths) - 2, -1, -1):
            below, width = widths[level + 1], widths[level]
            if upsampling == "transposed":
                self.ups.append(nn.ConvTranspose2d(below, width, kernel_size=2, stride=2))
                cat_channels = 2 * width
            else:
                align = False if upsampling == "bilinear" else None
                self.ups.append(nn.Upsample(scale_factor=2, mode=upsampling, align_corners=align))
                cat_channels = below + width
            self.decoders.append(_block(cat_channels, width, activation, convs_per_block, dropout))

        self.head = nn.Conv2d(widths[0], out_channels, kernel_size=1)

    @property
    def divisor(self) -> int:
        """What ``H`` and ``W`` must be divisible by: ``2 ** (L - 1)``."""
        return 2 ** (len(self.widths) - 1)

    def forward(self, x: Tensor) -> Tensor:
        """Segment a batch of images.

        Args:
            x: Images ``[N, in_channels, H, W]``, ``H`` and ``W`` divisible by
                :attr:`divisor`.

        Returns:
            Logits ``[N, out_channels, H, W]``.

        Raises:
            TypeError: If ``x`` is not a tensor (a dictionary batch: with the
                :class:`~lsn_ext.SelectInput` remedy).
            ValueError: If ``x`` is not 4-D, has the wrong number of channels, or ``H``/``W``
                is not divisible by ``2 ** (L - 1)``.
        """
        # Under symbolic tracing (torch.fx, as BackPACK's converter does) x has no shape.
        if not isinstance(x, torch.fx.Proxy):
            self._check_input(x)

        skips: list[Tensor] = []
        for level, encoder in enumerate(self.encoders):
            if level > 0:
                x = self.pools[level - 1](x)
            x = encoder(x)
            skips.append(x)
        skips.pop()  # the bottleneck is not a skip
        for up, decoder in zip(self.ups, self.decoders, strict=True):
            x = decoder(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)

    def _check_input(self, x: object) -> None:
        """The input checks of :meth:`forward` (see its ``Raises``)."""
        if isinstance(x, Mapping):
            raise TypeError(
                f"UNet takes an image tensor [N, C, H, W], got a dictionary batch (keys "
                f"{sorted(map(str, x))}). Pass batch['image'], or wrap the network: "
                "lsn_ext.SelectInput(unet, 'image') takes batch['image'] (with Laplace(..., "
                "dict_key_x='image', dict_key_y='label') for MONAI's keys)"
            )
        if not isinstance(x, Tensor):
            raise TypeError(f"UNet takes an image tensor [N, C, H, W], got a {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"UNet expects images [N, C, H, W], got shape {tuple(x.shape)}")
        if x.shape[1] != self.in_channels:
            raise ValueError(
                f"UNet was built for {self.in_channels} input channels, got shape "
                f"{tuple(x.shape)} with {x.shape[1]}"
            )
        H, W = x.shape[-2:]
        if H % self.divisor or W % self.divisor:
            raise ValueError(
                f"UNet with {len(self.widths)} levels needs H and W divisible by "
                f"2**{len(self.widths) - 1} = {self.divisor}; got input shape {tuple(x.shape)} "
                "(pad or crop the images, or use fewer levels)"
            )

    def extra_repr(self) -> str:
        """The widths and the upsampling, shown in ``repr(model)``.

        Returns:
            ``"widths=…, upsampling=…"``.
        """
        return f"widths={self.widths}, upsampling={self.upsampling!r}"
