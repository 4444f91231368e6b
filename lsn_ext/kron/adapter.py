"""laplace-torch's ``KronLaplace`` for every parameter shape, 3-D convolutions included.

laplace-torch 0.3's ``KronLaplace._init_H`` builds its zero curvature with
``Kron.init_from_model``, which raises ``ValueError("Invalid parameter shape in network.")`` for
parameters of more than 4 dims (the ``[C_out, C_in, k, k, k]`` weights of 3-D convolutions)
and for 0-D parameters. It runs in the constructor (``ParametricLaplace.__init__``), in every
``fit`` and in ``load_state_dict``, before any backend is asked, so no ``Kron`` from a backend
can avoid it. ``fit`` then adds the backend's ``Kron`` to that zero one factor by factor
(``Kron.__add__`` zips the factors), so the backend must return exactly its layout.

:func:`init_kron` is ``Kron.init_from_model`` for every shape: ``[zeros(P, P)]`` for a parameter
of at most 1 dim (``P`` entries; ``P = 1`` for a scalar), ``[zeros(R, R), zeros(D, D)]`` with
``R = p.shape[0]``, ``D = ∏ p.shape[1:]`` otherwise (a 5-D weight is seen as ``[R, D]``). For
1–4-D parameters it equals laplace-torch's. :class:`KronLaplaceND` is ``KronLaplace`` with it;
everything else (``KronDecomposed``, marginal likelihood, sampling, ``state_dict``) works on
the flattened factors unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from lsn_ext._laplace import laplace

__all__ = ["KronLaplaceND", "init_kron"]

Kron = laplace.utils.matrix.Kron


def init_kron(
    model: nn.Module | Iterable[Tensor], device: torch.device, dtype: torch.dtype
) -> Kron:
    """Zero ``Kron`` in the layout of :func:`~lsn_ext.kron.kron_curvature` (module docs).

    Args:
        model: The network, or its trainable parameters in ``model.parameters()`` order.
        device: Device of the factors.
        dtype: Dtype of the factors.

    Returns:
        laplace-torch's ``Kron``: ``[zeros(P, P)]`` per parameter of at most 1 dim,
        ``[zeros(R, R), zeros(D, D)]`` (``R = p.shape[0]``, ``D = ∏ p.shape[1:]``) otherwise.
    """
    params = model.parameters() if isinstance(model, nn.Module) else model
    kfacs = []
    for p in params:
        if p.dim() <= 1:
            P = p.numel()
            kfacs.append([torch.zeros(P, P, device=device, dtype=dtype)])
        else:
            R, D = p.shape[0], math.prod(p.shape[1:])
            kfacs.append(
                [
                    torch.zeros(R, R, device=device, dtype=dtype),
                    torch.zeros(D, D, device=device, dtype=dtype),
                ]
            )
    return Kron(kfacs)


class KronLaplaceND(laplace.baselaplace.KronLaplace):
    """laplace-torch's ``KronLaplace`` whose zero curvature takes parameters of any shape.

    Use it like ``KronLaplace`` (``KronLaplaceND(model, "classification", backend=...)``) with a
    backend whose ``kron`` returns :func:`~lsn_ext.kron.kron_curvature`'s layout.
    """

    # laplace.Laplace() maps the `_key` of every subclass to its class (in a set's order): a
    # key of its own keeps laplace-torch's ("all", "kron") on laplace-torch's KronLaplace.
    _key = ("all", "kron (lsn_ext, any parameter shape)")

    def _init_H(self) -> None:
        self.H = init_kron(self.params, self._device, self._dtype)
