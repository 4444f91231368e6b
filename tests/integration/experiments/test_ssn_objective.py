"""``ssn_objective``: the grid, the metrics rebuilt from per-image sums, and the
quick run's report and per-seed CSV."""

import csv

import pytest
import torch

from integration.experiments import ssn_objective as bench
from lsn_ext import metrics
from tests.integration.experiments.quick import quick_run as quick_run_of


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ssn_objective")
    return out, quick_run_of(bench.main, out, "--workers", "1")


def test_full_grid_is_rank_by_samples_by_loss():
    grid = bench.configs()
    assert len(grid) == 21 == len(set(grid))
    assert {c.rank for c in grid} == {0, 1, 10}
    assert {c.samples for c in grid} == {1, 5, 20, 100}
    assert bench.reference(grid) == bench.Config(10, 20, "logsumexp")
    one_sample = [c for c in grid if c.samples == 1]
    assert [c.objective for c in one_sample] == ["logsumexp"] * 3  # M = 1: the losses coincide
    specs = {c.name: c.spec() for c in grid}
    assert specs["r10 M20 expected"].objective == "expected"
    assert specs["r10 M20 expected"].antithetic
    assert not specs["r1 M5 Eq. 11"].antithetic
    assert len({s.tag() for s in specs.values()}) == 21  # distinct cache keys and seeds


def test_the_grid_can_be_restricted_by_samples_and_rank():
    grid = bench.configs(samples=(100,), ranks=(10,))
    assert [c.name for c in grid] == ["r10 M100 Eq. 11", "r10 M100 expected"]
    assert bench.reference(grid) == bench.Config(10, 100, "logsumexp")
    with pytest.raises(SystemExit):
        bench.main(["--samples", "7", "--ranks", "10", "--report-only"])


def _stored(pred, truth, var, width):
    band = metrics.boundary_band(truth.double(), width)
    return {
        "iou_inter": (pred & truth).flatten(1).sum(1).double().tolist(),
        "iou_union": (pred | truth).flatten(1).sum(1).double().tolist(),
        "band_var": (var * band).flatten(1).sum(1).tolist(),
        "total_var": var.flatten(1).sum(1).tolist(),
        "band_pixels": band.flatten(1).sum(1).double().tolist(),
        "pixels": float(band[0].numel()),
    }


def test_metrics_from_per_image_sums_match_lsn_ext_metrics():
    gen = torch.Generator().manual_seed(0)
    truth = torch.zeros(5, 1, 16, 16, dtype=torch.bool)
    truth[:, :, 4:11, 3:9] = True
    pred = torch.rand(5, 1, 16, 16, generator=gen) > 0.3
    var = torch.rand(5, 1, 16, 16, generator=gen, dtype=torch.float64)
    r = _stored(pred, truth, var, bench.BAND)
    assert bench.iou_of(r) == pytest.approx(metrics.iou(pred, truth))
    share, pixel_share = metrics.boundary_share(var, truth.double(), bench.BAND)
    assert bench.boundary_ratio(r) == pytest.approx(share / pixel_share)
    idx = torch.tensor([0, 0, 3])
    assert bench.iou_of(r, idx) == pytest.approx(metrics.iou(pred[idx], truth[idx]))
    share, pixel_share = metrics.boundary_share(var[idx], truth[idx].double(), bench.BAND)
    assert bench.boundary_ratio(r, idx) == pytest.approx(share / pixel_share)


def test_bootstrap_interval_brackets_the_seed_mean():
    gen = torch.Generator().manual_seed(1)
    truth = torch.rand(20, 1, 8, 8, generator=gen) > 0.5
    results = []
    for _ in range(3):
        pred = truth ^ (torch.rand(20, 1, 8, 8, generator=gen) > 0.8)
        results.append(_stored(pred, truth, torch.rand(20, 1, 8, 8, generator=gen).double(), 1))
    lo, hi = bench.bootstrap(results, "IoU", 20, 300)
    mean = sum(bench.iou_of(r) for r in results) / 3
    assert lo < mean < hi
    assert hi - lo < 0.2


@pytest.mark.slow
def test_quick_run_reports_every_configuration(quick_run):
    tmp_path, text = quick_run
    grid = bench.configs(quick=True)
    for c in grid:
        assert f"| {c.name} | 2 | " in text, c.name
    assert "nan" not in text.lower()
    ref = bench.reference(grid)
    paired = text.split("## Paired against")[1]
    assert ref.name in paired.splitlines()[0]
    assert len([ln for ln in paired.splitlines() if ln.startswith("| r")]) == len(grid) - 1
    with (tmp_path / "ssn_objective_per_seed.csv").open() as f:
        rows = list(csv.DictReader(f))
    per_unit = {(r["config"], r["seed"]) for r in rows}
    assert per_unit == {(c.name, s) for c in grid for s in ("0", "1")}
    assert {r["metric"] for r in rows} >= {"IoU", "boundary ratio", "shift AUROC (entropy)"}
    assert all(float(r["value"]) == float(r["value"]) for r in rows)  # no NaN
