"""Ready-made networks: plain ``nn.Module`` classes, written as users write them."""

from lsn_ext.models.ssn import SSN, SSNOutput, ssn_loss
from lsn_ext.models.unet import UNet

__all__ = ["SSN", "SSNOutput", "UNet", "ssn_loss"]
