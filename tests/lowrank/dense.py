"""Dense references of the low-rank tests: the GGN, the Jacobian and ``diag(J Σ Jᵀ)``.

Everything from ``torch.func.jacrev`` (the Jacobian w.r.t. all trainable parameters, in
``named_parameters()`` order) and ``torch.func.hessian`` (the loss Hessian w.r.t. the logits),
independently of :mod:`lsn_ext.lowrank`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from tests.reference import loss_hessian_dense


def jacobian(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(f [N, C, *], J [outputs, P])`` over the trainable parameters."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    f = functional_call(model, params, (x,))
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    return f, torch.cat([jac[n].reshape(f.numel(), -1) for n in params], 1)


def dense_ggn(model: nn.Module, batches, loss) -> Tensor:
    """``Σ_batches Jᵀ H J`` ``[P, P]``."""
    total = 0
    for x, y in batches:
        f, J = jacobian(model, x)
        H = loss_hessian_dense(lambda logits, y=y: loss.value(logits, y), f)
        total = total + J.T @ H @ J
    return total


def dense_precision(la) -> Tensor:
    """``U diag(λ) Uᵀ + diag(d)`` of a fitted LowRankGGNLaplace."""
    (U, lam), d = la.posterior_precision
    return (U * lam) @ U.T + torch.diag(d)


def logit_variance(model: nn.Module, x: Tensor, covariance: Tensor) -> Tensor:
    """``diag(J Σ Jᵀ)`` shaped like the logits."""
    f, J = jacobian(model, x)
    return ((J @ covariance) * J).sum(1).reshape(f.shape)
