"""laplace-torch, imported with one upstream deprecation warning silenced.

laplace-torch 0.3 imports ``asdl`` (for its ASDL backends), whose ``asdl.precondition.psgd``
calls ``torch.jit.script`` at import time; torch 2.13 deprecates that with a
``DeprecationWarning``, so ``python -W error`` could not import lsn_ext's laplace-torch parts.
The warning is about asdl, not about anything a user of lsn_ext does: it is ignored for this one
import only, by its exact message and category. Every lsn_ext module that needs laplace-torch
imports it from here.
"""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning
    )
    import laplace
    from laplace import baselaplace
    from laplace.baselaplace import BaseLaplace
    from laplace.curvature import CurvatureInterface, GGNInterface
    from laplace.utils.utils import fix_prior_prec_structure

Laplace = laplace.Laplace

__all__ = [
    "BaseLaplace",
    "CurvatureInterface",
    "GGNInterface",
    "Laplace",
    "baselaplace",
    "fix_prior_prec_structure",
]
