"""``integration/experiments/tables.py``: the reports' t-intervals, paired differences, bootstrap
and Markdown tables against scipy's own t-interval and exact small cases."""

import math

import pytest
import torch
from scipy import stats as sps

from integration.experiments import tables as st


@pytest.mark.parametrize("n", range(2, 51), ids=lambda n: f"n{n}")
def test_interval_equals_scipys_t_interval(n):
    gen = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=gen, dtype=torch.float64).tolist()
    lo, hi = sps.t.interval(0.95, n - 1, loc=sps.tmean(values), scale=sps.sem(values))
    ci = st.mean_ci(values)
    assert ci.mean == pytest.approx((lo + hi) / 2, rel=1e-12, abs=1e-14)
    assert ci.half == pytest.approx((hi - lo) / 2, rel=1e-12)
    assert st.t_quantile(n) == pytest.approx(sps.t.ppf(0.975, n - 1), rel=1e-14)


def test_ten_seeds_use_t_not_1_96():
    """The bug this module fixes: ``lsn_paper.T_975`` fell back to 1.96 from 9 degrees of
    freedom on, so 10-seed intervals were 13 % too narrow."""
    assert st.t_quantile(10) == pytest.approx(2.2622, abs=1e-4)
    values = [float(k) for k in range(10)]
    sd = math.sqrt(sum((v - 4.5) ** 2 for v in values) / 9)
    assert st.mean_ci(values).half == pytest.approx(2.2622 * sd / math.sqrt(10), rel=1e-4)


def test_constant_values_print_no_interval():
    assert st.fmt([0.684] * 10) == "0.684 (same on all 10 seeds)"
    assert st.fmt([0.5]) == "0.500 (1 seed)"
    assert st.fmt([1.0, 1.0, 0.9999]) == "1.0000 ± 0.0001"


def test_a_half_width_that_rounds_to_zero_gets_digits():
    text = st.fmt([0.997, 0.998, 0.998, 0.999], digits=2)
    assert text == "0.998 ± 0.001"


def test_paired_counts_better_and_ties_by_direction():
    a, b = [0.3, 0.5, 0.4, 0.2], [0.1, 0.5, 0.6, 0.1]
    up = st.paired(a, b)
    assert (up.better, up.tied, up.n, up.count) == (2, 1, 4, "2/4 (1 tied)")
    assert up.diff.mean == pytest.approx(0.025)
    down = st.paired(a, b, higher_is_better=False)
    assert down.better == 1
    assert st.fmt_paired(a, b).endswith("(2/4 (1 tied) better)")
    assert st.fmt_paired(a, b).startswith("+0.025 ± ")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda st: st.t_quantile(1), "n >= 2"),
        (lambda st: st.mean_ci([]), "no values"),
        (lambda st: st.mean_ci([1.0, float("nan")]), "non-finite"),
        (lambda st: st.paired([1.0, 2.0], [1.0]), "pair them by seed"),
    ],
    ids=["one-value-quantile", "empty", "nan", "unpaired"],
)
def test_bad_input_raises_a_named_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(st)


def test_bootstrap_of_a_mean_matches_its_normal_spread():
    """The percentile interval of one seed's image mean has the width the sampling
    distribution gives (± 1.96 sd/√n for a mean of many images)."""
    x = torch.randn(400, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lo, hi = st.percentile_bootstrap([(len(x), lambda idx: x[idx].mean(1))], n_boot=4000)
    half = 1.96 * x.std().item() / math.sqrt(len(x))
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.08)
    assert (lo + hi) / 2 == pytest.approx(x.mean().item(), abs=0.2 * half)


def test_bootstrap_leaves_out_undefined_resamples():
    nan_half = lambda idx: torch.where(idx[:, 0] % 2 == 0, torch.nan, 1.0)  # noqa: E731
    assert st.percentile_bootstrap([(10, nan_half)], n_boot=200) == (1.0, 1.0)
    assert st.percentile_bootstrap([(10, lambda idx: idx[:, 0] * torch.nan)], 50) is None


@pytest.mark.parametrize("n", [5, 10, 20], ids=lambda n: f"{n}-seeds")
def test_reported_interval_is_the_t_interval_for_any_seed_count(n):
    """The report's cells use the t quantile with n − 1 degrees of freedom; the old table
    stopped at 8 and printed 1.96 z-intervals for 10 or more seeds."""
    from scipy.stats import t

    values = [float(k) for k in range(n)]
    sd = torch.tensor(values, dtype=torch.float64).std().item()
    half = t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    assert st.fmt(values) == f"{(n - 1) / 2:.3f} ± {half:.3f}"
    assert st.fmt([2.0]) == "2.000 (1 seed)"


def test_table_aligns_the_first_column_left_and_the_others_right():
    text = st.table(["a", "b", "c"], [["x", "1", "2"]])
    assert text.splitlines() == ["| a | b | c |", "|---|---:|---:|", "| x | 1 | 2 |"]
    assert st.mean([1.0, 2.0, 6.0]) == 3.0
    assert st.geo([1.0, 4.0, 16.0]) == pytest.approx(4.0, rel=1e-12)
