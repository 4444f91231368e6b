"""Two exact ways to one result, and the faster one for a signature, timed once (CPU).

oneDNN's CPU kernels differ several-fold in speed between two formulations of the same
convolution product at some shapes and not at others, and which one wins depends on the
machine and the number of threads. Callers that have two exact formulations time both on the
first call of each signature and keep the faster (:func:`choose`); on other devices, and under
``torch.use_deterministic_algorithms(True)`` (the two round differently, and a timing is not
reproducible), they keep their default (:func:`timing_applies`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

__all__ = ["choose", "faster", "timing_applies"]


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


def faster(a: Callable[[], object], b: Callable[[], object], reps: int = 2) -> bool:
    """Whether ``a`` runs faster than ``b``: best of ``reps`` runs each, after a warm-up.

    ``b`` failing with a ``RuntimeError`` counts as slower; ``a`` must not fail.
    """
    try:
        b()
    except RuntimeError:
        return True
    a()
    best = {}
    for name, f in (("a", a), ("b", b)):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    return best["a"] < best["b"]
