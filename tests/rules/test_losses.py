import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy, as_loss
from tests.reference import dense_block, loss_hessian_dense

TOL = {"rtol": 1e-10, "atol": 1e-12}


def check_hessians(loss, f, y):
    """hessian_diag (and hessian_block) against torch.func.hessian of loss.value."""
    H = loss_hessian_dense(lambda g: loss.value(g, y), f)
    torch.testing.assert_close(loss.hessian_diag(f, y).reshape(-1), H.diagonal(), **TOL)
    block = loss.hessian_block(f, y)
    if block is None:
        torch.testing.assert_close(H, torch.diag(H.diagonal()), **TOL)
    else:
        assert block.shape == (f.shape[0], f.shape[1], *f.shape[1:])
        torch.testing.assert_close(dense_block(block, f.shape), H, **TOL)


BCE_CASES = {
    "plain": (lambda: BCEWithLogits(), (2, 1, 3, 3)),
    "pos-weight": (lambda: BCEWithLogits(pos_weight=3.0), (2, 1, 3, 3)),
    "pos-weight-per-channel": (
        lambda: BCEWithLogits(pos_weight=torch.tensor([1.0, 4.0]).reshape(2, 1, 1)),
        (2, 2, 3, 3),
    ),
    "element-weight-mean": (
        lambda: BCEWithLogits(weight=torch.rand(1, 1, 3, 3), reduction="mean"),
        (2, 1, 3, 3),
    ),
}


@pytest.mark.parametrize("case", BCE_CASES.values(), ids=BCE_CASES.keys())
def test_bce_hessian_matches_autograd(case):
    make, shape = case
    loss = make()
    f = 3 * torch.randn(shape)
    y = (torch.rand(shape) > 0.5).double()
    check_hessians(loss, f, y)


def test_bce_accepts_targets_without_channel_dim():
    f, y = torch.randn(2, 1, 3, 3), (torch.rand(2, 3, 3) > 0.5).double()
    loss = BCEWithLogits(pos_weight=2.0)
    expected = F.binary_cross_entropy_with_logits(
        f, y[:, None], pos_weight=torch.tensor(2.0), reduction="sum"
    )
    torch.testing.assert_close(loss.value(f, y), expected)
    assert loss.hessian_diag(f, y).shape == f.shape


CE_CASES = {
    "plain-nk": (lambda: CrossEntropy(), (4, 3)),
    "spatial": (lambda: CrossEntropy(), (2, 3, 2, 2)),
    "weights-ignore": (lambda: CrossEntropy(weight=torch.tensor([0.5, 2.0, 1.0])), (2, 3, 2, 2)),
    "mean": (
        lambda: CrossEntropy(weight=torch.tensor([0.5, 2.0, 1.0]), reduction="mean"),
        (2, 3, 2),
    ),
    "label-smoothing": (lambda: CrossEntropy(label_smoothing=0.2), (2, 3, 2)),
}


@pytest.mark.parametrize("case", CE_CASES.values(), ids=CE_CASES.keys())
def test_cross_entropy_hessian_matches_autograd(case):
    make, shape = case
    loss = make()
    f = 2 * torch.randn(shape)
    y = torch.randint(0, shape[1], (shape[0], *shape[2:]))
    y.view(-1)[0] = -100
    check_hessians(loss, f, y)
    assert loss.hessian_diag(f, y).reshape(shape[0], shape[1], -1)[0, :, 0].abs().max() == 0


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_mse_hessian_matches_autograd(reduction):
    check_hessians(MSE(reduction), torch.randn(2, 2, 3), torch.randn(2, 2, 3))
    check_hessians(as_loss(nn.MSELoss(reduction=reduction)), torch.randn(3, 2), torch.randn(3, 2))


def test_as_loss_keeps_torch_options():
    ce = as_loss(nn.CrossEntropyLoss(weight=torch.ones(3), ignore_index=5, reduction="sum"))
    assert isinstance(ce, CrossEntropy)
    assert ce.ignore_index == 5
    assert ce.reduction == "sum"
    bce = as_loss(nn.BCEWithLogitsLoss(pos_weight=torch.tensor(2.0)))
    assert isinstance(bce, BCEWithLogits)
    assert bce.pos_weight == 2.0
    assert bce.reduction == "mean"
    assert isinstance(as_loss("BCE"), BCEWithLogits)


@pytest.mark.parametrize(
    ("call", "err", "pattern"),
    [
        (lambda: as_loss(nn.L1Loss()), TypeError, "unsupported loss L1Loss"),
        (lambda: as_loss(42), TypeError, "unsupported loss 42"),
        (lambda: BCEWithLogits(pos_weight=-1.0), ValueError, "pos_weight must be positive"),
        (lambda: CrossEntropy(weight=torch.ones(2, 2)), ValueError, "1-D tensor"),
        (
            lambda: CrossEntropy(weight=torch.ones(2), label_smoothing=0.1),
            ValueError,
            "label_smoothing together with class weights",
        ),
        (lambda: MSE(reduction="none"), ValueError, "reduction must be 'sum' or 'mean'"),
        (
            lambda: BCEWithLogits().value(torch.zeros(2, 2, 3), torch.zeros(2, 3)),
            ValueError,
            r"BCE targets of shape \(2, 3\) do not match logits of shape \(2, 2, 3\)",
        ),
        (
            lambda: BCEWithLogits().value(torch.zeros(2, 1), torch.full((2, 1), 2.0)),
            ValueError,
            r"must lie in \[0, 1\]; found 2.0",
        ),
        (
            lambda: CrossEntropy().value(torch.zeros(2, 3, 4), torch.zeros(2, 4)),
            ValueError,
            "integer class indices",
        ),
        (
            lambda: CrossEntropy(weight=torch.ones(2)).value(
                torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
            ),
            ValueError,
            "weight has 2 entries but the logits 3 classes",
        ),
        (
            lambda: MSE().value(torch.zeros(2, 3), torch.zeros(3, 2)),
            ValueError,
            "MSE targets of shape",
        ),
    ],
    ids=[
        "l1-loss",
        "not-a-loss",
        "negative-pos-weight",
        "2d-class-weight",
        "smoothing-with-weights",
        "reduction-none",
        "bce-shape",
        "bce-range",
        "ce-float-targets",
        "ce-weight-size",
        "mse-shape",
    ],
)
def test_loss_errors(call, err, pattern):
    with pytest.raises(err, match=pattern):
        call()
