"""Wrappers for several outputs (deep supervision) and for dictionary batches (MONAI)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["SelectInput", "SelectOutput", "plain_tensor"]


def plain_tensor(x: Any) -> Any:
    """``x`` as a plain ``torch.Tensor`` if it is a tensor subclass (MONAI's ``MetaTensor``).

    ``MetaTensor`` carries an affine and metadata through every operation by
    ``__torch_function__``; the curvature engines and predictives need only the values (and run
    faster without the metadata), so they take a plain view of the same storage. Other objects
    are returned unchanged.
    """
    if isinstance(x, Tensor) and type(x) is not Tensor and not isinstance(x, nn.Parameter):
        return x.as_subclass(torch.Tensor)
    return x


class SelectInput(nn.Module):
    """``SelectInput(model, key)(batch) = model(batch[key])``; a tensor passes straight through.

    MONAI pipelines yield dictionary batches (``{"image": [N, C, *spatial], "label":
    [N, 1, *spatial], ...}``, often ``MetaTensor``). laplace-torch's ``fit`` takes them with
    ``Laplace(..., dict_key_x=..., dict_key_y=...)`` but calls the model on the whole dictionary
    of the first batch, which a MONAI network does not accept. Wrap it::

        la = Laplace(lsn_ext.SelectInput(net, "image"), "classification",
                     subset_of_weights="all", hessian_structure="diag",
                     backend=lsn_ext.DiagBackprop, dict_key_x="image", dict_key_y="label")
        la.fit(monai_loader)

    :class:`~lsn_ext.DiagBackprop` then runs the curvature on the tensor ``batch[key]``, and
    :func:`~lsn_ext.predict` takes either the tensor or the dictionary. ``MetaTensor`` inputs
    are passed on as plain tensors (:func:`plain_tensor`). The wrapper holds ``model`` as its
    submodule ``model`` (parameter names gain the prefix ``model.``) and changes nothing in it.

    Args:
        model: The network, taking one tensor ``[N, C, *spatial]``.
        key: The key of the images in the batches (MONAI's convention: ``"image"``).

    Raises:
        TypeError: If ``model`` is not an ``nn.Module``.
    """

    def __init__(self, model: nn.Module, key: str = "image"):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"SelectInput wraps an nn.Module, got {type(model).__name__}")
        self.model = model
        self.key = key

    def forward(self, x: Tensor | Mapping[str, Any]) -> Any:
        """``model(x[key])`` for a dictionary, ``model(x)`` for a tensor.

        Args:
            x: Images ``[N, C, *spatial]`` (a ``MetaTensor`` is passed on as a plain tensor), or
                a dictionary batch holding them under ``key``.

        Returns:
            What ``model`` returns, e.g. logits ``[N, K, *spatial]``.

        Raises:
            KeyError: If a dictionary batch has no entry ``key``.
        """
        if isinstance(x, Mapping):
            if self.key not in x:
                raise KeyError(
                    f"the batch has no key {self.key!r} (keys: {sorted(map(str, x))}); give "
                    "SelectInput the key of the images"
                )
            x = x[self.key]
        return self.model(plain_tensor(x))

    def extra_repr(self) -> str:
        """The key, shown in ``repr(model)``.

        Returns:
            ``"key=…"``.
        """
        return f"key={self.key!r}"


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
        """The entry ``key`` of ``model(*args, **kwargs)``.

        Args:
            *args: Passed to ``model``.
            **kwargs: Passed to ``model``.

        Returns:
            The selected logits, e.g. ``[N, K, *spatial]``.

        Raises:
            TypeError: If ``model`` returns a single tensor (no wrapper needed) or the entry
                is not a tensor.
            KeyError: If the output has no entry ``key``.
        """
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
        """``key=...`` in the module's repr.

        Returns:
            ``"key=…"``.
        """
        return f"key={self.key!r}"
