"""The tables of every experiment's report: intervals over seeds, paired per-seed differences,
a bootstrap over test images, how each is printed, and the Markdown table itself.

- :func:`t_quantile`, :func:`mean_ci`: mean ± the half-width of the two-sided t-interval,
  ``mean ± t_{(1+level)/2, n−1} · sd / √n`` with the sample standard deviation (``n − 1``), the
  quantile from ``scipy.stats.t.ppf`` for any ``n ≥ 2``.
- :func:`paired`: per-seed differences ``a_i − b_i`` with their t-interval and the count of seeds
  on which ``a`` is better (and of ties).
- :func:`percentile_bootstrap`: percentile interval of a statistic averaged over seeds when each
  seed's test images are resampled with replacement (the images are the noise, the networks
  fixed).
- :func:`fmt`, :func:`fmt_paired`: the printed cells. A value that is the same on every seed (a
  deterministic score) prints as ``0.684 (same on all 10 seeds)``, never as ``0.684 ± 0.000``;
  a half-width that would round to zero gets more digits (up to three more) until it shows.
- :func:`table`, :func:`mean`, :func:`geo`: a Markdown table (first column left, the others
  right-aligned), the arithmetic and the geometric mean.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from scipy.stats import t as student_t
from torch import Tensor

MAX_EXTRA_DIGITS = 3


@functools.cache  # scipy's ppf costs ~0.3 ms; a script asks for the same few n thousands of times
def t_quantile(n: int, level: float = 0.95) -> float:
    """The quantile ``t_{(1+level)/2, n−1}`` of the two-sided t-interval of a mean of ``n``.

    Args:
        n: Number of values (seeds), at least 2.
        level: Coverage of the interval, in (0, 1).

    Raises:
        ValueError: ``n < 2`` (no spread can be estimated) or ``level`` outside (0, 1).
    """
    if n < 2:
        raise ValueError(f"tables.t_quantile: a t-interval needs n >= 2 values, got n = {n}")
    if not 0 < level < 1:
        raise ValueError(f"tables.t_quantile: level must be in (0, 1), got {level}")
    return float(student_t.ppf((1 + level) / 2, n - 1))


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values with the half-width of its t-interval.

    Attributes:
        mean: The mean.
        half: Half-width ``t · sd / √n``; 0.0 when ``n == 1`` or every value is the same.
        n: Number of values.
        constant: Every value is the same (a deterministic score: no interval to show).
    """

    mean: float
    half: float
    n: int
    constant: bool

    def fmt(self, digits: int = 3, sign: bool = False) -> str:
        """``mean ± half`` with ``digits`` decimals (more where the half-width would show as 0).

        ``sign``: print ``+`` before a positive mean (differences). A constant value prints as
        ``mean (same on all n seeds)``, a single one as ``mean (1 seed)``.
        """
        plus = "+" if sign else ""
        if self.n == 1:
            return f"{self.mean:{plus}.{digits}f} (1 seed)"
        if self.constant:
            return f"{self.mean:{plus}.{digits}f} (same on all {self.n} seeds)"
        d = digits
        while round(self.half, d) == 0 and d < digits + MAX_EXTRA_DIGITS:
            d += 1
        return f"{self.mean:{plus}.{d}f} ± {self.half:.{d}f}"


def _floats(values: Sequence[float], who: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"tables.{who}: no values (an empty list has no mean)")
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"tables.{who}: non-finite value in {out}; drop or fix it first")
    return out


def mean_ci(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean and t-interval half-width of ``values`` (e.g. one metric over seeds).

    Raises:
        ValueError: no values, or a NaN / infinite one (it would silently poison the mean).
    """
    v = _floats(values, "mean_ci")
    n = len(v)
    mean = math.fsum(v) / n  # the correctly rounded sum: the printed digits do not depend on order
    if n == 1 or max(v) == min(v):
        return Interval(mean, 0.0, n, constant=n > 1)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in v) / (n - 1))
    return Interval(mean, t_quantile(n, level) * sd / math.sqrt(n), n, constant=False)


def fmt(values: Sequence[float], digits: int = 3, sign: bool = False) -> str:
    """:meth:`Interval.fmt` of :func:`mean_ci` (95 %)."""
    return mean_ci(values).fmt(digits, sign)


@dataclass(frozen=True)
class Paired:
    """Per-seed differences ``a − b``.

    Attributes:
        diff: Their mean and t-interval.
        better: Seeds on which ``a`` is better (difference > 0 where higher is better, < 0
            where lower is).
        tied: Seeds with a difference of exactly 0.
        n: Number of pairs.
    """

    diff: Interval
    better: int
    tied: int
    n: int

    @property
    def count(self) -> str:
        """``k/n``, with ``(t tied)`` when some differences are exactly 0."""
        return f"{self.better}/{self.n}" + (f" ({self.tied} tied)" if self.tied else "")


def paired(
    a: Sequence[float], b: Sequence[float], higher_is_better: bool = True, level: float = 0.95
) -> Paired:
    """Per-seed differences ``a_i − b_i`` (the same seeds, in the same order).

    Raises:
        ValueError: ``a`` and ``b`` differ in length, or hold no values.
    """
    if len(a) != len(b):
        raise ValueError(f"stats.paired: {len(a)} values against {len(b)}; pair them by seed")
    d = [x - y for x, y in zip(_floats(a, "paired"), _floats(b, "paired"), strict=True)]
    better = sum((x > 0) if higher_is_better else (x < 0) for x in d)
    return Paired(mean_ci(d, level), better, sum(x == 0 for x in d), len(d))


def fmt_paired(
    a: Sequence[float], b: Sequence[float], digits: int = 3, higher_is_better: bool = True
) -> str:
    """``+d ± h (k/n better)`` of :func:`paired`."""
    p = paired(a, b, higher_is_better)
    return f"{p.diff.fmt(digits, sign=True)} ({p.count} better)"


def percentile_bootstrap(
    per_seed: Sequence[tuple[int, Callable[[Tensor], Tensor]]],
    n_boot: int,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """Percentile interval of a metric's mean over seeds under resampled test images.

    ``per_seed[i] = (n_i, fn_i)``: ``fn_i(idx) -> [R]`` evaluates seed ``i``'s metric on its
    ``n_i`` test images resampled by ``idx [R, n_i]`` (with replacement, independently per
    seed, the trained networks fixed). The interval is the ``(1 − level)/2`` and
    ``(1 + level)/2`` quantiles of the ``R = n_boot`` seed-averaged values; resamples where the
    metric is undefined (NaN, e.g. no error pixel drawn) are left out; None if all are.
    """
    if not per_seed:
        raise ValueError("stats.percentile_bootstrap: no seeds")
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(n_boot, dtype=torch.float64)
    for n, fn in per_seed:
        total += fn(torch.randint(0, n, (n_boot, n), generator=gen)).double()
    total = total[torch.isfinite(total)] / len(per_seed)
    if len(total) == 0:
        return None
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(total, q).tolist()
    return lo, hi


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: ``header`` and ``rows`` of cells, the first column left-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def mean(x: list[float]) -> float:
    """The arithmetic mean of ``x`` (at least one value)."""
    return sum(x) / len(x)


def geo(values: list[float]) -> float:
    """The geometric mean of positive ``values``."""
    return math.exp(mean([math.log(v) for v in values]))
