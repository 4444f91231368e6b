"""The quick run of an experiment, for the tests of the experiments."""

from collections.abc import Callable
from pathlib import Path

import torch


def quick_run(main: Callable[[list[str]], Path], out: Path, *args: str) -> str:
    """Run ``main`` with ``--quick --seeds 0,1``, its cache in ``out/cache`` and its report in
    ``out`` (plus ``args``); return the report's text.

    The run is in float32 like a real one, whatever default dtype the suite's fixtures or an
    earlier test left (``tests/conftest.py`` sets float64 per test); the default is restored.
    """
    argv = ["--quick", "--seeds", "0,1", "--cache", str(out / "cache"), "--out", str(out)]
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        return main([*argv, *args]).read_text()
    finally:
        torch.set_default_dtype(dtype)
