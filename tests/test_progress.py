"""``progress_bar=`` of ``predict``, ``fit_lsn`` and ``predict_lsn``: tqdm bars on stderr when
on, nothing on stderr when off (the default), and the same numbers bit for bit either way."""

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import DiagBackprop, SlidingWindow, predict
from lsn_ext._laplace import Laplace
from lsn_ext.laplace_ext import DiagLastLayerLaplace
from lsn_ext.lsn import fit_lsn, predict_lsn
from lsn_ext.models import SSN

MAPS = ("mean", "variance", "entropy", "mutual_information", "logit_mean", "logit_variance")


def _fitted(la, x: torch.Tensor, y: torch.Tensor):
    la.fit(DataLoader(TensorDataset(x, y), batch_size=2))
    return la


@pytest.fixture(scope="module")
def posteriors() -> dict[str, Laplace]:
    """A 3-D conv net (all weights and last layer) on 8³ volumes, binary masks, float64."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv3d(1, 3, 3, padding=1), nn.Tanh(), nn.Conv3d(3, 1, 1)
        ).eval()  # fmt: skip
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, 1, 8, 8, 8, generator=g)
        y = (torch.rand(4, 1, 8, 8, 8, generator=g) > 0.5).double()
        options = {"backend_kwargs": {"loss": "bce"}, "prior_precision": 5.0}
        every_weight = Laplace(
            net, "classification", subset_of_weights="all", hessian_structure="diag",
            backend=DiagBackprop, **options,
        )  # fmt: skip
        return {
            "all": _fitted(every_weight, x, y),
            "last-layer": _fitted(DiagLastLayerLaplace(net, "classification", **options), x, y),
        }
    finally:
        torch.set_default_dtype(dtype)


def _volume() -> torch.Tensor:
    return torch.randn(1, 1, 9, 8, 7, generator=torch.Generator().manual_seed(2))


def _window_batches_per_pass(window: SlidingWindow, x: torch.Tensor) -> int:
    """How often one sliding-window pass calls the network (counted here, independently)."""
    calls = []
    window(lambda batch: calls.append(1) or torch.zeros(batch.shape[0], 1, *batch.shape[2:]), x)
    return len(calls)


CASES = {
    "nn": ("all", "nn", None, "posterior draws", "6/6"),
    "glm": ("all", "glm", None, "antithetic pairs", "3/3"),
    "nn-window": ("all", "nn", (6, 6, 6), "posterior draws", "6/6"),
    "glm-window": ("all", "glm", (6, 6, 6), "antithetic pairs", "3/3"),
    "last-layer-nn": ("last-layer", "nn", None, "posterior draws", "6/6"),
    "last-layer-glm": ("last-layer", "glm", None, "antithetic pairs", "3/3"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_predict_progress_bar_on_stderr_and_the_same_maps(posteriors, case, capsys, one_thread):
    subset, pred_type, roi, unit, done = case
    la, x = posteriors[subset], _volume()
    window = None if roi is None else SlidingWindow(roi, overlap=0.25, sw_batch_size=2)

    def run(progress_bar: bool):
        generator = torch.Generator().manual_seed(3)
        return predict(
            la, x, 6, pred_type=pred_type, generator=generator, window=window,
            progress_bar=progress_bar,
        )  # fmt: skip

    off = run(False)
    assert capsys.readouterr().err == ""
    on = run(True)
    err = capsys.readouterr().err
    assert re.search(rf"predict: {unit}: 100%.*{done}", err), err
    if window is None:
        assert "windows" not in err
    else:
        batches = _window_batches_per_pass(window, x)
        assert batches > 1
        assert f"windows:   0%|          | 0/{batches}" in err, err  # known after one pass
    for name in MAPS:
        assert torch.equal(getattr(on, name), getattr(off, name)), name


def test_predict_progress_bar_is_off_by_default(posteriors, capsys):
    predict(posteriors["all"], _volume(), 4, window=(6, 6, 6))
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def ssn_data():
    """An (untrained) binary SSN on 8×8 images, float64: the fit and the maps are what count."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        ssn = SSN.with_unet(1, widths=(3, 4), rank=2, eps=1e-4).eval()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, 1, 8, 8, generator=g)
        y = (torch.rand(4, 1, 8, 8, generator=g) > 0.5).double()
        return ssn, x, y
    finally:
        torch.set_default_dtype(dtype)


def _curvature(la) -> torch.Tensor:
    """The fitted curvature: the diagonal, or the dense matrix of the Kronecker factors."""
    return la.H if isinstance(la.H, torch.Tensor) else la.H.to_matrix()


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_fit_lsn_progress_bar_on_stderr_and_the_same_posterior(ssn_data, structure, capsys):
    ssn, x, y = ssn_data
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    off = fit_lsn(ssn, loader, hessian_structure=structure, estimator="db", progress_bar=False)
    assert capsys.readouterr().err == ""
    on = fit_lsn(ssn, loader, hessian_structure=structure, estimator="db", progress_bar=True)
    err = capsys.readouterr().err
    assert "[Computing Hessian]: 100%" in err, err
    assert "2/2" in err  # one step per batch
    assert torch.equal(_curvature(on), _curvature(off))


def test_predict_lsn_progress_bar_on_stderr_and_the_same_maps(ssn_data, capsys):
    ssn, x, y = ssn_data
    la = fit_lsn(ssn, DataLoader(TensorDataset(x, y), batch_size=2), estimator="db")
    off = predict_lsn(la, ssn, x[:2], 4, 3, seed=1)
    assert capsys.readouterr().err == ""
    on = predict_lsn(la, ssn, x[:2], 4, 3, seed=1, progress_bar=True)
    err = capsys.readouterr().err
    assert re.search(r"predict: posterior draws: 100%.*4/4", err), err
    assert re.search(r"predict_lsn: total maps: 100%.*4/4", err), err
    for name in ("aleatoric_mean", "aleatoric", "total_mean", "total", "entropy"):
        assert torch.equal(getattr(on, name), getattr(off, name)), name
    for name in ("mean", "variance", "entropy", "mutual_information"):
        assert torch.equal(getattr(on.epistemic, name), getattr(off.epistemic, name)), name
