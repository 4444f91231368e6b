"""Two exact ways to one result, and the faster one for a signature, timed once (CPU).

oneDNN's CPU kernels differ several-fold in speed between two formulations of the same
convolution product at some shapes and not at others, and which one wins depends on the
machine and the number of threads. Callers that have two exact formulations time both on the
first call of each signature and keep the faster (:func:`choose`); on other devices, and under
``torch.use_deterministic_algorithms(True)`` (the two round differently, and a timing is not
reproducible), they keep their default (:func:`timing_applies`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

__all__ = ["choose", "faster", "timing_applies"]

LONG = 0.1
"""Seconds of warm-up (both kernels) above which :func:`faster` times three runs each."""


def timing_applies(t: Tensor) -> bool:
    """Whether a kernel choice by timing applies to computations on ``t``'s device."""
    return t.device.type == "cpu" and not torch.are_deterministic_algorithms_enabled()


def choose(
    cache: dict[Hashable, bool],
    key: Hashable,
    a: Callable[[], object],
    b: Callable[[], object],
    when: Callable[[], bool] | None = None,
) -> bool:
    """Whether ``a`` serves for ``key``: :func:`faster` on the first call, cached after.

    ``when`` says whether ``a`` can serve at all (asked once per key, before any timing);
    where it cannot, ``b`` serves without a timing.
    """
    use_a = cache.get(key)
    if use_a is None:
        use_a = cache[key] = (when is None or when()) and faster(a, b)
    return use_a


def faster(a: Callable[[], object], b: Callable[[], object], reps: int = 5) -> bool:
    """Whether ``a`` runs faster than ``b``: medians of ``reps`` alternated runs, after a warm-up.

    Medians, not minima: some oneDNN kernels are erratic from call to call (the grouped
    per-sample weight gradient of a 128 → 128 convolution at 4², batch 8, two threads: median
    3.7 ms, fastest of 40 calls 0.7 ms, against 0.8 ms for eight plain calls), and the fastest
    of a few runs then picks the kernel that is slower almost every time. Alternating ``a`` and
    ``b`` spreads a drift in the machine's load over both. Where the warm-up of both took more
    than :data:`LONG` seconds, three runs each serve (the noise is small against such calls).

    ``b`` failing with a ``RuntimeError`` counts as slower; ``a`` must not fail.
    """
    t0 = time.perf_counter()
    try:
        b()
    except RuntimeError:
        return True
    a()
    if time.perf_counter() - t0 > LONG:
        reps = min(reps, 3)
    times: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(reps):
        for name, f in (("a", a), ("b", b)):
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return statistics.median(times["a"]) < statistics.median(times["b"])
