"""``integration/lsn_paper.py --quick``: every part runs end to end and reports all seven models."""

import csv
import math
import re

import pytest
import torch

from tests.scripts import load_script


@pytest.fixture(scope="module")
def lsn_paper():
    yield from load_script("lsn_paper")


@pytest.fixture(scope="module")
def quick_report(lsn_paper, tmp_path_factory):
    out = tmp_path_factory.mktemp("lsn_paper")
    argv = ["--quick", "--seeds", "0,1", "--nuclei-seeds", "0,1", "--workers", "1"]
    argv += ["--cache", str(out / "cache")]
    path = lsn_paper.main([*argv, "--out", str(out)])
    return out, path.read_text()


@pytest.mark.slow
def test_quick_run_reports_every_part_for_all_seven_models(lsn_paper, quick_report):
    out, text = quick_report
    for heading in ("Table 1", "Table 2", "Fig. 4", "Fig. 5", "Fig. 7", "Diagnosis"):
        assert f"## {heading}" in text
    assert "not run" not in text
    table1 = text.split("## Table 1")[1].split("\n## ")[0]
    for name in lsn_paper.MODELS:
        cell = rf"^\| {re.escape(name)} \| \d\.\d{{3}} (± \d|\(same on all 2 seeds\))"
        assert re.search(cell, table1, re.M), name
    for dataset in ("lesions", "nuclei"):
        assert f"### {dataset}" in text
    assert "2 seeds (0, 1)" in text
    assert (out / "lsn_paper_fig7.png").stat().st_size > 1000
    assert "nan" not in text.lower()


@pytest.mark.slow
def test_quick_run_writes_every_tables_per_seed_values(lsn_paper, quick_report):
    out, text = quick_report
    with (out / "lsn_paper_per_seed.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["dataset", "part", "model", "seed", "metric", "value"]
        rows = list(reader)
    assert {r["part"] for r in rows} == set(lsn_paper.PARTS)
    assert all(math.isfinite(float(r["value"])) for r in rows)

    def count(part: str, dataset: str = "lesions") -> int:
        return sum(r["part"] == part and r["dataset"] == dataset for r in rows)

    n_models, n_ssn, seeds = len(lsn_paper.MODELS), len(lsn_paper.SSN_MODELS), 2
    factors = lsn_paper.QUICK.factors
    assert count("table1") == n_models * len(factors) * seeds
    for dataset in ("lesions", "nuclei"):
        assert count("table2", dataset) == n_models * seeds * 7  # IoU, 4 ratios, 2 medians
        assert count("fig4", dataset) == n_ssn * seeds * 5
        assert count("fig5", dataset) == n_ssn * seeds * 6
    n_shifts = sum(len(strengths) for strengths, _ in lsn_paper.SHIFTS.values())
    assert count("fig7") == n_models * seeds * (1 + 2 * n_shifts)
    assert {int(r["seed"]) for r in rows} == {0, 1}
    # the report's cells are the means of these values
    table1 = text.split("## Table 1")[1].split("\n## ")[0]
    for name in lsn_paper.MODELS:
        cell = re.search(rf"^\| {re.escape(name)} \| (\d\.\d{{3}}) (±|\(same)", table1, re.M)
        values = [
            float(r["value"])
            for r in rows
            if r["part"] == "table1"
            and r["model"] == name
            and r["metric"] == f"iou_factor_{factors[0]}"
        ]
        assert len(values) == seeds
        assert sum(values) / seeds == pytest.approx(float(cell.group(1)), abs=6e-4), name


def test_fisher_exact_matches_scipy(lsn_paper):
    stats = pytest.importorskip("scipy.stats")
    for a, n_a, b, n_b in [(0, 5, 2, 5), (0, 10, 5, 10), (3, 5, 3, 5), (1, 4, 6, 9), (0, 5, 0, 5)]:
        expected = stats.fisher_exact([[a, n_a - a], [b, n_b - b]]).pvalue
        assert lsn_paper._fisher_exact(a, n_a, b, n_b) == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_rerun_uses_the_cache_and_gives_the_same_report(lsn_paper, quick_report):
    out, text = quick_report
    again = lsn_paper.main(
        [
            "--quick",
            "--seeds",
            "0,1",
            "--nuclei-seeds",
            "0,1",
            "--cache",
            str(out / "cache"),
            "--out",
            str(out / "again"),
        ]
    ).read_text()

    def body(t: str) -> str:
        return t.split("## Table 1")[1]

    assert body(again) == body(text)


def test_shifts_change_the_images_as_documented(lsn_paper):
    x = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(0))
    mean = x.mean((-1, -2), keepdim=True)
    torch.testing.assert_close(lsn_paper.shift(x, "contrast", 0.5), mean + 0.5 * (x - mean))
    torch.testing.assert_close(lsn_paper.shift(x, "intensity", 2.0), 2 * x)
    blurred = lsn_paper.shift(x, "blur", 1.0)
    assert blurred.shape == x.shape
    torch.testing.assert_close(blurred.mean(), x.mean(), atol=0.05, rtol=0)
    assert blurred.std() < 0.7 * x.std()
    flat = torch.ones(1, 1, 8, 8)
    torch.testing.assert_close(lsn_paper.shift(flat, "blur", 2.0), flat)
    noisy = lsn_paper.shift(x, "noise", 0.5)
    assert 0.4 < (noisy - x).std() < 0.6
    with pytest.raises(ValueError, match="unknown shift"):
        lsn_paper.shift(x, "rotate", 1.0)


@pytest.mark.parametrize("n", [5, 10, 20], ids=lambda n: f"{n}-seeds")
def test_reported_interval_is_the_t_interval_for_any_seed_count(lsn_paper, n):
    """The report's cells use the t quantile with n − 1 degrees of freedom; the old table
    stopped at 8 and printed 1.96 z-intervals for 10 or more seeds."""
    from scipy.stats import t

    values = [float(k) for k in range(n)]
    sd = torch.tensor(values, dtype=torch.float64).std().item()
    half = t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    assert lsn_paper.fmt(values) == f"{(n - 1) / 2:.3f} ± {half:.3f}"
    assert lsn_paper.fmt([2.0]) == "2.000 (1 seed)"
