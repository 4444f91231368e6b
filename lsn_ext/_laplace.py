"""laplace-torch, imported with one upstream deprecation warning silenced.

laplace-torch 0.3 imports ``asdl`` (for its ASDL backends), whose ``asdl.precondition.psgd``
calls ``torch.jit.script`` at import time; torch 2.13 deprecates that with a
``DeprecationWarning`` (torch 2.14: a ``FutureWarning``), so ``python -W error`` could not import
lsn_ext's laplace-torch parts. The warning is about asdl, not about anything a user of lsn_ext
does: it is ignored for this one import only, by its exact message and those two categories.
Every lsn_ext module that needs laplace-torch imports it from here.

laplace-torch imports torchmetrics, which imports torchvision when it is installed. A torchvision
wheel built for another torch (PyPI's CUDA torchvision beside a CPU torch, or another version)
fails inside that import with an error that names neither laplace-torch nor the cause ("operator
torchvision::nms does not exist"); that failure is re-raised here as an :class:`ImportError` that
says what is wrong and how to fix it. Nothing in lsn_ext, laplace-torch, BackPACK or StochMan
uses torchvision at run time.
"""

import traceback
import warnings
from importlib import metadata


def _torchvision_in(err: BaseException) -> bool:
    """Whether ``err`` was raised inside torchvision (or names it)."""
    frames = traceback.extract_tb(err.__traceback__)
    return "torchvision" in str(err) or any("torchvision" in f.filename for f in frames)


def _installed(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _broken_torchvision(err: BaseException) -> ImportError:
    torch_version = _installed("torch")
    return ImportError(
        "lsn_ext could not import laplace-torch because torchvision "
        f"{_installed('torchvision')} does not work beside torch {torch_version} "
        f"({type(err).__name__}: {err}). torchvision works only beside the torch build it was "
        "made for (same version pairing, CPU or CUDA). Fix either way: `pip uninstall "
        "torchvision` (lsn_ext, laplace-torch, BackPACK and StochMan do not use it), or install "
        "the matching pair from one index, e.g. `pip install torch==2.13.0 torchvision==0.28.0 "
        "--index-url https://download.pytorch.org/whl/cpu` (README, Install)."
    )


try:
    with warnings.catch_warnings():
        # torch 2.13 warns with a DeprecationWarning, torch 2.14 with a FutureWarning.
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings(
                "ignore", message=r"`torch\.jit\.script` is deprecated", category=category
            )
        import laplace
        from laplace import baselaplace
        from laplace.baselaplace import BaseLaplace
        from laplace.curvature import CurvatureInterface, GGNInterface
        from laplace.utils.utils import fix_prior_prec_structure
except Exception as err:
    if _torchvision_in(err):
        raise _broken_torchvision(err) from err
    raise

Laplace = laplace.Laplace

__all__ = [
    "BaseLaplace",
    "CurvatureInterface",
    "GGNInterface",
    "Laplace",
    "baselaplace",
    "fix_prior_prec_structure",
]
