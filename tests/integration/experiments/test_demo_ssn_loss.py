"""``demo_ssn_loss``: the quick run's report and per-seed CSV."""

import csv

import pytest

from integration.experiments import demo_ssn_loss as bench
from tests.integration.experiments.quick import quick_run as quick_run_of


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_ssn_loss")
    return out, quick_run_of(
        bench.main, out, "--workers", "1", "--ranks", "0,10", "--samples", "1,20"
    )


@pytest.mark.slow
def test_quick_run_reports_both_losses_paired(quick_run):
    _, text = quick_run
    for loss in bench.LOSSES:
        assert f"| {bench.NAMES[loss]} | 2 | " in text
    paired = text.split("## Paired per seed: expected BCE − Eq. 11")[1].split("##")[0]
    for m in ("IoU", "boundary ratio", "H&E entropy AUROC"):
        assert f"| expected BCE − Eq. 11 | {m} | " in paired
    assert "nan" not in text.lower()


@pytest.mark.slow
def test_quick_run_reports_the_grid_paired_against_the_default(quick_run):
    out, text = quick_run
    configs = bench.grid([0, 10], [1, 20])
    assert len(configs) == 6  # M = 1 once per rank, M = 20 with both losses
    grid = text.split("## The ablation's grid")[1].split("##")[0]
    against = text.split("## Paired per seed against the demo's default")[1]
    for c in configs:
        assert f"| {c.name} | 2 | " in grid
        if c != bench.DEFAULT:
            assert f"| {c.name} − default | IoU | " in against
    with (out / "demo_ssn_loss_per_seed.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(configs) * 2 * len(bench.MEASURES)
    assert {(r["rank"], r["samples"], r["loss"]) for r in rows} == {
        (str(c.rank), str(c.samples), c.loss) for c in configs
    }


def test_grid_has_m1_once_and_follows_the_samples_order():
    configs = bench.grid([0, 1, 10], [20, 100, 1, 5])
    assert len(configs) == 21
    assert [c.samples for c in configs[:6]] == [20] * 6
    assert sum(c.samples == 1 for c in configs) == 3


def test_the_two_losses_train_different_networks(tmp_path):
    a = bench.unit(0, bench.PAPER, quick=True)
    b = bench.unit(0, bench.DEFAULT, quick=True)
    assert a["IoU"] >= 0
    assert a["logit sd"] != b["logit sd"]
    assert 0 <= a["H&E entropy AUROC"] <= 1


def test_paired_rows_count_ties_apart():
    a = {s: {m: float(s) for m in bench.PAIRED} for s in range(3)}
    b = {s: dict.fromkeys(bench.PAIRED, 1.0) for s in range(3)}
    rows = bench._paired(a, b, "a − b")
    assert [r[1] for r in rows] == list(bench.PAIRED)
    assert all(r[3] == "1/3 (1 tied)" for r in rows)
    assert rows[0][2].startswith("0.000 ± ")
