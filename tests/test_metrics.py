import pytest
import torch

from lsn_ext import metrics
from lsn_ext.metrics import (
    auroc,
    black_box,
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
    with pytest.raises(ValueError, match=r"boundary_share|differ"):
        metrics.boundary_share(variance, mask)
