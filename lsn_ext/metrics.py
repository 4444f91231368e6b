"""Segmentation and out-of-distribution measures of the LSN paper (§4.4), and its corruptions.

Shape legend: ``N`` images, ``K`` logit channels, ``H``/``W`` height and width. Variance maps are
``[N, K, H, W]`` (or ``[N, H, W]``); sums run over everything but the batch axis.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "auroc",
    "average_precision",
    "black_box",
    "boundary_band",
    "boundary_share",
    "box_ratio",
    "iou",
    "noise_box",
    "per_image_entropy",
    "pixel_ratio",
    "sample_boxes",
]


def _per_image_sum(x: Tensor) -> Tensor:
    return x.flatten(1).sum(1)


def pixel_ratio(var_id: Tensor, var_ood: Tensor) -> Tensor:
    """Pixel Ratio (LSN Eq. 16): ``Σ_s Var σ(η_s(x_OOD)) / Σ_s Var σ(η_s(x))`` per image.

    Args:
        var_id: Variance maps of the clean images ``x``, ``[N, …]``.
        var_ood: Variance maps of their corrupted versions, same shape.

    Returns:
        ``[N]``; values above 1 mean more variance on the corrupted image.

    Raises:
        ValueError: If the shapes differ.
    """
    if var_id.shape != var_ood.shape:
        raise ValueError(
            f"variance maps differ in shape: {tuple(var_id.shape)} vs {tuple(var_ood.shape)}"
        )
    return _per_image_sum(var_ood) / _per_image_sum(var_id)


def box_ratio(var_ood: Tensor, box: Tensor) -> Tensor:
    """Box Ratio (LSN Eq. 17): ``Σ_{k ∈ box} Var σ(η_k) / Σ_s Var σ(η_s)`` per corrupted image.

    For comparison: a variance spread uniformly over the image gives the box's area fraction.

    Args:
        var_ood: Variance maps of the corrupted images, ``[N, K, H, W]`` or ``[N, H, W]``.
        box: Boolean masks of the corrupted pixels, ``[N, 1, H, W]`` or ``[N, H, W]``
            (broadcast over the channels).

    Returns:
        ``[N]`` in ``[0, 1]``.
    """
    if var_ood.dim() == 3:
        var_ood = var_ood.unsqueeze(1)
    if box.dim() == 3:
        box = box.unsqueeze(1)
    inside = var_ood * box.to(var_ood.dtype)
    return _per_image_sum(inside) / _per_image_sum(var_ood)


def sample_boxes(
    n: int, size: int, *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Random square boxes as in LSN §4.4, scaled to the image side.

    For 64×64 images the paper draws the corner uniformly from ``[0, 40]²`` and the side
    uniformly from ``[10, 20]`` (integers, inclusive); for side ``S`` these become
    ``[0, round(40 S/64)]`` and ``[round(10 S/64), round(20 S/64)]``.

    Args:
        n: Number of boxes.
        size: Image side ``S`` (square images).
        generator: Random generator.

    Returns:
        ``(boxes, masks)``: ``[n, 3]`` integer ``(top, left, side)`` and ``[n, 1, S, S]``
        boolean masks of the boxes.

    Raises:
        ValueError: If the image is too small for a box of at least one pixel.
    """
    lo, hi, pos = round(10 * size / 64), round(20 * size / 64), round(40 * size / 64)
    if lo < 1:
        raise ValueError(f"images of side {size} are too small for LSN boxes (need >= 4)")
    top_left = torch.randint(0, pos + 1, (n, 2), generator=generator)
    side = torch.randint(lo, hi + 1, (n, 1), generator=generator)
    boxes = torch.cat([top_left, side], 1)
    rows = torch.arange(size)
    masks = torch.zeros(n, 1, size, size, dtype=torch.bool)
    for i, (t, left, s) in enumerate(boxes.tolist()):
        inside_r = (rows >= t) & (rows < t + s)
        inside_c = (rows >= left) & (rows < left + s)
        masks[i, 0] = inside_r[:, None] & inside_c[None, :]
    return boxes, masks


def noise_box(images: Tensor, *, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """White-noise box corruption: the pixels of a random box become uniform noise.

    The noise is i.i.d. uniform between the image's minimum and maximum (per image, all
    channels), so it covers the image's intensity range.

    Args:
        images: ``[N, C, S, S]``.
        generator: Random generator (boxes, then noise).

    Returns:
        ``(corrupted, box_masks)``: ``[N, C, S, S]`` and ``[N, 1, S, S]`` booleans.
    """
    _, masks = sample_boxes(images.shape[0], _side(images), generator=generator)
    lo = images.flatten(1).amin(1).view(-1, 1, 1, 1)
    hi = images.flatten(1).amax(1).view(-1, 1, 1, 1)
    noise = lo + (hi - lo) * torch.rand(images.shape, generator=generator, dtype=images.dtype)
    return torch.where(masks, noise, images), masks


def black_box(
    images: Tensor, black: float | Tensor | None = None, *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Black crop box corruption: the pixels of a random box are set to black.

    Args:
        images: ``[N, C, S, S]``.
        black: The value of black on the images' (normalised) scale; default: each image's
            minimum.
        generator: Random generator.

    Returns:
        ``(corrupted, box_masks)``: ``[N, C, S, S]`` and ``[N, 1, S, S]`` booleans.
    """
    _, masks = sample_boxes(images.shape[0], _side(images), generator=generator)
    if black is None:
        black = images.flatten(1).amin(1).view(-1, 1, 1, 1)
    black = torch.as_tensor(black, dtype=images.dtype)
    return torch.where(masks, black, images), masks


def _side(images: Tensor) -> int:
    if images.dim() != 4 or images.shape[-1] != images.shape[-2]:
        raise ValueError(f"expected square images [N, C, S, S], got shape {tuple(images.shape)}")
    return images.shape[-1]


def per_image_entropy(entropy: Tensor) -> Tensor:
    """Mean per-pixel predictive entropy of each image (LSN Fig. 7): ``[N, …] → [N]``."""
    return entropy.flatten(1).mean(1)


def auroc(scores_id: Tensor, scores_ood: Tensor) -> float:
    """Area under the ROC curve for telling OOD (positive) from ID by a score (higher: OOD).

    The Mann–Whitney statistic ``P(s_OOD > s_ID) + ½ P(s_OOD = s_ID)`` over all pairs.

    Raises:
        ValueError: If either set is empty.
    """
    a, b = scores_id.flatten(), scores_ood.flatten()
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError("auroc needs at least one ID and one OOD score")
    greater = (b[:, None] > a[None, :]).to(torch.float64).mean()
    ties = (b[:, None] == a[None, :]).to(torch.float64).mean()
    return (greater + 0.5 * ties).item()


def iou(prediction: Tensor, target: Tensor) -> float:
    """Intersection over union of binary masks, pooled over all images: ``|P ∩ T| / |P ∪ T|``.

    Returns 1 when both masks are empty.
    """
    p, t = prediction.bool(), target.bool()
    if p.shape != t.shape:
        raise ValueError(f"masks differ in shape: {tuple(p.shape)} vs {tuple(t.shape)}")
    union = (p | t).sum().item()
    return 1.0 if union == 0 else (p & t).sum().item() / union


def average_precision(scores: Tensor, labels: Tensor) -> float:
    """Area under the precision-recall curve (average precision) of pixel scores for labels.

    ``AP = Σ_k (R_k − R_{k−1}) P_k`` over the scores sorted in decreasing order, with tied scores
    entering together (as scikit-learn's ``average_precision_score``). A score that ranks every
    positive first gives 1; random scores give the positive share.

    Args:
        scores: Scores of any shape (higher: more likely positive).
        labels: Booleans (or 0/1) of the same shape.

    Raises:
        ValueError: If the shapes differ or there is no positive label.
    """
    if scores.shape != labels.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} differ")
    s, y = scores.flatten().double(), labels.flatten().bool()
    n_pos = int(y.sum())
    if n_pos == 0:
        raise ValueError("average_precision needs at least one positive label")
    order = torch.argsort(s, descending=True)
    s, y = s[order], y[order].double()
    tp, seen = torch.cumsum(y, 0), torch.arange(1, len(y) + 1, dtype=torch.float64)
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]  # the last entry of each run of tied scores
    tp, seen = tp[last], seen[last]
    recall_step = torch.diff(tp, prepend=tp.new_zeros(1)) / n_pos
    return float((recall_step * tp / seen).sum())


def boundary_band(mask: Tensor, width: int = 2) -> Tensor:
    """Pixels within ``width`` pixels (Chebyshev distance) of a binary mask's boundary.

    ``dilate_w(mask) ∧ ¬erode_w(mask)`` with a ``(2w+1) × (2w+1)`` square, where the mask's
    boundary lies between a foreground and a background pixel; images without foreground have
    an empty band. Pixels outside the image count as background for the dilation and as
    foreground for the erosion, so the image border is not a boundary.

    Args:
        mask: ``[N, 1, H, W]`` (or ``[N, H, W]``) in {0, 1}.
        width: ``w ≥ 1``.

    Returns:
        Booleans of ``mask``'s shape.
    """
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    m = mask.unsqueeze(1) if mask.dim() == 3 else mask
    m = m.double()
    k = 2 * width + 1
    dilated = torch.nn.functional.max_pool2d(m, k, 1, width)
    eroded = -torch.nn.functional.max_pool2d(-m, k, 1, width)
    band = (dilated > 0.5) & (eroded < 0.5)
    return band.squeeze(1) if mask.dim() == 3 else band


def boundary_share(variance: Tensor, mask: Tensor, width: int = 2) -> tuple[float, float]:
    """Share of a variance map inside the boundary band, and the band's share of the pixels.

    ``(Σ_{band} v / Σ v, |band| / |image|)`` pooled over the images (LSN Fig. 5 as a number:
    an aleatoric map that concentrates on boundaries has a first value well above the second).

    Args:
        variance: ``[N, 1, H, W]`` non-negative maps.
        mask: ``[N, 1, H, W]`` binary masks.
        width: Band half-width in pixels.

    Raises:
        ValueError: If the shapes differ, or the maps are not finite or sum to zero.
    """
    if variance.shape != mask.shape:
        raise ValueError(f"variance {tuple(variance.shape)} and mask {tuple(mask.shape)} differ")
    total = variance.sum()
    if not bool(torch.isfinite(variance).all()) or not total > 0:
        raise ValueError(
            f"boundary_share needs finite non-negative variance maps with a positive sum; got "
            f"sum {total.item()} (a zero map has no share to split)"
        )
    band = boundary_band(mask, width).to(variance.dtype)
    return float((variance * band).sum() / total), float(band.mean())
