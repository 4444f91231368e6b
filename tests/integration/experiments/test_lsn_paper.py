"""``lsn_paper --quick``: every part runs end to end and reports all seven models."""

import csv
import math
import re

import pytest

from integration.experiments.kit import QUICK, SHIFTS
from integration.experiments.lsn_paper.__main__ import main
from integration.experiments.lsn_paper.design import MODELS, PARTS, SSN_MODELS
from integration.experiments.lsn_paper.report import fisher_exact
from tests.integration.experiments.quick import quick_run


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("lsn_paper")
    return out, quick_run(main, out, "--nuclei-seeds", "0,1", "--workers", "1")


@pytest.mark.slow
def test_quick_run_reports_every_part_for_all_seven_models(quick_report):
    out, text = quick_report
    for heading in ("Table 1", "Table 2", "Fig. 4", "Fig. 5", "Fig. 7", "Diagnosis"):
        assert f"## {heading}" in text
    assert "not run" not in text
    table1 = text.split("## Table 1")[1].split("\n## ")[0]
    for name in MODELS:
        cell = rf"^\| {re.escape(name)} \| \d\.\d{{3}} (± \d|\(same on all 2 seeds\))"
        assert re.search(cell, table1, re.M), name
    for dataset in ("lesions", "nuclei"):
        assert f"### {dataset}" in text
    assert "2 seeds (0, 1)" in text
    assert (out / "lsn_paper_fig7.png").stat().st_size > 1000
    assert "nan" not in text.lower()


@pytest.mark.slow
def test_quick_run_writes_every_tables_per_seed_values(quick_report):
    out, text = quick_report
    with (out / "lsn_paper_per_seed.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["dataset", "part", "model", "seed", "metric", "value"]
        rows = list(reader)
    assert {r["part"] for r in rows} == set(PARTS)
    assert all(math.isfinite(float(r["value"])) for r in rows)

    def count(part: str, dataset: str = "lesions") -> int:
        return sum(r["part"] == part and r["dataset"] == dataset for r in rows)

    n_models, n_ssn, seeds = len(MODELS), len(SSN_MODELS), 2
    factors = QUICK.factors
    assert count("table1") == n_models * len(factors) * seeds
    for dataset in ("lesions", "nuclei"):
        assert count("table2", dataset) == n_models * seeds * 7  # IoU, 4 ratios, 2 medians
        assert count("fig4", dataset) == n_ssn * seeds * 5
        assert count("fig5", dataset) == n_ssn * seeds * 6
    n_shifts = sum(len(strengths) for strengths, _ in SHIFTS.values())
    assert count("fig7") == n_models * seeds * (1 + 2 * n_shifts)
    assert {int(r["seed"]) for r in rows} == {0, 1}
    # the report's cells are the means of these values
    table1 = text.split("## Table 1")[1].split("\n## ")[0]
    for name in MODELS:
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


def test_fisher_exact_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for a, n_a, b, n_b in [(0, 5, 2, 5), (0, 10, 5, 10), (3, 5, 3, 5), (1, 4, 6, 9), (0, 5, 0, 5)]:
        expected = stats.fisher_exact([[a, n_a - a], [b, n_b - b]]).pvalue
        assert fisher_exact(a, n_a, b, n_b) == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_rerun_uses_the_cache_and_gives_the_same_report(quick_report):
    out, text = quick_report
    again = main(
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
