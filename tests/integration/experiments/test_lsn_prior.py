"""``lsn_prior``: measures rebuilt from per-image values, the pre-stated decision
rule, and the quick run's report and per-seed CSV."""

import csv

import pytest
import torch

from integration.experiments import lsn_prior as bench
from lsn_ext import metrics
from tests.integration.experiments.quick import quick_run as quick_run_of


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lsn_prior")
    return out, quick_run_of(bench.main, out, "--workers", "1")


def _values(gen, shift_he=0.0, miss=0.2):
    truth = torch.rand(6, 1, 8, 8, generator=gen) > 0.5
    pred = truth ^ (torch.rand(6, 1, 8, 8, generator=gen) < miss)
    var = torch.rand(6, 1, 8, 8, generator=gen, dtype=torch.float64)
    ent_id = torch.rand(6, generator=gen, dtype=torch.float64)
    ent_he = torch.rand(5, generator=gen, dtype=torch.float64) + shift_he
    ones = [1.0] * 6
    return (
        {
            "inter": (pred & truth).flatten(1).sum(1).double().tolist(),
            "union": (pred | truth).flatten(1).sum(1).double().tolist(),
            "nll_sum": (var.flatten(1).sum(1)).tolist(),
            "pixels": 64.0,
            "pr_noise": ones,
            "pr_black": ones,
            "br_noise": var.flatten(1).mean(1).tolist(),
            "br_black": ones,
            "ent_id": ent_id.tolist(),
            "ent_he": ent_he.tolist(),
            "var_id": ent_id.tolist(),
            "var_he": ent_he.tolist(),
        },
        pred,
        truth,
        var,
        ent_id,
        ent_he,
    )


def test_measures_match_lsn_ext_metrics():
    v, pred, truth, var, ent_id, ent_he = _values(torch.Generator().manual_seed(0))
    assert bench.measure(v, "IoU") == pytest.approx(metrics.iou(pred, truth))
    assert bench.measure(v, "NLL") == pytest.approx(float(var.mean()))
    assert bench.measure(v, "Entropy AUROC (H&E)") == pytest.approx(metrics.auroc(ent_id, ent_he))
    idx, idx_he = torch.tensor([1, 1, 4]), torch.tensor([0, 2])
    assert bench.measure(v, "IoU", idx) == pytest.approx(metrics.iou(pred[idx], truth[idx]))
    assert bench.measure(v, "Variance AUROC (H&E)", idx, idx_he) == pytest.approx(
        metrics.auroc(ent_id[idx], ent_he[idx_he])
    )


def _seeds(better_rule, gain, iou_miss):
    gen = torch.Generator().manual_seed(1)
    results = []
    for _ in range(6):
        values = {}
        for rule in bench.RULES:
            shift = gain if rule == better_rule else 0.0
            miss = iou_miss if rule == better_rule else 0.2
            values[rule] = _values(gen, shift, miss)[0]
        results.append({"values": values})
    return results


def test_decision_keeps_the_default_without_a_clear_gain():
    chosen, lines = bench._decision(_seeds("NLL grid, 8 samples", 0.0, 0.2))
    assert chosen == bench.DEFAULT
    assert len(lines) == len(bench.RULES) - 1


def test_decision_takes_a_rule_that_raises_the_auroc_at_no_iou_cost():
    chosen, _ = bench._decision(_seeds("shift selection", 2.0, 0.2))
    assert chosen == "shift selection"


def test_decision_refuses_a_gain_bought_with_iou():
    chosen, lines = bench._decision(_seeds("shift selection", 2.0, 0.6))
    assert chosen == bench.DEFAULT
    assert any(ln.startswith("- shift selection") and "not better" in ln for ln in lines)


@pytest.mark.slow
def test_quick_run_reports_every_rule_and_section(quick_run):
    out, text = quick_run
    for heading in (
        "## Each rule's prior and what it gives",
        "## Paired per seed against the default",
        "## The decision",
        "## Every measure on a coarse grid",
        "## The grid NLL's bias",
    ):
        assert heading in text, heading
    for rule in bench.RULES:
        assert f"| {rule} | " in text, rule
    assert "Default after this run: **" in text
    assert "nan" not in text.lower()
    with (out / "lsn_prior_per_seed.csv").open() as f:
        rows = list(csv.DictReader(f))
    curve = bench._curve(quick=True)
    assert len(rows) == 2 * (len(bench.RULES) + len(curve)) * len(bench.MEASURES)
    assert {r["seed"] for r in rows} == {"0", "1"}
    assert all(r["prior"] for r in rows)
