"""Low-rank (plus diagonal) Laplace posteriors from matrix-free GGN-vector products.

- :class:`GGNOperator` (:mod:`lsn_ext.lowrank.products`): ``v ↦ Σ_batches Jᵀ H J v`` for any
  network, one dual-number forward and one backward pass per batch;
- :func:`lanczos`, :func:`deflated_trace`, :func:`choose_rank` (:mod:`lsn_ext.lowrank.lanczos`):
  top eigenpairs with full reorthogonalisation, the trace, the rank rule;
- :func:`lowrank_ggn` (:mod:`lsn_ext.lowrank.curvature`): the top-``k`` GGN eigenpairs over a
  data set, what :meth:`lsn_ext.DiagBackprop.eig_lowrank` returns;
- :class:`LowRankPlusDiagonal` (:mod:`lsn_ext.lowrank.posterior`): ``U Λ Uᵀ + D`` precisions
  (Woodbury covariance, log-determinant, variances);
- :class:`LowRankGGNLaplace` (:mod:`lsn_ext.lowrank.laplace_class`): laplace-torch's
  ``LowRankLaplace`` without ASDL, over the whole loader, with the GGN diagonal's remainder.
"""

from lsn_ext.lowrank.curvature import LowRankGGN, lowrank_ggn
from lsn_ext.lowrank.lanczos import (
    LanczosResult,
    TraceEstimate,
    choose_rank,
    deflated_trace,
    lanczos,
)
from lsn_ext.lowrank.laplace_class import LowRankGGNLaplace
from lsn_ext.lowrank.posterior import LowRankPlusDiagonal
from lsn_ext.lowrank.products import GGNOperator, loss_hessian_product

__all__ = [
    "GGNOperator",
    "LanczosResult",
    "LowRankGGN",
    "LowRankGGNLaplace",
    "LowRankPlusDiagonal",
    "TraceEstimate",
    "choose_rank",
    "deflated_trace",
    "lanczos",
    "loss_hessian_product",
    "lowrank_ggn",
]
