r"""The per-position GLM predictive of a last-layer Laplace approximation, in closed form.

The logits are linear in the head's parameters (:mod:`lsn_ext.laplace_ext.head`), so under the
posterior ``θ ~ N(θ*, Σ)`` they are exactly Gaussian: per sample ``n`` and position ``p``

.. math:: f_{n,:,p} \sim \mathcal N\big(W^* \tilde\phi_{n,p},\ \Sigma^f_{n,p}\big), \qquad
          \Sigma^f_{n,p}[c, c'] = \tilde\phi_{n,p}^\top\, \Sigma_{(c,\cdot),(c',\cdot)}\,
          \tilde\phi_{n,p}

(the GLM predictive equals the network's own: nothing to linearise). :func:`head_logit_moments`
computes the mean and ``Σ^f`` (or its diagonal) for each structure, memory linear in the
positions (chunks of at most 2²⁴ numbers):

- full (``FullLaplace``): ``Σ`` from ``la.posterior_covariance``, in canonical order;
- diagonal (``DiagLaplace``): ``Σ^f[c, c] = Σ_d φ̃_d² σ²_{c,d}``, off-diagonal zero;
- Kronecker (``KronLaplace``, ``KronDecomposed`` with eigenvectors ``U₁, U₂``, eigenvalues
  ``l₁, l₂`` and prior ``δ``): with ``s_ij = 1/(l₁ᵢ l₂ⱼ + δ)`` (damped:
  ``1/((l₁ᵢ+√δ)(l₂ⱼ+√δ))``), a ``Linear``/``Conv`` weight ``[C, D]`` gives
  ``Σ^f[c, c'] = Σ_i U₁[c,i] U₁[c',i] Σ_j s_ij (U₂ᵀφ)_j²``; a transposed convolution (weight
  ``[C_in, C, K]``) ``Σ_ij s_ij a_ij(c) a_ij(c')`` with
  ``a_ij(c) = Σ_{r,k} U₁[r,i] U₂[(c,k),j] φ[(r,k)]``; the bias block adds
  ``U_b diag(1/(l_b + δ_b)) U_bᵀ`` at every position.

:func:`head_logit_draws` draws the logits at posterior samples of the head: one forward pass of
the network, then ``W_s φ̃`` per draw.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lsn_ext._laplace import laplace
from lsn_ext.glm import sample_chunks
from lsn_ext.laplace_ext.head import TRANSPOSED_HEADS, HeadBatch, capture_head, head_permutation

__all__ = ["head_logit_draws", "head_logit_moments", "is_last_layer"]

CHUNK = 1 << 24
_baselaplace = laplace.baselaplace
_LLLaplace = laplace.lllaplace.LLLaplace


def is_last_layer(la: Any) -> bool:
    """Whether ``la`` is a laplace-torch last-layer posterior (laplace-torch's or lsn_ext's)."""
    return isinstance(la, _LLLaplace)


def _capture(la: Any, x: Any) -> tuple[nn.Module, HeadBatch, Tensor]:
    """The head, the batch seen through it and the canonical permutation."""
    extractor = la.model
    head = extractor.last_layer
    if head is None:
        raise ValueError("the Laplace object is not fitted yet: call la.fit(train_loader) first")
    name = getattr(extractor, "_last_layer_name", "head")
    with torch.no_grad():
        batch = capture_head(extractor.model, head, x, name)
    return head, batch, head_permutation(head)


def _mean_logits(batch: HeadBatch, theta: Tensor) -> Tensor:
    """``W φ̃`` for canonical parameters ``theta [..., C, D̃]``: ``[..., N, C, *]``."""
    f = torch.einsum("...cd,ndp->...ncp", theta, batch.features)
    return f.reshape(*theta.shape[:-2], *batch.logits.shape)


def _chunks(M: int, per_row: int) -> Iterator[slice]:
    step = max(1, CHUNK // max(per_row, 1))
    for s in range(0, M, step):
        yield slice(s, s + step)


def _full_moments(Sigma: Tensor, rows: Tensor, C: int, covariance: bool) -> Tensor:
    """``Σ^f`` per row from a canonical covariance ``[C, D̃, C, D̃]``: ``[M, C, C]`` or ``[M, C]``."""
    Dt = rows.shape[1]
    if not covariance:
        blocks = Sigma[torch.arange(C), :, torch.arange(C), :]  # [C, D̃, D̃]
        out = rows.new_empty(rows.shape[0], C)
        for s in _chunks(rows.shape[0], C * Dt):
            r = rows[s]
            out[s] = torch.einsum("md,cde,me->mc", r, blocks, r)
        return out
    out = rows.new_empty(rows.shape[0], C, C)
    for s in _chunks(rows.shape[0], C * C * Dt):
        r = rows[s]
        out[s] = torch.einsum("md,cdCe,me->mcC", r, Sigma, r)
    return out


def _inverse_eigenvalues(ls: list[Tensor], delta: Tensor, damping: bool) -> Tensor:
    """``s = 1/(l₁ ⊗ l₂ + δ)`` (damped ``1/((l₁+√δ)(l₂+√δ))``), or ``1/(l + δ)``."""
    if len(ls) == 1:
        return 1 / (ls[0] + delta)
    l1, l2 = ls
    if damping:
        return 1 / torch.outer(l1 + delta.sqrt(), l2 + delta.sqrt())
    return 1 / (torch.outer(l1, l2) + delta)


def _kron_moments(
    la: Any, head: nn.Module, rows: Tensor, has_bias: bool, C: int, covariance: bool
) -> Tensor:
    """``Σ^f`` per row from ``la.posterior_precision`` (``KronDecomposed``)."""
    P = la.posterior_precision
    names = [n for n, _ in head.named_parameters()]
    blocks = dict(
        zip(names, zip(P.eigenvectors, P.eigenvalues, P.deltas, strict=True), strict=False)
    )
    (U1, U2), ls, delta = blocks["weight"]
    s = _inverse_eigenvalues(ls, delta, P.damping)
    D = rows.shape[1] - int(has_bias)
    phi = rows[:, :D]
    M = rows.shape[0]
    out = rows.new_zeros(M, C, C) if covariance else rows.new_zeros(M, C)
    if isinstance(head, TRANSPOSED_HEADS):
        c_in, taps = U1.shape[0], U2.shape[0] // C
        U2 = U2.reshape(C, taps, -1)  # [C, K, J]
        for sl in _chunks(M, c_in * C * taps * C):
            t = torch.einsum("mrk,ri->mik", phi[sl].reshape(-1, c_in, taps), U1)
            a = torch.einsum("mik,ckj->mijc", t, U2)
            eq = "mijc,ij,mijC->mcC" if covariance else "mijc,ij,mijc->mc"
            out[sl] = torch.einsum(eq, a, s, a)
    else:
        for sl in _chunks(M, D + C):
            t = (phi[sl] @ U2).square() @ s.T  # [m, C(i)]
            eq = "ci,Ci,mi->mcC" if covariance else "ci,ci,mi->mc"
            out[sl] = torch.einsum(eq, U1, U1, t)
    if has_bias:
        (Ub,), lb, db = blocks["bias"]
        bias_cov = (Ub * _inverse_eigenvalues(lb, db, P.damping)) @ Ub.T
        out += bias_cov if covariance else bias_cov.diagonal()
    return out


def head_logit_moments(la: Any, x: Any, covariance: bool = False) -> tuple[Tensor, Tensor]:
    """Mean and (co)variance of the logits of a last-layer posterior, exactly.

    Args:
        la: A fitted last-layer laplace-torch posterior (``FullLLLaplace``, ``KronLLLaplace``,
            ``DiagLLLaplace`` or lsn_ext's :mod:`~lsn_ext.laplace_ext.last_layer` classes).
        x: Inputs of the network.
        covariance: ``True``: the per-position covariance over the channels ``[N, C, C, *]``;
            ``False``: its diagonal ``[N, C, *]``.

    Returns:
        ``(f_mean [N, C, *], f_var)``: the logits at ``la.mean`` and their (co)variance.

    Raises:
        TypeError: For a posterior structure other than full, diagonal and Kronecker.
    """
    head, batch, perm = _capture(la, x)
    C = batch.classes
    Dt = batch.features.shape[1]
    theta = la.mean.detach()[perm].reshape(C, Dt)
    f_mean = _mean_logits(batch, theta)
    rows = batch.features.transpose(1, 2).reshape(-1, Dt)
    with torch.no_grad():
        if isinstance(la, _baselaplace.FullLaplace):
            Sigma = la.posterior_covariance.detach()[perm][:, perm].reshape(C, Dt, C, Dt)
            second = _full_moments(Sigma, rows, C, covariance)
        elif isinstance(la, _baselaplace.DiagLaplace):
            var = la.posterior_variance.detach()[perm].reshape(C, Dt)
            second = rows.square() @ var.T
            if covariance:
                second = torch.diag_embed(second)
        elif isinstance(la, _baselaplace.KronLaplace):
            second = _kron_moments(la, head, rows, batch.has_bias, C, covariance)
        else:
            raise TypeError(
                f"no closed-form predictive for {type(la).__name__}: last-layer posteriors "
                "with a full, diagonal or Kronecker-factored covariance only"
            )
    N, spatial = batch.logits.shape[0], batch.logits.shape[2:]
    if covariance:
        second = second.reshape(N, -1, C, C).permute(0, 2, 3, 1).reshape(N, C, C, *spatial)
    else:
        second = second.reshape(N, -1, C).transpose(1, 2).reshape(N, C, *spatial)
    return f_mean, second


def head_logit_draws(
    la: Any, x: Any, n: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Iterator[Tensor]]:
    """The logits at ``la.mean`` and at ``n`` posterior draws of the head, ``[N, C, *]`` each.

    One forward pass of the network; each draw ``θ_s`` (``la.sample`` in chunks,
    :func:`lsn_ext.glm.sample_chunks`) costs ``W_s φ̃``.
    """
    _head, batch, perm = _capture(la, x)
    C, Dt = batch.classes, batch.features.shape[1]
    f_mean = _mean_logits(batch, la.mean.detach()[perm].reshape(C, Dt))

    def draws() -> Iterator[Tensor]:
        for chunk in sample_chunks(la.sample, n, la.n_params, generator):
            yield from _mean_logits(batch, chunk.detach()[:, perm].reshape(-1, C, Dt))

    return f_mean, draws()
