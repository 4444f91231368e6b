"""``lsn_budget``: budgets, and the quick run's report and per-seed CSV."""

import csv

import pytest

from integration.experiments import lsn_budget as bench
from tests.integration.experiments.quick import quick_run as quick_run_of


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lsn_budget")
    return out, quick_run_of(bench.main, out, "--workers", "1")


def test_budgets_differ_only_in_the_step_cap():
    budgets = [bench.budget(cap, quick=False) for cap in bench.CAPS]
    assert [b.steps for b in budgets] == [128, 512, 2048]
    assert len({b.key() for b in budgets}) == 3  # separate caches
    first = budgets[0]
    for b in budgets[1:]:
        assert (b.eval_every, b.patience, b.min_steps, b.n_train) == (
            first.eval_every,
            first.patience,
            first.min_steps,
            first.n_train,
        )


@pytest.mark.slow
def test_quick_run_reports_every_budget_and_model(quick_run):
    out, text = quick_run
    results = text.split("## Results per budget")[1].split("\n## ")[0]
    for cap in bench.CAPS:
        for model in bench.MODELS:
            assert f"| {cap} | {model} | 2 | " in results, (cap, model)
        assert f"| {cap} | MAP entropy (baseline) | 2 | " in results
        assert f"| {cap} | SSN aleatoric boundary ratio | 2 | " in results
    paired = text.split("## Paired per seed")[1].split("\n## ")[0]
    assert paired.count("LSN (expected) − LSN (ce)") == len(bench.CAPS)
    assert "nan" not in text.lower()
    with (out / "lsn_budget_per_seed.csv").open() as f:
        rows = list(csv.DictReader(f))
    per_model = {(r["step_cap"], r["model"], r["seed"]) for r in rows}
    assert len(per_model) == len(bench.CAPS) * 2 * (len(bench.MODELS) + 3)


@pytest.mark.slow
def test_the_ssn_loss_gets_its_own_results_and_says_so(quick_run, tmp_path):
    """``--ssn-loss expected`` never reads the Eq. 11 run's results, and its report names it."""
    out, text = quick_run
    assert "trained with Eq. 11 with M = 20" in text
    assert bench._key(128, 0, "expected") != bench._key(128, 0, "logsumexp")
    argv = ["--quick", "--seeds", "0,1", "--cache", str(out / "cache"), "--report-only"]
    other = bench.main([*argv, "--ssn-loss", "expected", "--out", str(tmp_path)]).read_text()
    assert "trained with the expected BCE (M = 20)" in other
    results = other.split("## Results per budget")[1].split("\n## ")[0]
    assert not any(f"| {cap} | LSN (ce) |" in results for cap in bench.CAPS)
