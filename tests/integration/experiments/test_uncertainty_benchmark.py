"""``uncertainty_benchmark --quick``: the quick run reports every method and section, and the
report is regenerated from the cache alone."""

import csv
import re

import pytest

from integration.experiments.uncertainty_benchmark import design
from integration.experiments.uncertainty_benchmark.__main__ import main
from tests.integration.experiments.quick import quick_run


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("uncertainty")
    return out, quick_run(main, out, "--workers", "1")


SECTIONS = (
    "## Pixel failure detection and calibration",
    "## Image failure detection: risk–coverage",
    "## Shift detection and failure detection under shift",
    "## Paired differences against MAP entropy and Ensemble (5)",
    "## Table 2 re-answered: Box Ratio",
    "## Beyond the diagonal: against the MAP's entropy and the ensemble",
    "## Training and cost",
    "## Cost per method",
)


@pytest.mark.slow
def test_quick_run_reports_every_method_and_section(quick_report):
    out, text = quick_report
    for heading in SECTIONS:
        assert heading in text, heading
    assert "nan" not in text.lower()
    for section in text.split("\n## ")[1:5]:
        for dataset in ("lesions", "nuclei"):
            body = section.split(f"### {dataset}")[1].split("\n### ")[0]
            for name in design.ALL_METHODS:
                assert re.search(rf"^\| {re.escape(name)} \| ", body, re.M), (name, dataset)
    shift = text.split("## Shift detection")[1].split("\n## ")[0]
    for dataset in ("lesions", "nuclei"):
        body = shift.split(f"### {dataset}")[1]
        assert re.search(
            rf"^\| {design.IMAGE_STATS} \| \d\.\d{{3}} (± |\(same on all 2)", body, re.M
        )
    nuclei = shift.split("### nuclei")[1]
    assert re.search(rf"^\| {re.escape(design.IMAGE_STATS_RAW)} \| \d\.\d{{3}}", nuclei, re.M)
    assert "U-Net + LA (nn, marglik)" in design.METHODS
    assert "mean entropy ÷ MAP's" in text
    assert "shift AUROC: volume" in shift
    for kind in ("blur", "contrast", "noise", "intensity"):
        assert f"shift AUROC: {kind}" in shift
    box = text.split("## Table 2 re-answered")[1].split("\n## ")[0]
    for name in design.ALL_METHODS[1:]:
        assert f"| {name} | " in box
    question = text.split("## Beyond the diagonal")[1].split("\n## ")[0]
    for name in (*design.MORE_LAPLACE, design.MIXTURE, design.TTA, design.LSN_DEMO):
        assert re.search(rf"^\| {re.escape(name)} \| [+-]\d", question, re.M), name
    cost = text.split("## Cost per method")[1]
    for name in (*design.ALL_METHODS[:3], *design.MORE_METHODS):
        for dataset in ("lesions", "nuclei"):
            row = re.search(rf"^\| {dataset}: {re.escape(name)} \| (.*)$", cost, re.M)
            assert row, (dataset, name)
            assert "nan" not in row.group(1), (dataset, name)
    assert (out / "uncertainty_risk_coverage.png").stat().st_size > 1000
    with (out / "uncertainty_per_seed.csv").open() as f:
        rows = list(csv.DictReader(f))
    keys = [(r["dataset"], r["seed"], r["method"]) for r in rows]
    methods = {
        "lesions": (*design.ALL_METHODS, design.IMAGE_STATS),
        "nuclei": (*design.ALL_METHODS, design.IMAGE_STATS, design.IMAGE_STATS_RAW),
    }
    expected = [(d, str(s), m) for d in methods for s in (0, 1) for m in methods[d]]
    assert sorted(keys) == sorted(expected)
    assert all(r["shift_auroc_volume"] for r in rows if r["dataset"] == "nuclei")


@pytest.mark.slow
def test_report_only_regenerates_the_same_report(quick_report):
    out, text = quick_report
    argv = ["--quick", "--seeds", "0,1", "--report-only", "--cache", str(out / "cache")]
    again = main([*argv, "--out", str(out / "again")]).read_text()
    assert again.split("## Pixel")[1] == text.split("## Pixel")[1]
