r"""The top-``k`` eigenpairs of a network's GGN over a data set: :func:`lowrank_ggn`.

``G = Σ_batches Jᵀ H J`` (:class:`~lsn_ext.lowrank.products.GGNOperator`, matrix-free) is
reduced to ``U diag(λ) Uᵀ`` by Lanczos with full reorthogonalisation
(:func:`~lsn_ext.lowrank.lanczos.lanczos`, why Lanczos there). The rank is

- the user's ``rank`` (default), or
- with ``energy`` given, chosen by the spectrum: the smallest ``k ≤ rank`` whose eigenvalues sum
  to at least ``energy · tr G``, with ``tr G`` estimated by deflated Hutchinson
  (:func:`~lsn_ext.lowrank.lanczos.deflated_trace`, ``trace_probes`` extra products; its standard
  error is returned). Where even ``rank`` eigenvalues capture less, ``k = rank`` and
  :attr:`LowRankGGN.captured` says how much they capture. The rule measures shares of the
  GGN's trace, not how much each direction changes the posterior: one dominant eigenvalue makes
  it keep that one for any ``energy`` below its share, although the next eigenvalues may still
  exceed the prior precision. Compare the eigenvalues with the prior precision before trusting
  it.

Cost: ``steps`` GGN-vector products (default ``2·rank + 10``) plus ``trace_probes`` with
``energy``, each a pass over the data, and ``steps × P`` numbers for the Krylov basis. On the
paper's U-Net at 64² (one CPU thread) a product costs 1.7 training epochs of CPU time and a fit
of rank 5, 10, 20, 40 (with the diagonal remainder) 38, 58, 97, 170 epochs
(``integration/results/lowrank_cost.md``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lsn_ext.lowrank.lanczos import TraceEstimate, choose_rank, deflated_trace, lanczos, noise_floor
from lsn_ext.lowrank.products import Batch, GGNOperator
from lsn_ext.rules.losses import Loss

__all__ = ["LowRankGGN", "check_rank_options", "lowrank_ggn"]


@dataclass
class LowRankGGN:
    """``G ≈ U diag(λ) Uᵀ`` from :func:`lowrank_ggn`.

    Unpacks as laplace-torch's ``eig_lowrank`` result:
    ``eigenvectors, eigenvalues, loss = lowrank_ggn(...)``.

    Attributes:
        eigenvectors: ``U`` ``[P, k]``, orthonormal columns.
        eigenvalues: ``λ`` ``[k]``, descending, positive (Ritz values at the round-off level
            dropped).
        loss: The summed loss over the data, a scalar.
        residuals: ``‖G u_i − λ_i u_i‖`` ``[k]`` (Lanczos's own estimate, no extra products).
        steps: Lanczos steps taken (GGN-vector products, probes not counted).
        trace: The trace estimate where ``energy`` chose the rank, else ``None``.
        energy: The ``energy`` asked for, or ``None`` (fixed rank).
    """

    eigenvectors: Tensor
    eigenvalues: Tensor
    loss: Tensor
    residuals: Tensor
    steps: int
    trace: TraceEstimate | None = None
    energy: float | None = None

    def __iter__(self) -> Iterator[Tensor]:
        return iter((self.eigenvectors, self.eigenvalues, self.loss))

    @property
    def rank(self) -> int:
        """``k``."""
        return int(self.eigenvalues.numel())

    @property
    def captured(self) -> float | None:
        """``Σ λ / tr G`` with the estimated trace (``None`` without one)."""
        if self.trace is None or self.trace.value <= 0:
            return None
        return float(self.eigenvalues.sum()) / self.trace.value


def check_rank_options(
    rank: Any, energy: Any, steps: Any, trace_probes: Any, tol: Any, dim: int | None = None
) -> None:
    """Refuse bad ranks, energies, step counts, probe counts and tolerances (``ValueError``)."""

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(rank) or rank < 1:
        raise ValueError(f"rank must be an int ≥ 1, got {rank!r}")
    if dim is not None and rank > dim:
        raise ValueError(f"rank={rank} exceeds the number of trainable parameters ({dim})")
    if energy is not None and (
        isinstance(energy, bool) or not isinstance(energy, float | int) or not 0 < energy <= 1
    ):
        raise ValueError(f"energy must be None or a fraction in (0, 1], got {energy!r}")
    if steps is not None and (not is_int(steps) or steps < rank):
        raise ValueError(f"steps must be None or an int ≥ rank={rank}, got {steps!r}")
    if not is_int(trace_probes) or trace_probes < 0:
        raise ValueError(f"trace_probes must be an int ≥ 0, got {trace_probes!r}")
    if isinstance(tol, bool) or not isinstance(tol, float | int) or not tol > 0:
        raise ValueError(f"tol must be a positive number, got {tol!r}")


def lowrank_ggn(
    model: nn.Module,
    batches: Iterable[Any],
    loss: Loss,
    *,
    rank: int = 10,
    energy: float | None = None,
    steps: int | None = None,
    trace_probes: int = 10,
    tol: float = 1e-2,
    generator: torch.Generator | None = None,
    split: Callable[[Any], Batch] | None = None,
) -> LowRankGGN:
    """Top eigenpairs of the GGN ``Σ_batches Jᵀ H J`` of ``model`` over ``batches``.

    Args:
        model: The network, in eval mode; left unchanged.
        batches: Re-iterable batches (a ``DataLoader``): iterated once per product.
        loss: The loss summed over the data (:class:`~lsn_ext.Loss`).
        rank: The rank ``k`` (with ``energy``: the largest allowed).
        energy: ``None`` (default): ``k = rank``. A fraction in ``(0, 1]``: the smallest ``k``
            whose eigenvalues sum to ``energy · tr G`` (module documentation).
        steps: Lanczos steps (default ``min(P, 2·rank + 10)``).
        trace_probes: Hutchinson probes for ``tr G`` (only with ``energy``).
        tol: A pair whose residual exceeds ``tol · λ_max`` is reported in a
            ``RuntimeWarning`` (take more ``steps``).
        generator: For the Lanczos start vector and the probes (on the model's device).
        split: ``batch → (x, y)`` on the model's device (default: ``(x, y)`` pairs).

    Returns:
        :class:`LowRankGGN`; fewer than ``rank`` pairs where ``G`` has fewer eigenvalues above
        the round-off level (e.g. fewer outputs than ``rank`` in the data).

    Raises:
        ValueError: For bad options, a model in training mode, no batches, non-finite products,
            or a GGN without any eigenvalue above round-off (zero curvature).
    """
    operator = GGNOperator(model, batches, loss, split)
    P = operator.dim
    check_rank_options(rank, energy, steps, trace_probes, tol, P)
    steps = min(P, 2 * rank + 10) if steps is None else min(steps, P)
    result = lanczos(
        operator.matvec,
        P,
        steps,
        dtype=operator.dtype,
        device=operator.device,
        generator=generator,
    )
    value = operator.loss_value
    theta = result.eigenvalues
    floor = noise_floor(operator.dtype) * max(float(theta[0]), 0.0)
    keep = int((theta > floor).sum()) if float(theta[0]) > 0 else 0
    if keep == 0:
        raise ValueError(
            "the GGN has no eigenvalue above round-off along a random start vector: the loss "
            "has zero curvature at these parameters (e.g. all-ignored targets, or outputs that "
            "do not depend on the trainable parameters)"
        )
    k = min(rank, keep)
    trace = None
    if energy is not None:
        trace = deflated_trace(operator.matvec, result, trace_probes, generator)
        k = min(k, choose_rank(theta[:keep], trace.value, float(energy)))
    residuals = result.residuals[:k]
    loose = int((residuals > tol * theta[0]).sum())
    if loose:
        warnings.warn(
            f"{loose} of the top {k} GGN eigenpairs have Lanczos residuals above "
            f"tol={tol:g} × λ_max after {result.steps} steps (largest "
            f"{float(residuals.max() / theta[0]):.2g} λ_max): they are approximate. Pass more "
            f"steps (steps={2 * result.steps}) for converged pairs",
            RuntimeWarning,
            stacklevel=2,
        )
    return LowRankGGN(
        result.eigenvectors[:, :k].contiguous(),
        theta[:k].contiguous(),
        value,
        residuals,
        result.steps,
        trace,
        None if energy is None else float(energy),
    )
