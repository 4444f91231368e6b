"""``predict(..., window=SlidingWindow(...))``: the maps of every draw's blended logits, checked
against MONAI's sliding-window inference run draw by draw, and against whole-image prediction
where one window covers the image."""

import sys

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import DiagBackprop, SlidingWindow, predict
from lsn_ext._laplace import Laplace
from tests.model_state import assert_unchanged, snapshot

inferers = pytest.importorskip("monai.inferers")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv3d(4, 4, 3, padding=1), nn.Tanh(),
        nn.Conv3d(4, 1, 1),
    ).eval()  # fmt: skip


@pytest.fixture(scope="module")
def la():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net = _net()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, 1, 8, 8, 8, generator=g)
        y = (torch.rand(4, 1, 8, 8, 8, generator=g) > 0.5).double()
        la = Laplace(
            net,
            "classification",
            subset_of_weights="all",
            hessian_structure="diag",
            backend=DiagBackprop,
            backend_kwargs={"loss": "bce", "estimator": "db"},
            prior_precision=5.0,
        )
        la.fit(DataLoader(TensorDataset(x, y), batch_size=2))
    finally:
        torch.set_default_dtype(dtype)
    return la


def _volume() -> torch.Tensor:
    return torch.randn(1, 1, 13, 11, 9, generator=torch.Generator().manual_seed(2))


def test_one_window_over_the_whole_image_equals_whole_image_prediction(la):
    x = _volume()
    window = SlidingWindow((13, 11, 9), overlap=0.0, mode="constant")
    for pred_type in ("nn", "glm"):
        whole = predict(la, x, 6, pred_type=pred_type, generator=torch.Generator().manual_seed(3))
        slid = predict(
            la, x, 6, pred_type=pred_type, window=window, generator=torch.Generator().manual_seed(3)
        )
        for name in ("mean", "variance", "entropy", "mutual_information", "logit_mean"):
            torch.testing.assert_close(getattr(slid, name), getattr(whole, name), msg=name)


@pytest.mark.parametrize("mode", ["gaussian", "constant"])
def test_overlapping_windows_give_the_maps_of_each_draws_blended_logits(la, mode):
    x = _volume()
    window = SlidingWindow((6, 6, 6), overlap=0.5, mode=mode, sw_batch_size=3)
    n = 5
    got = predict(la, x, n, window=window, generator=torch.Generator().manual_seed(4))
    thetas = la.sample(n, generator=torch.Generator().manual_seed(4))
    names = [k for k, p in la.model.named_parameters() if p.requires_grad]
    shapes = [p.shape for _, p in la.model.named_parameters() if p.requires_grad]
    probs = []
    for theta in thetas:
        params = dict(
            zip(
                names,
                (
                    t.view(s)
                    for t, s in zip(theta.split([s.numel() for s in shapes]), shapes, strict=True)
                ),
                strict=True,
            )
        )
        f = inferers.sliding_window_inference(
            x, (6, 6, 6), 3, lambda w, p=params: functional_call(la.model, p, (w,)),
            overlap=0.5, mode=mode,
        )  # fmt: skip
        probs.append(torch.sigmoid(f))
    probs = torch.stack(probs)
    torch.testing.assert_close(got.mean, probs.mean(0))
    torch.testing.assert_close(got.variance, probs.var(0))
    assert got.variance.max() > 0
    # where windows overlap, the variance is not the blend of per-window variances
    whole = predict(la, x, n, generator=torch.Generator().manual_seed(4))
    assert not torch.allclose(got.variance, whole.variance)


def test_glm_over_windows_is_linearised_at_the_blended_map_logits(la):
    x = _volume()
    window = SlidingWindow((6, 6, 6), overlap=0.5)
    got = predict(la, x, 4, pred_type="glm", window=window)
    with torch.no_grad():
        f_map = inferers.sliding_window_inference(
            x, (6, 6, 6), 1, la.model, overlap=0.5, mode="gaussian"
        )
    torch.testing.assert_close(got.logit_mean, f_map)
    assert got.logit_variance.min() > 0


def test_model_left_as_found(la):
    snap = snapshot(la.model)
    predict(la, _volume(), 2, window=SlidingWindow((6, 6, 6)))
    assert_unchanged(la.model, snap)


BAD = {
    "zero-size": (lambda: SlidingWindow((0, 4, 4)), r"roi_size must be positive ints"),
    "float-size": (lambda: SlidingWindow((4.0, 4, 4)), r"roi_size must be positive ints"),
    "overlap-one": (lambda: SlidingWindow((4, 4, 4), overlap=1.0), r"overlap must lie in"),
    "mode": (lambda: SlidingWindow((4, 4, 4), mode="mean"), r"mode must be one of"),
    "batch": (lambda: SlidingWindow((4, 4, 4), sw_batch_size=0), r"sw_batch_size must be"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_settings_are_refused(case):
    make, pattern = case
    with pytest.raises(ValueError, match=pattern):
        make()


def test_window_of_the_wrong_rank_is_refused(la):
    with pytest.raises(ValueError, match=r"roi_size \(6, 6\) has 2 entries but the input"):
        predict(la, _volume(), 2, window=SlidingWindow((6, 6)))


def test_missing_monai_is_named(la, monkeypatch):
    monkeypatch.setitem(sys.modules, "monai.inferers", None)
    with pytest.raises(ImportError, match="pip install monai"):
        predict(la, _volume(), 2, window=SlidingWindow((6, 6, 6)))


@pytest.mark.parametrize("size", [(6, 6, 6), [6, 6, 6]], ids=["tuple", "list"])
def test_a_window_size_is_a_sliding_window_with_the_default_settings(la, size):
    """``window=(8, 8)`` raised ``TypeError: 'tuple' object is not callable``."""
    x = _volume()
    got = predict(la, x, 4, window=size, generator=torch.Generator().manual_seed(5))
    want = predict(
        la, x, 4, window=SlidingWindow((6, 6, 6)), generator=torch.Generator().manual_seed(5)
    )
    torch.testing.assert_close(got.mean, want.mean, rtol=0, atol=0)
    torch.testing.assert_close(got.variance, want.variance, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("window", "error", "pattern"),
    [
        (6, TypeError, r"window must be an lsn_ext.SlidingWindow or a window size.*got int 6"),
        ("gaussian", TypeError, r"window must be .*got str 'gaussian'"),
        ((6, 6), ValueError, r"roi_size \(6, 6\) has 2 entries but the input"),
        ((6.0, 6, 6), ValueError, r"roi_size must be positive ints"),
    ],
    ids=["int", "str", "wrong-rank-tuple", "float-tuple"],
)
def test_other_windows_are_refused_by_type_or_size(la, window, error, pattern):
    with pytest.raises(error, match=pattern):
        predict(la, _volume(), 2, window=window)
