"""The documented path of :func:`linearized_variance`, the forward counterpart of DB.

The function lives in :mod:`lsn_ext.engine.forward` (the engine package holds the backward and
the forward pass); ``from lsn_ext.forward import linearized_variance`` keeps working.
"""

from lsn_ext.engine.forward import linearized_variance

__all__ = ["linearized_variance"]
