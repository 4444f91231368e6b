"""Real segmentation networks from MONAI and nnU-Net, in small configurations, as test cases.

Each case builds a network with its library's defaults (normalisation, activations, in-place
flags, upsampling) and only the sizes shrunk, so that the dense references stay affordable:
2-D inputs of 16²–32² and one 3-D input of 16³. Random initialisation, evaluation mode.

The libraries are optional test dependencies: a case whose library does not import is skipped
with the reason (``segmentation_models_pytorch`` needs torchvision, whose PyPI wheel does not
load beside a CPU build of torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lsn_ext import SelectOutput
from lsn_ext.models import UNet


@dataclass(frozen=True)
class RealNetwork:
    """A network case: ``build()`` returns the model, inputs are ``[N, *in_shape]``.

    Attributes:
        library: The import name of the library that provides the network.
        build: Builds the network (random init, evaluation mode).
        in_shape: ``(C_in, *spatial)`` of one input.
        classes: Output channels (1: binary with BCE, else cross-entropy).
        batch_size: Images in the batch of the curvature tests (1 for the 32² networks, whose
            exact diagonal costs most).
    """

    library: str
    build: Callable[[], nn.Module]
    in_shape: tuple[int, ...]
    classes: int
    batch_size: int = 2

    @property
    def loss(self) -> str:
        return "bce" if self.classes == 1 else "ce"

    def available(self) -> str | None:
        """``None`` if the library imports, else the reason it does not."""
        try:
            importlib.import_module(self.library)
        except Exception as err:
            return f"{self.library} does not import here: {type(err).__name__}: {err}"
        return None

    def batch(self, n: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` (default ``batch_size``) inputs and targets (class indices, or a {0, 1} mask
        ``[N, 1, *]`` for BCE).
        """
        n = self.batch_size if n is None else n
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, *self.in_shape, generator=gen)
        spatial = self.in_shape[1:]
        if self.classes == 1:
            y = (torch.rand(n, 1, *spatial, generator=gen) > 0.7).to(x.dtype)
        else:
            y = torch.randint(0, self.classes, (n, *spatial), generator=gen)
        return x, y


def _monai(name: str, select: int | None = None, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from monai.networks import nets

        net = getattr(nets, name)(**kwargs).eval()
        return net if select is None else SelectOutput(net, select).eval()

    return build


def _nnunet(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from dynamic_network_architectures.architectures import unet

        # nnU-Net v2's defaults for 2-D data: InstanceNorm2d(affine, eps 1e-5), LeakyReLU(0.01,
        # inplace), no conv bias, strided-convolution downsampling, transposed-conv upsampling.
        defaults = {
            "input_channels": 1,
            "conv_op": nn.Conv2d,
            "kernel_sizes": 3,
            "conv_bias": True,
            "norm_op": nn.InstanceNorm2d,
            "norm_op_kwargs": {"eps": 1e-5, "affine": True},
            "nonlin": nn.LeakyReLU,
            "nonlin_kwargs": {"inplace": True},
        }
        return getattr(unet, name)(**{**defaults, **kwargs}).eval()

    return build


def _smp(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import segmentation_models_pytorch as smp

        return getattr(smp, name)(encoder_weights=None, **kwargs).eval()

    return build


REAL_NETWORKS: dict[str, RealNetwork] = {
    "monai-basicunet-2d": RealNetwork(
        "monai",
        _monai("BasicUNet", spatial_dims=2, in_channels=1, out_channels=2,
               features=(4, 4, 8, 8, 16, 4)),
        (1, 32, 32), 2, batch_size=1,
    ),
    "monai-basicunetplusplus-2d": RealNetwork(
        "monai",
        _monai("BasicUNetPlusPlus", select=0, spatial_dims=2, in_channels=1, out_channels=1,
               features=(4, 4, 8, 8, 8, 4)),
        (1, 32, 32), 1, batch_size=1,
    ),
    "monai-unet-2d": RealNetwork(
        "monai",
        _monai("UNet", spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16),
               strides=(2, 2)),
        (1, 16, 16), 2,
    ),
    # Residual units end in conv(x) + x: binary here, because cross-entropy's exact first step
    # needs the logits to come from convolutions only (the error says what to do instead).
    "monai-unet-2d-residual": RealNetwork(
        "monai",
        _monai("UNet", spatial_dims=2, in_channels=1, out_channels=1, channels=(4, 8, 16),
               strides=(2, 2), num_res_units=2),
        (1, 16, 16), 1,
    ),
    "monai-attentionunet-2d": RealNetwork(
        "monai",
        _monai("AttentionUnet", spatial_dims=2, in_channels=1, out_channels=1,
               channels=(4, 8, 16), strides=(2, 2)),
        (1, 16, 16), 1,
    ),
    "monai-dynunet-2d": RealNetwork(
        "monai",
        _monai("DynUNet", spatial_dims=2, in_channels=1, out_channels=2,
               kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
               filters=[4, 8, 16], res_block=True),
        (1, 16, 16), 2,
    ),
    "monai-segresnet-2d": RealNetwork(
        "monai",
        _monai("SegResNet", spatial_dims=2, init_filters=4, in_channels=1, out_channels=2,
               blocks_down=(1, 1, 1), blocks_up=(1, 1), norm=("GROUP", {"num_groups": 2})),
        (1, 16, 16), 2,
    ),
    "monai-unet-3d": RealNetwork(
        "monai",
        _monai("UNet", spatial_dims=3, in_channels=1, out_channels=1, channels=(2, 4, 8),
               strides=(2, 2)),
        (1, 8, 8, 8), 1,
    ),
    "nnunet-plainconvunet-2d": RealNetwork(
        "dynamic_network_architectures",
        _nnunet("PlainConvUNet", n_stages=3, features_per_stage=(4, 8, 16), strides=(1, 2, 2),
                n_conv_per_stage=2, num_classes=2, n_conv_per_stage_decoder=1),
        (1, 16, 16), 2,
    ),
    "nnunet-residualencoderunet-2d": RealNetwork(
        "dynamic_network_architectures",
        _nnunet("ResidualEncoderUNet", n_stages=3, features_per_stage=(4, 8, 16),
                strides=(1, 2, 2), n_blocks_per_stage=(1, 1, 2), num_classes=1,
                n_conv_per_stage_decoder=1),
        (1, 16, 16), 1,
    ),
    "lsn-paper-unet": RealNetwork(
        "lsn_ext", lambda: UNet(1, 1, widths=(4, 8, 16)).eval(), (1, 16, 16), 1
    ),
    "smp-unet-resnet18": RealNetwork(
        "segmentation_models_pytorch",
        _smp("Unet", encoder_name="resnet18", in_channels=1, classes=2, encoder_depth=3,
             decoder_channels=(16, 8, 4)),
        (1, 32, 32), 2,
    ),
}  # fmt: skip
