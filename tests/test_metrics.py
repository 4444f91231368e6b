import math

import numpy as np
import pytest
import torch

from lsn_ext import metrics
from lsn_ext.data import random_flips
from lsn_ext.metrics import (
    auroc,
    average_precision,
    black_box,
    boundary_band,
    boundary_share,
    box_ratio,
    iou,
    noise_box,
    per_image_entropy,
    pixel_ratio,
    sample_boxes,
)


def test_pixel_ratio_by_hand():
    var_id = torch.tensor([[[[1.0, 1.0], [1.0, 1.0]]], [[[0.5, 0.0], [0.0, 0.5]]]])
    var_ood = torch.tensor([[[[2.0, 1.0], [1.0, 0.0]]], [[[1.0, 1.0], [1.0, 1.0]]]])
    torch.testing.assert_close(pixel_ratio(var_id, var_ood), torch.tensor([1.0, 4.0]))
    with pytest.raises(ValueError, match="differ in shape"):
        pixel_ratio(var_id, var_ood[:, :, :1])


def test_box_ratio_by_hand():
    var = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])  # [N, H, W]
    box = torch.tensor([[[True, False], [False, True]]])
    torch.testing.assert_close(box_ratio(var, box), torch.tensor([0.5]))
    # channels broadcast against a [N, 1, H, W] box
    var2 = torch.stack([var, 3 * var], 1)  # [1, 2, 2, 2]
    torch.testing.assert_close(box_ratio(var2, box.unsqueeze(1)), torch.tensor([0.5]))
    even = torch.ones(1, 1, 8, 8)
    b = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    b[..., :2, :4] = True
    torch.testing.assert_close(box_ratio(even, b), torch.tensor([8 / 64]))


@pytest.mark.parametrize("size", [64, 32, 128], ids=["64px", "32px", "128px"])
def test_boxes_follow_the_paper_scaled_to_the_image(size):
    boxes, masks = sample_boxes(500, size, generator=torch.Generator().manual_seed(0))
    top, left, side = boxes.T
    s = size / 64
    assert top.min() >= 0
    assert top.max() == round(40 * s)
    assert left.max() == round(40 * s)
    assert side.min() == round(10 * s)
    assert side.max() == round(20 * s)
    torch.testing.assert_close(masks.flatten(1).sum(1), side**2)
    i = 7
    t, lft, sd = boxes[i].tolist()
    assert masks[i, 0, t, lft]
    assert masks[i, 0, t + sd - 1, lft + sd - 1]
    if t + sd < size:
        assert not masks[i, 0, t + sd, lft]


def test_corruptions_change_only_the_box():
    images = torch.randn(6, 2, 32, 32)
    noisy, box = noise_box(images, generator=torch.Generator().manual_seed(1))
    outside = ~box.expand_as(images)
    torch.testing.assert_close(noisy[outside], images[outside])
    assert not torch.allclose(noisy[~outside], images[~outside])
    lo = images.flatten(1).amin(1).view(-1, 1, 1, 1).expand_as(images)
    hi = images.flatten(1).amax(1).view(-1, 1, 1, 1).expand_as(images)
    assert (noisy >= lo).all()
    assert (noisy <= hi).all()

    dark, box2 = black_box(images, -3.0, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(box2, box)  # same generator state -> same boxes
    assert (dark[box.expand_as(images)] == -3.0).all()
    torch.testing.assert_close(dark[outside], images[outside])
    default, _ = black_box(images, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(default[box.expand_as(images)], lo[box.expand_as(images)])
    with pytest.raises(ValueError, match="square"):
        noise_box(torch.zeros(1, 1, 8, 16))


def test_auroc_by_hand():
    assert auroc(torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.4])) == 1.0
    assert auroc(torch.tensor([0.3, 0.4]), torch.tensor([0.1, 0.2])) == 0.0
    # pairs (ood > id): 0.5>0.1, 0.5>0.4, 0.2>0.1, 0.2<0.4 -> 3/4; a tie counts half
    assert auroc(torch.tensor([0.1, 0.4]), torch.tensor([0.5, 0.2])) == 0.75
    assert auroc(torch.tensor([0.1, 0.4]), torch.tensor([0.4, 0.2])) == pytest.approx(0.625)
    with pytest.raises(ValueError, match="at least one"):
        auroc(torch.tensor([]), torch.tensor([1.0]))


def test_iou_and_entropy_by_hand():
    p = torch.tensor([[1, 1, 0, 0]])
    t = torch.tensor([[1, 0, 1, 0]])
    assert iou(p, t) == pytest.approx(1 / 3)
    assert iou(torch.zeros(3), torch.zeros(3)) == 1.0
    entropy = torch.tensor([[[0.0, 1.0], [2.0, 3.0]], [[1.0, 1.0], [1.0, 1.0]]])
    torch.testing.assert_close(per_image_entropy(entropy), torch.tensor([1.5, 1.0]))


def _average_precision_by_thresholds(scores, labels):
    """Reference: precision at every distinct threshold, weighted by the recall gained there."""
    s, y = scores.flatten().tolist(), labels.flatten().tolist()
    n_pos, ap, prev_recall = sum(y), 0.0, 0.0
    for t in sorted(set(s), reverse=True):
        chosen = [yi for si, yi in zip(s, y, strict=True) if si >= t]
        recall = sum(chosen) / n_pos
        ap += (recall - prev_recall) * sum(chosen) / len(chosen)
        prev_recall = recall
    return ap


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_average_precision_matches_the_threshold_definition(ties):
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(200, generator=gen)
    if ties:
        scores = (scores * 8).floor()
    labels = torch.rand(200, generator=gen) < 0.3 + 0.4 * (scores / scores.max())
    expected = _average_precision_by_thresholds(scores, labels)
    assert metrics.average_precision(scores, labels) == pytest.approx(expected, abs=1e-12)
    assert metrics.average_precision(labels.double(), labels) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="positive"):
        metrics.average_precision(scores, torch.zeros(200, dtype=torch.bool))


def test_boundary_band_is_the_ring_around_the_boundary():
    mask = torch.zeros(1, 1, 12, 12)
    mask[0, 0, 3:9, 3:9] = 1
    band = metrics.boundary_band(mask, 1)
    expected = torch.zeros(12, 12, dtype=torch.bool)
    expected[2:10, 2:10] = True
    expected[4:8, 4:8] = False
    assert torch.equal(band[0, 0], expected)
    assert not metrics.boundary_band(torch.ones(1, 1, 6, 6), 2).any()
    share, pixels = metrics.boundary_share(band.double() + 0.0, mask, 1)
    assert share == pytest.approx(1.0)
    assert pixels == pytest.approx(expected.double().mean().item())


@pytest.mark.parametrize(
    "variance",
    [torch.zeros(1, 1, 6, 6), torch.full((1, 1, 6, 6), float("nan")), torch.ones(1, 1, 6, 5)],
    ids=["zero-map", "nan-map", "wrong-shape"],
)
def test_boundary_share_refuses_maps_without_a_share(variance):
    mask = torch.zeros(1, 1, 6, 6)
    mask[0, 0, 2:4, 2:4] = 1
    with pytest.raises(ValueError, match=r"boundary_share|differ|NaN or inf"):
        metrics.boundary_share(variance, mask)


# ----------------------------------------------------------------------------------------------
# Failure detection and calibration, against independent references (float64)


def _pixels(n=3000, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g, dtype=torch.float64)
    if ties:
        p = (p * 20).round() / 20  # many tied values, including exactly 0.5
    y = torch.rand(n, generator=g, dtype=torch.float64) < p  # roughly calibrated
    return p, y


@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_roc_auc_and_average_precision_match_scikit_learn(ties):
    sk = pytest.importorskip("sklearn.metrics")
    p, y = _pixels(ties=ties)
    assert metrics.roc_auc(p, y) == pytest.approx(sk.roc_auc_score(y.numpy(), p.numpy()), abs=1e-12)
    assert metrics.average_precision(p, y) == pytest.approx(
        sk.average_precision_score(y.numpy(), p.numpy()), abs=1e-12
    )
    # the all-pairs Mann–Whitney of auroc() agrees as well
    assert metrics.roc_auc(p, y) == pytest.approx(auroc(p[~y], p[y]), abs=1e-12)
    # 2-D inputs and 0/1 float labels give the same number
    assert metrics.roc_auc(p.view(60, 50), y.double().view(60, 50)) == metrics.roc_auc(p, y)


def test_nll_and_brier_match_scikit_learn():
    sk = pytest.importorskip("sklearn.metrics")
    p, y = _pixels(seed=1)
    assert metrics.binary_nll(p, y) == pytest.approx(
        sk.log_loss(y.numpy(), p.clamp(1e-7, 1 - 1e-7).numpy()), rel=1e-12
    )
    assert metrics.brier_score(p, y) == pytest.approx(
        sk.brier_score_loss(y.numpy(), p.numpy()), rel=1e-12
    )


def _ece_brute_force(p, y, n_bins=15):
    p, y = p.numpy(), y.numpy()
    conf = np.maximum(p, 1 - p)
    correct = (p > 0.5) == y
    total = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        inside = (conf > lo) & (conf <= hi) if b else (conf >= lo) & (conf <= hi)
        if inside.any():
            total += inside.mean() * abs(correct[inside].mean() - conf[inside].mean())
    return total


@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_ece_matches_a_loop_over_bins(ties):
    p, y = _pixels(seed=2, ties=ties)
    assert metrics.expected_calibration_error(p, y) == pytest.approx(
        _ece_brute_force(p, y), abs=1e-12
    )
    # perfectly confident and right: 0; confident and wrong on a quarter: 0.25
    y = torch.tensor([1, 0, 1, 0])
    assert metrics.expected_calibration_error(y.double(), y) == 0.0
    wrong = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert metrics.expected_calibration_error(wrong, y) == pytest.approx(0.25)


def _aurc_brute_force(u, r):
    order = np.argsort(u.numpy(), kind="stable")
    rs = r.numpy()[order]
    return np.mean([rs[:k].mean() for k in range(1, len(rs) + 1)])


def test_aurc_oracle_and_risk_coverage():
    g = torch.Generator().manual_seed(3)
    u = torch.rand(40, generator=g, dtype=torch.float64)
    r = (u + 0.5 * torch.rand(40, generator=g, dtype=torch.float64)).clamp(0, 1)
    assert metrics.aurc(u, r) == pytest.approx(_aurc_brute_force(u, r), abs=1e-12)
    assert metrics.oracle_aurc(r) == pytest.approx(_aurc_brute_force(r, r), abs=1e-12)
    assert metrics.oracle_aurc(r) <= metrics.aurc(u, r) <= metrics.aurc(-u, r)
    cov, risk = metrics.risk_coverage(u, r)
    torch.testing.assert_close(cov[-1], torch.tensor(1.0, dtype=torch.float64))
    assert risk[-1].item() == pytest.approx(r.mean().item())
    # by hand: risks 0, 1 ranked right and wrong
    assert metrics.aurc(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])) == 0.25
    assert metrics.aurc(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 0.75


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 6, (50,), generator=g).double()
    y = x + torch.randn(50, generator=g, dtype=torch.float64)
    assert metrics.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert metrics.spearman(x, -x) == pytest.approx(-1.0)


def test_dice_per_image_conventions():
    pred = torch.zeros(3, 1, 4, 4, dtype=torch.bool)
    target = torch.zeros(3, 1, 4, 4)
    pred[1, 0, :2] = True  # 8 pixels predicted, 4 right
    target[1, 0, 0] = 1.0
    target[1, 0, 3] = 1.0
    target[2, 0, 0, 0] = 1.0  # missed entirely
    d = metrics.dice_per_image(pred, target)
    torch.testing.assert_close(d, torch.tensor([1.0, 2 * 4 / 16, 0.0], dtype=torch.float64))


@pytest.mark.parametrize(
    ("fn", "args", "match"),
    [
        (metrics.roc_auc, (torch.rand(5), torch.rand(5)), "binary"),
        (metrics.roc_auc, (torch.rand(5), torch.ones(5)), "both classes"),
        (metrics.roc_auc, (torch.rand(5), torch.ones(4)), "shape"),
        (metrics.roc_auc, (torch.tensor([0.1, float("nan")]), torch.tensor([0, 1])), "finite"),
        (
            metrics.expected_calibration_error,
            (torch.tensor([1.5, 0.2]), torch.tensor([1, 0])),
            r"\[0, 1\]",
        ),
        (metrics.binary_nll, (torch.rand(3), torch.tensor([0.0, 0.3, 1.0])), "threshold"),
        (metrics.brier_score, (torch.rand(3, 2), torch.ones(2, 3)), "shape"),
        (metrics.aurc, (torch.rand(3), torch.rand(4)), "same length"),
        (metrics.aurc, (torch.rand(2, 2), torch.rand(2, 2)), "1-D"),
        (metrics.oracle_aurc, (torch.tensor([0.1, float("inf")]),), "finite"),
        (metrics.spearman, (torch.ones(4), torch.rand(4)), "constant"),
        (metrics.dice_per_image, (torch.rand(2, 4), torch.ones(2, 4)), "binary"),
        (metrics.dice_per_image, (torch.ones(2, 4), torch.ones(2, 5)), "differ"),
    ],
)
def test_failure_metrics_refuse_bad_inputs(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def _box_mask(n: int = 1, size: int = 8) -> torch.Tensor:
    box = torch.zeros(n, 1, size, size, dtype=torch.bool)
    box[:, :, 2:4, 2:4] = True
    return box


# Each call gave a silently wrong number (or an obscure error) before: the cases of the second
# hardening round.
BAD_METRIC_CALLS = {
    "iou-probabilities": (
        lambda: iou(torch.full((1, 4), 0.3), torch.ones(1, 4)),
        r"prediction must be binary .* threshold",
    ),
    "iou-soft-labels": (
        lambda: iou(torch.ones(1, 4), torch.full((1, 4), 0.5)),
        r"target must be binary",
    ),
    "average-precision-soft-labels": (
        lambda: average_precision(torch.rand(4), torch.tensor([0, 0, 0.5, 1.0])),
        r"labels must be binary",
    ),
    "average-precision-nan-score": (
        lambda: average_precision(torch.tensor([0.1, float("nan"), 0.3]), torch.tensor([0, 1, 1])),
        r"scores must be finite",
    ),
    "average-precision-inf-score": (  # +inf was ranked as the top score
        lambda: average_precision(torch.tensor([0.1, math.inf, 0.3]), torch.tensor([0, 1, 1])),
        r"scores must be finite",
    ),
    "auroc-nan-score": (
        lambda: auroc(torch.tensor([0.1, float("nan")]), torch.tensor([0.5])),
        r"scores_id must be finite",
    ),
    "auroc-inf-score": (
        lambda: auroc(torch.tensor([0.1, 0.2]), torch.tensor([math.inf])),
        r"scores_ood must be finite",
    ),
    "box-ratio-zero-map": (
        lambda: box_ratio(torch.zeros(1, 1, 8, 8), _box_mask()),
        r"image 0 is zero everywhere: its Box Ratio is undefined",
    ),
    "box-ratio-batch-mismatch": (
        lambda: box_ratio(torch.rand(1, 1, 8, 8), _box_mask(3)),
        r"box masks \(3, 1, 8, 8\) do not match the variance maps \(1, 1, 8, 8\)",
    ),
    "box-ratio-other-size": (
        lambda: box_ratio(torch.rand(2, 1, 8, 8), _box_mask(2, 6)),
        r"one mask of the image's size per map",
    ),
    "pixel-ratio-zero-clean-map": (
        lambda: pixel_ratio(torch.zeros(2, 1, 4, 4), torch.rand(2, 1, 4, 4)),
        r"var_id of image 0 is zero everywhere",
    ),
    "pixel-ratio-negative": (
        lambda: pixel_ratio(torch.rand(1, 1, 4, 4), -torch.rand(1, 1, 4, 4)),
        r"var_ood has negative entries",
    ),
    "boundary-share-negative": (
        lambda: boundary_share(-torch.rand(1, 1, 8, 8), _box_mask().double()),
        r"variance has negative entries",
    ),
    "boundary-band-float-width": (
        lambda: boundary_band(_box_mask(), 1.5),
        r"width must be an int of at least 1 \(pixels\), got 1.5",
    ),
    "boundary-band-2d-mask": (
        lambda: boundary_band(_box_mask()[0, 0]),
        r"expected masks \[N, 1, H, W\] or \[N, H, W\], got shape \(8, 8\)",
    ),
    "noise-box-integer-images": (
        lambda: noise_box(torch.randint(0, 255, (1, 3, 16, 16))),
        r"noise_box needs floating images .* torch.int64",
    ),
    "per-image-entropy-1d": (
        lambda: per_image_entropy(torch.rand(5)),
        r"a \[N\] tensor is already one value per image",
    ),
    "random-flips-mismatched-batches": (
        lambda: random_flips(torch.rand(2, 1, 8, 8), torch.rand(3, 1, 8, 8)),
        r"same batch size and image size",
    ),
}


@pytest.mark.parametrize("case", BAD_METRIC_CALLS.values(), ids=BAD_METRIC_CALLS.keys())
def test_bad_metric_inputs_get_a_clear_error(case):
    call, match = case
    with pytest.raises(ValueError, match=match):
        call()


def test_valid_inputs_still_give_the_documented_values():
    assert iou(torch.tensor([[1, 1, 0, 0]]), torch.tensor([[1.0, 0.0, 0.0, 0.0]])) == 0.5
    assert iou(torch.zeros(1, 4, dtype=torch.bool), torch.zeros(1, 4)) == 1.0
    assert average_precision(torch.tensor([0.9, 0.1]), torch.tensor([True, False])) == 1.0
    var = torch.zeros(1, 1, 8, 8)
    var[..., 2:4, 2:4] = 1.0
    torch.testing.assert_close(box_ratio(var, _box_mask()), torch.ones(1, dtype=var.dtype))
