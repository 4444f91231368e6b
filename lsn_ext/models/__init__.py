"""Ready-made networks: plain ``nn.Module`` classes, written as users write them."""

from lsn_ext.models.unet import UNet

__all__ = ["UNet"]
