import csv
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext.__main__ import main
from lsn_ext.demo import COLUMNS, MODELS, DemoConfig, laplace_unet, tune_prior
from lsn_ext.laplace_ext import gridsearch_prior_precision
from lsn_ext.models import UNet


def test_quick_demo_writes_figure_and_tables(tmp_path, capsys):
    # CPU time of this process: wall-clock time depends on what else runs on the machine.
    start = time.process_time()
    assert main(["demo", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    assert time.process_time() - start < 30
    assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "table.csv") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == COLUMNS
    assert [r[0] for r in rows[1:]] == list(MODELS)
    for row in rows[1:]:
        assert all(float(v) >= 0 for v in row[1:])
    md = (tmp_path / "table.md").read_text()
    assert md.startswith("| " + " | ".join(COLUMNS) + " |")
    assert all(f"| {m} |" in md for m in MODELS)
    assert "Paper's ordering" in capsys.readouterr().out


@pytest.mark.slow
def test_quick_demo_with_the_calibrated_estimator(tmp_path, capsys):
    args = ["demo", "--quick", "--out", str(tmp_path), "--no-progress", "--ensemble", "0"]
    assert main([*args, "--estimator", "db_calibrated", "--mc-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "GGN diagonal: db_calibrated (2 Monte-Carlo vector(s) per image)" in out
    with open(tmp_path / "table.csv") as f:
        rows = list(csv.reader(f))
    assert [r[0] for r in rows[1:]] == [m for m in MODELS if m != "Ensemble"]


def test_demo_refuses_bad_estimator_options(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--estimator", "exact"])
    assert "invalid choice: 'exact'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--mc-samples", "0"])
    assert "--mc-samples >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "-1"], "--threads must be 0 (torch's default) or positive, got -1"),
        (
            ["--estimator", "db", "--mc-samples", "2"],
            "--mc-samples 2 has no effect with --estimator db",
        ),
        (["--out", "/proc/lsn-ext-demo"], "cannot write to --out /proc/lsn-ext-demo"),
    ],
    ids=["negative-threads", "db-with-mc-samples", "unwritable-out"],
)
def test_demo_refuses_before_training(args, message, capsys):
    start = time.process_time()
    with pytest.raises(SystemExit):
        main(["demo", *args])
    assert message in capsys.readouterr().err
    assert time.process_time() - start < 5  # refused up front, not after the training


@pytest.mark.slow
def test_quick_demo_with_rank_0_and_the_grid_search_prior(tmp_path, capsys):
    args = ["demo", "--quick", "--out", str(tmp_path), "--no-progress", "--ensemble", "0"]
    assert main([*args, "--rank", "0", "--prior", "nll"]) == 0
    out = capsys.readouterr().out
    assert "(validation NLL grid search)" in out
    assert (tmp_path / "figure.png").exists()


@pytest.mark.slow
def test_quick_demo_with_the_other_ssn_loss(tmp_path, capsys):
    args = ["demo", "--quick", "--out", str(tmp_path), "--no-progress", "--ensemble", "0"]
    other = "expected" if DemoConfig().ssn_loss == "logsumexp" else "logsumexp"
    assert main([*args, "--ssn-loss", other]) == 0
    assert (tmp_path / "table.md").read_text().startswith("| Model |")


def test_ssn_objective_is_the_chosen_loss_per_pixel():
    torch.manual_seed(0)
    from lsn_ext.demo import ssn_objective
    from lsn_ext.models import SSN, ssn_loss

    ssn = SSN.with_unet(1, widths=(4, 8), rank=2)
    x, y = torch.randn(2, 1, 8, 8), (torch.rand(2, 1, 8, 8) > 0.5).float()
    for objective in ("logsumexp", "expected"):
        torch.manual_seed(1)
        got = ssn_objective(ssn, x, y, objective)
        torch.manual_seed(1)
        want = ssn_loss(ssn.distribution(x), y, 20, objective=objective) / 64
        torch.testing.assert_close(got, want)
        torch.manual_seed(1)
        odd = ssn_objective(ssn, x, y, objective, n_samples=5)  # odd M: plain samples
        torch.manual_seed(1)
        plain = ssn_loss(ssn.distribution(x), y, 5, antithetic=False, objective=objective)
        torch.testing.assert_close(odd, plain / 64)


def test_demo_refuses_bad_prior_and_rank(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--prior", "laplace"])
    assert "invalid choice: 'laplace'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--rank", "-1"])
    assert "--rank >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prior must be one of \\['marglik', 'nll'\\]"):
        DemoConfig(prior="gridsearch")
    with pytest.raises(ValueError, match="rank must be >= 0"):
        DemoConfig(rank=-2)
    with pytest.raises(ValueError, match="ssn_loss must be 'logsumexp' or 'expected'"):
        DemoConfig(ssn_loss="mean")
    with pytest.raises(SystemExit):
        main(["demo", "--ssn-loss", "mean"])
    assert "invalid choice: 'mean'" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="use prior='nll'"):
        DemoConfig(estimator="db")


@pytest.fixture
def small_laplace():
    torch.manual_seed(0)
    x = torch.randn(8, 1, 16, 16)
    y = (x > 0.3).float()
    net = UNet(1, 1, widths=(4, 8))
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    return laplace_unet(net, loader, DemoConfig()), loader


def test_marglik_prior_maximises_the_marginal_likelihood(small_laplace):
    la, loader = small_laplace
    prior = tune_prior(la, loader, DemoConfig(prior="marglik"))
    assert la.prior_precision.numel() == 1
    assert float(la.prior_precision) == prior
    with torch.no_grad():
        lml = {f: la.log_marginal_likelihood(torch.tensor(prior * f)).item() for f in (0.5, 1, 2)}
    assert lml[1] >= max(lml[0.5], lml[2])
    assert prior != 1.0  # it moved from laplace-torch's start


def test_nll_prior_is_the_grid_point_of_lowest_validation_nll(small_laplace):
    la, loader = small_laplace
    prior = tune_prior(la, loader, DemoConfig(prior="nll"))
    grid = [10.0**k for k in range(-4, 9)]
    direct = gridsearch_prior_precision(la, loader, grid=grid, n_samples=8)
    assert prior == direct.prior_precision == grid[int(torch.as_tensor(direct.scores).argmin())]
    assert float(la.prior_precision) == prior
