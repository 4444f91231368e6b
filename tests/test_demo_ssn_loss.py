"""``integration/demo_ssn_loss.py``: the quick run's report and per-seed CSV."""

import csv

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    yield from load_script("demo_ssn_loss")


@pytest.fixture(scope="module")
def quick_run(bench, tmp_path_factory):
    """The quick run, in float32 like a real one (module fixtures run before the float64 one)."""
    out = tmp_path_factory.mktemp("demo_ssn_loss")
    argv = ["--quick", "--seeds", "0,1", "--workers", "1", "--cache", str(out / "cache")]
    return out, bench.main([*argv, "--out", str(out)]).read_text()


@pytest.mark.slow
def test_quick_run_reports_both_losses_paired(bench, quick_run):
    out, text = quick_run
    for loss in bench.LOSSES:
        assert f"| {bench.NAMES[loss]} | 2 | " in text
    paired = text.split("## Paired per seed")[1]
    for m in ("IoU", "boundary ratio", "H&E entropy AUROC"):
        assert f"| {m} | " in paired
    assert "nan" not in text.lower()
    with (out / "demo_ssn_loss_per_seed.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * len(bench.MEASURES)
    assert {r["loss"] for r in rows} == set(bench.LOSSES)


def test_the_two_losses_train_different_networks(bench, tmp_path):
    a = bench.unit(0, "logsumexp", quick=True)
    b = bench.unit(0, "expected", quick=True)
    assert a["IoU"] >= 0
    assert a["logit sd"] != b["logit sd"]
    assert 0 <= a["H&E entropy AUROC"] <= 1
