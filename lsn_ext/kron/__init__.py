"""Kronecker-factored (KFAC) GGN curvature over all weights, in laplace-torch's ``Kron`` format.

- :func:`kron_curvature` (:mod:`lsn_ext.kron.curvature`): one batch's ``(loss, Kron)`` as
  laplace-torch's ``CurvatureInterface.kron(x, y, N)`` returns it; KFAC-expand or -reduce for
  ``Linear``, ``Conv1–3d`` and ``ConvTranspose1–3d`` weights (:mod:`lsn_ext.kron.layers`), a
  block for every other parameter (:mod:`lsn_ext.kron.factors`).
- :func:`init_kron`, :class:`KronLaplaceND` (:mod:`lsn_ext.kron.adapter`): laplace-torch's
  ``KronLaplace`` for 3-D convolution weights, which its ``Kron.init_from_model`` refuses.
"""

from lsn_ext.kron.adapter import KronLaplaceND, init_kron
from lsn_ext.kron.curvature import KronResult, check_kron_options, kron_curvature
from lsn_ext.kron.layers import KFAC_TYPES

__all__ = [
    "KFAC_TYPES",
    "KronLaplaceND",
    "KronResult",
    "check_kron_options",
    "init_kron",
    "kron_curvature",
]
