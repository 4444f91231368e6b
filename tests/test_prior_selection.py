"""``integration/prior_selection.py --quick``: every prior rule is measured beside the MAP on both
data sets, with paired differences, prior diagnostics and both image-statistics scales."""

import csv
import re

import pytest
import torch

from tests.scripts import load_script


@pytest.fixture(scope="module")
def ps():
    yield from load_script("prior_selection")


@pytest.fixture(scope="module")
def quick(ps, tmp_path_factory):
    out = tmp_path_factory.mktemp("prior_selection")
    argv = ["--quick", "--seeds", "0,1", "--cache", str(out / "cache"), "--out", str(out)]
    return out, ps.main(argv).read_text()


@pytest.mark.slow
def test_quick_run_reports_every_arm_with_paired_differences_and_diagnostics(ps, quick):
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
def test_report_only_gives_the_same_report(ps, quick):
    out, text = quick
    argv = ["--quick", "--seeds", "0,1", "--report-only", "--cache", str(out / "cache")]
    again = ps.main([*argv, "--out", str(out / "again")]).read_text()
    assert again.split("## lesions")[1] == text.split("## lesions")[1]


def test_volume_on_the_training_scale_keeps_the_volume_intensity_shift():
    from lsn_ext.data import load_nuclei_3d, nuclei_patches, nuclei_volume_slices

    bench = next(load_script("uncertainty_benchmark"))
    own, _ = nuclei_volume_slices(64, dtype=torch.float64)
    train = bench.volume_on_training_scale(own)
    volume, _ = load_nuclei_3d()
    splits = nuclei_patches(64, 32, dtype=torch.float64)
    # slices 61 × 57 reflect-padded to 64: row r of the volume is row r + 1, column c is c + 3
    expected = splits.normalise(volume[:, 30, 28])
    torch.testing.assert_close(train[:, 0, 31, 31], expected, rtol=0, atol=1e-9)
    assert own.mean().abs() < 0.1  # standardised by its own statistics
    assert train.mean() > 0.5  # brighter than the training band: the shift is kept
