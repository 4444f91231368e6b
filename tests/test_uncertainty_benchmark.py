"""``integration/uncertainty_benchmark.py``: the quick run reports every method and section, and
the bootstrap's histogram metrics agree with the exact ones."""

import csv
import re
import sys

import pytest
import torch

from lsn_ext import metrics
from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    yield from load_script("uncertainty_benchmark")


@pytest.fixture(scope="module")
def quick_report(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("uncertainty")
    argv = ["--quick", "--seeds", "0,1", "--workers", "1", "--cache", str(out / "cache")]
    path = bench.main([*argv, "--out", str(out)])
    return out, path.read_text()


SECTIONS = (
    "## Pixel failure detection and calibration",
    "## Image failure detection: risk–coverage",
    "## Shift detection and failure detection under shift",
    "## Paired differences against MAP entropy and Ensemble (5)",
    "## Table 2 re-answered: Box Ratio",
    "## Training and cost",
)


@pytest.mark.slow
def test_quick_run_reports_every_method_and_section(bench, quick_report):
    out, text = quick_report
    for heading in SECTIONS:
        assert heading in text, heading
    assert "nan" not in text.lower()
    for section in text.split("\n## ")[1:5]:
        for dataset in ("lesions", "nuclei"):
            body = section.split(f"### {dataset}")[1].split("\n### ")[0]
            for name in bench.METHODS:
                assert re.search(rf"^\| {re.escape(name)} \| ", body, re.M), (name, dataset)
    shift = text.split("## Shift detection")[1].split("\n## ")[0]
    for dataset in ("lesions", "nuclei"):
        body = shift.split(f"### {dataset}")[1]
        assert re.search(
            rf"^\| {bench.IMAGE_STATS} \| \d\.\d{{3}} (± |\(same on all 2)", body, re.M
        )
    nuclei = shift.split("### nuclei")[1]
    assert re.search(rf"^\| {re.escape(bench.IMAGE_STATS_RAW)} \| \d\.\d{{3}}", nuclei, re.M)
    assert "U-Net + LA (nn, marglik)" in bench.METHODS
    assert "mean entropy ÷ MAP's" in text
    assert "shift AUROC: volume" in shift
    for kind in ("blur", "contrast", "noise", "intensity"):
        assert f"shift AUROC: {kind}" in shift
    box = text.split("## Table 2 re-answered")[1].split("\n## ")[0]
    for name in bench.METHODS[1:]:
        assert f"| {name} | " in box
    assert (out / "uncertainty_risk_coverage.png").stat().st_size > 1000
    with (out / "uncertainty_per_seed.csv").open() as f:
        rows = list(csv.DictReader(f))
    keys = [(r["dataset"], r["seed"], r["method"]) for r in rows]
    methods = {
        "lesions": (*bench.METHODS, bench.IMAGE_STATS),
        "nuclei": (*bench.METHODS, bench.IMAGE_STATS, bench.IMAGE_STATS_RAW),
    }
    expected = [(d, str(s), m) for d in methods for s in (0, 1) for m in methods[d]]
    assert sorted(keys) == sorted(expected)
    assert all(r["shift_auroc_volume"] for r in rows if r["dataset"] == "nuclei")


@pytest.mark.slow
def test_report_only_regenerates_the_same_report(bench, quick_report):
    out, text = quick_report
    argv = ["--quick", "--seeds", "0,1", "--report-only", "--cache", str(out / "cache")]
    again = bench.main([*argv, "--out", str(out / "again")]).read_text()
    assert again.split("## Pixel")[1] == text.split("## Pixel")[1]


def test_bootstrap_histograms_agree_with_the_exact_metrics(bench):
    b = bench.ConvergedBudget()
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(12, 1, 16, 16, generator=g, dtype=torch.float64)
    mean = torch.sigmoid(logits)
    y = (torch.rand(12, 1, 16, 16, generator=g, dtype=torch.float64) < mean).double()
    pred = bench.Pred(mean, bench.lp._entropy_binary(mean), None, None)
    exact, sums = bench.measure(pred, y, b, bench.histogram_edges([mean], b))
    every = torch.arange(12).unsqueeze(0)  # the identity "resample"
    for metric in ("auroc", "auprc", "ece", "nll", "brier"):
        got = bench._boot_pixel_metric(metric, sums, every).item()
        tol = {"auroc": 2e-3, "auprc": 1e-2}.get(metric, 1e-9)  # binned: ties within a bin
        assert got == pytest.approx(exact[metric], abs=tol), metric
        many = torch.randint(0, 12, (5, 12), generator=g)
        assert bench._boot_pixel_metric(metric, sums, many).shape == (5,), metric
    per = {k: exact[k] for k in ("u_mean", "u_fg", "dice_per_image")}
    for metric in ("aurc", "e_aurc", "spearman"):
        got = bench._boot_image_metric(metric, per, every).item()
        assert got == pytest.approx(exact[metric], abs=1e-9), metric
    n, fn = bench._shift_boot([0.1, 0.5, 0.3], [0.4, 0.9])
    assert n == 6
    idx = torch.tensor([[0, 1, 2, 3, 4, 5]])  # clean 0, 1, 2; shifted (i // 3) % 2 = 1, 1
    assert fn(idx).item() == pytest.approx(
        metrics.auroc(torch.tensor([0.1, 0.5, 0.3]), torch.tensor([0.9, 0.9]))
    )


def test_image_statistics_score_is_a_mahalanobis_distance(bench):
    g = torch.Generator().manual_seed(1)
    train = torch.randn(200, 1, 8, 8, generator=g) * (1 + torch.rand(200, 1, 1, 1, generator=g))
    d = bench.image_statistics(train, {"same": train[:5], "bright": 5 + train[:5]})
    assert min(d["bright"]) > max(d["same"])
    s = torch.stack([train.double().flatten(1).mean(1), train.double().flatten(1).std(1)], 1)
    diff = s[0] - s.mean(0)
    ref = (diff @ torch.linalg.inv(torch.cov(s.T)) @ diff).sqrt().item()
    assert d["same"][0] == pytest.approx(ref, rel=1e-6)


def test_early_stopping_keeps_the_best_weights_and_respects_min_steps_and_floor(bench):
    lp = sys.modules["lsn_paper"]

    def run(scores, **kw):
        net = torch.nn.Linear(1, 1)
        it = iter(scores)
        stop = lp.EarlyStopping(lambda n: next(it), every=10, patience=2, **kw)
        for step in range(1, 101):
            with torch.no_grad():
                net.weight.fill_(step)
            if stop.check(net, step, last=step == 100):
                break
        stop.restore(net)
        return stop, net.weight.item()

    stop, w = run([0.1, 0.5, 0.4, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    assert (stop.best_step, stop.steps_run, stop.stopped, w) == (20, 40, True, 20.0)
    stop, _ = run([0.1, 0.5, 0.4, 0.3, 0.2, 0.1, 0.9, 0.1, 0.1, 0.1], min_steps=60)
    assert (stop.best_step, stop.steps_run) == (20, 60)
    stop, w = run([0.0] * 6 + [0.3] + [0.1] * 3, floor=0.0)  # Dice 0: no stop until it moves
    assert (stop.best_step, stop.steps_run, stop.stopped, w) == (70, 90, True, 70.0)
    assert run([0.0] * 6 + [0.3] + [0.1] * 3)[0].steps_run == 30  # without the floor
