"""A wrapper for networks that return several outputs (deep supervision, auxiliary heads)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["SelectOutput"]


class SelectOutput(nn.Module):
    """``SelectOutput(model, key)(x) = model(x)[key]``: one tensor of logits from a network.

    Curvature estimators and laplace-torch need one tensor of logits ``[N, C, *]``. MONAI's
    ``BasicUNetPlusPlus`` returns a list even without deep supervision, nnU-Net's networks return
    one output per decoder stage with ``deep_supervision=True``, and some models return a dict.
    Wrap them::

        la = Laplace(lsn_ext.SelectOutput(net, 0), "classification", ...)

    The wrapper holds ``model`` as its submodule ``model`` (parameter names gain the prefix
    ``model.``) and changes nothing in it.

    Args:
        model: The network.
        key: Index (list or tuple output) or key (dict output) of the full-resolution logits;
            nnU-Net and MONAI put them first (``0``).
    """

    def __init__(self, model: nn.Module, key: int | str = 0):
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        """The entry ``key`` of ``model(*args, **kwargs)``."""
        out = self.model(*args, **kwargs)
        if isinstance(out, Tensor):
            raise TypeError(
                f"{type(self.model).__name__} returned one tensor: it needs no SelectOutput"
            )
        try:
            picked = out[self.key]
        except (IndexError, KeyError, TypeError):
            raise KeyError(
                f"{type(self.model).__name__} returned {type(out).__name__} without the entry "
                f"{self.key!r}"
            ) from None
        if not isinstance(picked, Tensor):
            raise TypeError(f"entry {self.key!r} of the output is {type(picked).__name__}")
        return picked

    def extra_repr(self) -> str:
        """``key=...`` in the module's repr."""
        return f"key={self.key!r}"
