"""The quick run of an experiment, for the tests of the experiments."""

from collections.abc import Callable
from pathlib import Path


def quick_run(main: Callable[[list[str]], Path], out: Path, *args: str) -> str:
    """Run ``main`` with ``--quick --seeds 0,1``, its cache in ``out/cache`` and its report in
    ``out`` (plus ``args``); return the report's text.

    Call it from a module-scoped fixture: those are set up before the suite's float64 default
    (``tests/conftest.py``), so the run is in float32 like a real one.
    """
    argv = ["--quick", "--seeds", "0,1", "--cache", str(out / "cache"), "--out", str(out)]
    return main([*argv, *args]).read_text()
