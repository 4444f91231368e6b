"""Import an ``integration/`` script as a module for its tests (they are not a package)."""

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def load_script(name: str) -> Iterator[ModuleType]:
    """Yield ``integration/<name>.py`` imported as module ``name``; unregister it afterwards.

    Use as ``yield from load_script("lsn_paper")`` in a pytest fixture.
    """
    spec = importlib.util.spec_from_file_location(name, INTEGRATION / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(name, None)
