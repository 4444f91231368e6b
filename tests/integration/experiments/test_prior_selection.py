"""``prior_selection --quick``: every prior rule is measured beside the MAP on both data sets,
with paired differences, prior diagnostics and both image-statistics scales."""

import csv
import re

import pytest

from integration.experiments import prior_selection as ps
from tests.integration.experiments.quick import quick_run


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("prior_selection")
    return out, quick_run(ps.main, out)


@pytest.mark.slow
def test_quick_run_reports_every_arm_with_paired_differences_and_diagnostics(quick):
    out, text = quick
    assert "nan" not in text.lower()
    for dataset in ("lesions", "nuclei"):
        section = text.split(f"## {dataset}")[1].split("\n## ")[0]
        for heading in ("Clean test images", "Paired against the MAP", "Shift", "diagnostics"):
            assert heading in section, (dataset, heading)
        for method in ps.METHODS:
            assert re.search(rf"^\| {re.escape(method)} \| ", section, re.M), (dataset, method)
        assert "LA nn + marglik" in section.split("### Paired against the MAP")[1]
    nuclei = text.split("## nuclei")[1]
    assert ps.VOLUME_OWN_SCALE in nuclei
    assert ps.VOLUME_TRAIN_SCALE in nuclei
    assert "AURC, whole-image score (not to use)" in text
    with (out / "prior_selection_per_seed.csv").open() as f:
        rows = list(csv.DictReader(f))
    arms = {r["method"] for r in rows}
    assert set(ps.METHODS) | {"prior", "image statistics"} == arms
    marglik = {(r["dataset"], r["seed"]): r["value"] for r in rows if r["metric"] == "marglik"}
    assert len(marglik) == 4


@pytest.mark.slow
def test_report_only_gives_the_same_report(quick):
    out, text = quick
    argv = ["--quick", "--seeds", "0,1", "--report-only", "--cache", str(out / "cache")]
    again = ps.main([*argv, "--out", str(out / "again")]).read_text()
    assert again.split("## lesions")[1] == text.split("## lesions")[1]
