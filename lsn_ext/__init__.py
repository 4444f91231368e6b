"""lsn_ext: Laplace approximations for segmentation networks.

Diagonal backpropagation (a GGN diagonal in one backward pass) over ordinary U-Nets, one rule table
shared by adapters for laplace-torch, BackPACK and StochMan, and Laplacian Segmentation Networks.
"""

import importlib
from types import ModuleType

from lsn_ext import rules, stochman_ext, vi
from lsn_ext.bridge import (
    BridgeDirichlet,
    LaplaceBridge,
    TopK,
    bridge_predictive,
    dirichlet_to_gaussian,
    laplace_bridge,
)
from lsn_ext.engine import DiagBackpropResult, diag_backprop
from lsn_ext.estimators import ESTIMATORS, ggn_diagonal
from lsn_ext.forward import linearized_variance
from lsn_ext.laplace_ext import (
    DiagBackprop,
    SegmentationPrediction,
    gridsearch_prior_precision,
    predict,
)
from lsn_ext.outputs import SelectOutput
from lsn_ext.rules import get_rule, register_rule, supported_modules
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy, Loss
from lsn_ext.vi import GaussianMixture, StructuredGaussian, VariationalPosterior

__version__ = "0.1.0.dev0"

__all__ = [
    "ESTIMATORS",
    "MSE",
    "BCEWithLogits",
    "BridgeDirichlet",
    "CrossEntropy",
    "DiagBackprop",
    "DiagBackpropResult",
    "GaussianMixture",
    "LaplaceBridge",
    "Loss",
    "SegmentationPrediction",
    "SelectOutput",
    "StructuredGaussian",
    "TopK",
    "VariationalPosterior",
    "__version__",
    "backpack_ext",
    "bridge_predictive",
    "diag_backprop",
    "dirichlet_to_gaussian",
    "get_rule",
    "ggn_diagonal",
    "gridsearch_prior_precision",
    "laplace_bridge",
    "linearized_variance",
    "predict",
    "register_rule",
    "rules",
    "stochman_ext",
    "supported_modules",
    "vi",
]

_ADAPTERS = ("backpack_ext",)


def __getattr__(name: str) -> ModuleType:
    """Import the adapters on first use (``lsn_ext.backpack_ext`` pulls in BackPACK and fx)."""
    if name in _ADAPTERS:
        return importlib.import_module(f"lsn_ext.{name}")
    raise AttributeError(f"module 'lsn_ext' has no attribute {name!r}")
