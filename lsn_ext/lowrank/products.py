r"""Matrix-free products with the GGN of a network summed over a data set.

:class:`GGNOperator` applies

.. math::

    G v = \sum_{\text{batches}} J^\top H J v, \qquad
    J = \partial f(x; θ)/\partial θ \ [\text{outputs}, P], \quad
    H = \partial^2 \ell(f, y)/\partial f^2 \ [\text{outputs}, \text{outputs}],

without forming ``J`` or ``G``. Per batch, one forward pass with dual numbers
(:mod:`torch.autograd.forward_ad`, parameters ``θ + ε v`` through
:func:`~lsn_ext._functional.functional_call_all`) gives the logits ``f`` and ``J v`` together,
the loss Hessian is applied per output position (:func:`loss_hessian_product`: the loss's
``[N, C, C, *]`` block from :meth:`~lsn_ext.Loss.hessian_block`, or its diagonal), and one
backward pass of ``f`` with the cotangent ``H J v`` gives ``Jᵀ H J v``: 1.7 training steps per
batch in CPU time on the paper's U-Net at 64² (``integration/results/lowrank_cost.md``).
Operations without forward-mode AD switch the operator, with a warning, to the double-backward
product ``J v = ∂/∂u (Jᵀ u) · v`` (same result; 2.4 training steps there). Attention runs
through its math kernel, which both routes can differentiate.

The losses are summed over the data (laplace-torch's convention, :mod:`lsn_ext.rules.losses`), so
``G`` is the GGN of the summed log likelihood, the curvature a Laplace posterior adds to the prior
precision. Shape legend: ``P`` the number of trainable parameters (``requires_grad``, in
``named_parameters()`` order, shared tensors once), ``N`` the batch, ``C`` the output channels.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn

from lsn_ext._functional import functional_call_all
from lsn_ext.glm import differentiable_attention, forward_ad_unsupported
from lsn_ext.rules.losses import Loss

__all__ = ["GGNOperator", "loss_hessian_product"]

Batch = tuple[Tensor, Tensor]


def loss_hessian_product(loss: Loss, logits: Tensor, targets: Tensor, u: Tensor) -> Tensor:
    """``H u`` per output position, ``H = ∂²ℓ/∂f²`` of ``loss`` at ``logits``.

    Args:
        loss: A :class:`~lsn_ext.Loss` (summed or averaged, as it says).
        logits: ``[N, C, *]``.
        targets: As the loss takes them.
        u: ``[N, C, *]``.

    Returns:
        ``[N, C, *]``: ``Σ_k H[n, c, k, *] u[n, k, *]`` for a loss with a block
        (cross-entropy), ``diag(H) ⊙ u`` otherwise.
    """
    block = loss.hessian_block(logits, targets)
    if block is None:
        return loss.hessian_diag(logits, targets) * u
    return torch.einsum("nck...,nk...->nc...", block, u)


def check_eval_mode(model: nn.Module) -> None:
    """Refuse normalisation layers that would use the batch's statistics (training mode).

    Raises:
        ValueError: Naming the first such module.
    """
    stats = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
    for path, module in model.named_modules():
        if isinstance(module, stats) and module.training and module.track_running_stats:
            raise ValueError(
                f"the GGN products need the model in eval mode, but {path or '<root>'} "
                f"({type(module).__name__}) is in training mode: its output would depend on the "
                "other samples of the batch. Call model.eval() first"
            )


class GGNOperator:
    """``v ↦ Σ_batches Jᵀ H J v`` over a data set, matrix-free (module documentation).

    Args:
        model: The network (eval mode for normalisation layers with running statistics); run
            with substituted parameters, never modified.
        batches: Re-iterable batches (a ``DataLoader``, a list), each turned into
            ``(inputs, targets)`` by ``split``.
        loss: The likelihood's loss (:class:`~lsn_ext.Loss`), e.g. summed cross-entropy.
        split: ``batch -> (x, y)`` on the model's device; default: a ``(x, y)`` pair moved to
            the device of the model's first parameter.

    Attributes:
        names: The trainable parameters' names (``requires_grad``), in the order of ``v``.
        dim: ``P``, the length of ``v``.
        loss_value: The summed loss over the data at the model's parameters, from the last
            :meth:`matvec` (``None`` before the first).
        forward_mode: ``True`` while products use forward-mode AD (else double backward).

    Raises:
        ValueError: For a model without trainable parameters or in training mode
            (:func:`check_eval_mode`).
    """

    def __init__(
        self,
        model: nn.Module,
        batches: Iterable[Any],
        loss: Loss,
        split: Callable[[Any], Batch] | None = None,
    ):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                f"{type(model).__name__} has no trainable parameters (requires_grad=True): "
                "there is no GGN to take products with"
            )
        check_eval_mode(model)
        self.model, self.batches, self.loss = model, batches, loss
        self.names = [n for n, _ in named]
        self._shapes = [p.shape for _, p in named]
        self._sizes = [p.numel() for _, p in named]
        self._primals = [p.detach() for _, p in named]
        self.dim = sum(self._sizes)
        device = named[0][1].device
        self.device, self.dtype = device, named[0][1].dtype
        self.split = split or (lambda batch: (batch[0].to(device), batch[1].to(device)))
        self.loss_value: Tensor | None = None
        self.forward_mode = True

    def _pieces(self, v: Tensor) -> list[Tensor]:
        return [t.view(s) for t, s in zip(v.split(self._sizes), self._shapes, strict=True)]

    def _network(self, x: Tensor, tensors: list[Tensor]) -> Tensor:
        return functional_call_all(self.model, dict(zip(self.names, tensors, strict=True)), (x,))

    def _batch_forward_mode(self, x: Tensor, y: Tensor, v: list[Tensor]) -> tuple[Tensor, Tensor]:
        """``(Jᵀ H J v, loss)`` of one batch: dual-number forward, one backward."""
        leaves = [p.clone().requires_grad_(True) for p in self._primals]
        with torch.enable_grad():
            with fwAD.dual_level():
                duals = [fwAD.make_dual(p, t) for p, t in zip(leaves, v, strict=True)]
                out = fwAD.unpack_dual(self._network(x, duals))
                f = out.primal
                jv = torch.zeros_like(f) if out.tangent is None else out.tangent.detach()
            # Backward outside the dual level: no tangent reaches the backward formulas
            # (group norm's has no forward-mode rule of its own).
            hjv = loss_hessian_product(self.loss, f.detach(), y, jv)
            grads = torch.autograd.grad(f, leaves, hjv, allow_unused=True)
        return self._flat(grads), self.loss.value(f.detach(), y)

    def _batch_double_backward(
        self, x: Tensor, y: Tensor, v: list[Tensor]
    ) -> tuple[Tensor, Tensor]:
        """``(Jᵀ H J v, loss)`` of one batch by ``J v = ∂/∂u (Jᵀ u) · v``."""
        leaves = [p.clone().requires_grad_(True) for p in self._primals]
        with torch.enable_grad():
            f = self._network(x, leaves)
            u = torch.zeros_like(f, requires_grad=True)
            jtu = torch.autograd.grad(f, leaves, u, create_graph=True, allow_unused=True)
            used = [(g, t) for g, t in zip(jtu, v, strict=True) if g is not None]
            (jv,) = torch.autograd.grad(
                [g for g, _ in used], u, [t for _, t in used], retain_graph=True
            )
            hjv = loss_hessian_product(self.loss, f.detach(), y, jv.detach())
            grads = torch.autograd.grad(f, leaves, hjv, allow_unused=True)
        return self._flat(grads), self.loss.value(f.detach(), y)

    def _flat(self, grads: tuple[Tensor | None, ...]) -> Tensor:
        return torch.cat(
            [
                (torch.zeros(s, device=self.device, dtype=self.dtype) if g is None else g).reshape(
                    -1
                )
                for g, s in zip(grads, self._sizes, strict=True)
            ]
        )

    def matvec(self, v: Tensor) -> Tensor:
        """The exact GGN-vector product ``G v = Σ_batches Jᵀ H J v``; sets :attr:`loss_value`.

        One pass over the data: a forward-mode ``J v`` and a backward ``Jᵀ (H J v)`` per batch
        (double backward where forward-mode AD is unsupported, with a ``RuntimeWarning``).

        Args:
            v: ``[P]``, in the order of :attr:`names`.

        Returns:
            ``G v``, ``[P]``.

        Raises:
            ValueError: For a ``v`` of another shape, or no batches.
        """
        if v.shape != (self.dim,):
            raise ValueError(f"v must have shape ({self.dim},), got {tuple(v.shape)}")
        pieces = self._pieces(v.to(device=self.device, dtype=self.dtype))
        total = torch.zeros(self.dim, device=self.device, dtype=self.dtype)
        loss_value = None
        with differentiable_attention():
            for batch in self.batches:
                x, y = self.split(batch)
                if self.forward_mode:
                    try:
                        product, value = self._batch_forward_mode(x, y, pieces)
                    except (NotImplementedError, RuntimeError) as error:
                        if not forward_ad_unsupported(error):
                            raise
                        warnings.warn(
                            f"{type(self.model).__name__} has an operation without forward-mode "
                            f"AD ({str(error).splitlines()[0][:160]}); the GGN products fall "
                            "back to double backward (same result, about 1.4x the time)",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                        self.forward_mode = False
                if not self.forward_mode:
                    product, value = self._batch_double_backward(x, y, pieces)
                total += product
                loss_value = value.detach() if loss_value is None else loss_value + value.detach()
        if loss_value is None:
            raise ValueError("the data yield no batches: there is no GGN to take products with")
        self.loss_value = loss_value
        return total
