"""lsn_ext: Laplace approximations for segmentation networks.

Diagonal backpropagation (a GGN diagonal in one backward pass) over ordinary U-Nets, one rule table
shared by adapters for laplace-torch, BackPACK and StochMan, and Laplacian Segmentation Networks.

``import lsn_ext`` is cheap: it imports neither torch nor laplace-torch, BackPACK or StochMan, so
``lsn-ext --help`` answers at once. Every public name below is imported from its submodule on first
access (``lsn_ext.DiagBackprop``, ``from lsn_ext import DiagBackprop``), through the module-level
:func:`__getattr__` of PEP 562. The first such access also imports :mod:`lsn_ext.stochman_ext`,
which registers StochMan's ``nnj`` layers in the rule table, so that, as before, any use of the
package's names accepts ``nnj`` models. Any other submodule is imported on first access too
(``lsn_ext.metrics``); importing one directly (``import lsn_ext.engine``) loads just that submodule
and what it imports.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what static tools and IDEs see; at run time __getattr__ provides the names
    from lsn_ext import backpack_ext, rules, stochman_ext, vi
    from lsn_ext.bridge import (
        BridgeDirichlet,
        LaplaceBridge,
        TopK,
        dirichlet_to_gaussian,
        laplace_bridge,
    )
    from lsn_ext.engine import DiagBackpropResult, diag_backprop
    from lsn_ext.estimators import ESTIMATORS, ggn_diagonal
    from lsn_ext.forward import linearized_variance
    from lsn_ext.laplace_ext import (
        DiagBackprop,
        GridSearchResult,
        Laplace,
        SegmentationPrediction,
        bridge_predictive,
        gridsearch_prior_precision,
        predict,
    )
    from lsn_ext.outputs import SelectInput, SelectOutput
    from lsn_ext.rules import get_rule, register_rule, supported_modules
    from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy, Loss
    from lsn_ext.rules.ssn_likelihood import ExpectedBCE, LogsumexpBCE
    from lsn_ext.sliding import SlidingWindow
    from lsn_ext.vi import GaussianMixture, StructuredGaussian, VariationalPosterior

__version__ = "0.1.0"

# Public name -> the module that defines it (a submodule maps to itself). Adding a public name is
# one line here, one in __all__ and one in the TYPE_CHECKING block above;
# tests/test_packaging.py checks that the three agree.
_LAZY: dict[str, str] = {
    # submodules
    "backpack_ext": "lsn_ext.backpack_ext",
    "rules": "lsn_ext.rules",
    "stochman_ext": "lsn_ext.stochman_ext",
    "vi": "lsn_ext.vi",
    # lsn_ext.bridge (scipy)
    "BridgeDirichlet": "lsn_ext.bridge",
    "LaplaceBridge": "lsn_ext.bridge",
    "TopK": "lsn_ext.bridge",
    "dirichlet_to_gaussian": "lsn_ext.bridge",
    "laplace_bridge": "lsn_ext.bridge",
    # the native engine and estimators (torch)
    "DiagBackpropResult": "lsn_ext.engine",
    "diag_backprop": "lsn_ext.engine",
    "ESTIMATORS": "lsn_ext.estimators",
    "ggn_diagonal": "lsn_ext.estimators",
    "linearized_variance": "lsn_ext.forward",
    # lsn_ext.laplace_ext (laplace-torch)
    "DiagBackprop": "lsn_ext.laplace_ext",
    "GridSearchResult": "lsn_ext.laplace_ext",
    "Laplace": "lsn_ext.laplace_ext",
    "SegmentationPrediction": "lsn_ext.laplace_ext",
    "bridge_predictive": "lsn_ext.laplace_ext",
    "gridsearch_prior_precision": "lsn_ext.laplace_ext",
    "predict": "lsn_ext.laplace_ext",
    # rules and losses
    "SelectInput": "lsn_ext.outputs",
    "SelectOutput": "lsn_ext.outputs",
    "SlidingWindow": "lsn_ext.sliding",
    "get_rule": "lsn_ext.rules",
    "register_rule": "lsn_ext.rules",
    "supported_modules": "lsn_ext.rules",
    "MSE": "lsn_ext.rules.losses",
    "BCEWithLogits": "lsn_ext.rules.losses",
    "CrossEntropy": "lsn_ext.rules.losses",
    "Loss": "lsn_ext.rules.losses",
    "ExpectedBCE": "lsn_ext.rules.ssn_likelihood",
    "LogsumexpBCE": "lsn_ext.rules.ssn_likelihood",
    # variational baselines
    "GaussianMixture": "lsn_ext.vi",
    "StructuredGaussian": "lsn_ext.vi",
    "VariationalPosterior": "lsn_ext.vi",
}

__all__ = [
    "ESTIMATORS",
    "MSE",
    "BCEWithLogits",
    "BridgeDirichlet",
    "CrossEntropy",
    "DiagBackprop",
    "DiagBackpropResult",
    "ExpectedBCE",
    "GaussianMixture",
    "GridSearchResult",
    "Laplace",
    "LaplaceBridge",
    "LogsumexpBCE",
    "Loss",
    "SegmentationPrediction",
    "SelectInput",
    "SelectOutput",
    "SlidingWindow",
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


def __getattr__(name: str) -> Any:
    """Import a public name of the package on first access and cache it in the package.

    Args:
        name: The attribute looked up on ``lsn_ext``.

    Returns:
        The submodule, class, function or constant that ``name`` stands for.

    Raises:
        AttributeError: ``name`` is neither a public name nor a submodule of ``lsn_ext``.
    """
    module_name = _LAZY.get(name)
    submodule = f"lsn_ext.{name}"
    is_submodule = name.isidentifier() and not name.startswith("__")
    if module_name is None and is_submodule and importlib.util.find_spec(submodule):
        module_name = submodule
    if module_name is None:
        raise AttributeError(f"module 'lsn_ext' has no attribute {name!r}")
    # StochMan's nnj layers are registered in the rule table on import of stochman_ext; the
    # package's names have always come with that registration (README, "StochMan").
    importlib.import_module("lsn_ext.stochman_ext")
    module = importlib.import_module(module_name)
    value = module if module_name == submodule else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
