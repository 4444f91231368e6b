"""Segmentation and out-of-distribution measures of the LSN paper (§4.4), and its corruptions.

Shape legend: ``N`` images, ``K`` logit channels, ``H``/``W`` height and width. Variance maps are
``[N, K, H, W]`` (or ``[N, H, W]``); sums run over everything but the batch axis.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "aurc",
    "auroc",
    "average_precision",
    "binary_nll",
    "black_box",
    "boundary_band",
    "boundary_share",
    "box_ratio",
    "brier_score",
    "dice_per_image",
    "expected_calibration_error",
    "iou",
    "noise_box",
    "oracle_aurc",
    "per_image_entropy",
    "pixel_ratio",
    "risk_coverage",
    "roc_auc",
    "sample_boxes",
    "spearman",
]


def _per_image_sum(x: Tensor) -> Tensor:
    return x.flatten(1).sum(1)


def _check_variance(v: Tensor, name: str) -> None:
    """Refuse variance maps that are not floating, finite and non-negative."""
    if not v.is_floating_point():
        raise ValueError(f"{name} must be a floating variance map, got dtype {v.dtype}")
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{name} has NaN or inf entries")
    if bool((v < 0).any()):
        raise ValueError(
            f"{name} has negative entries (smallest {v.min().item():.3g}): a variance map is "
            "non-negative"
        )


def pixel_ratio(var_id: Tensor, var_ood: Tensor) -> Tensor:
    """Pixel Ratio (LSN Eq. 16): ``Σ_s Var σ(η_s(x_OOD)) / Σ_s Var σ(η_s(x))`` per image.

    Args:
        var_id: Variance maps of the clean images ``x``, ``[N, …]``.
        var_ood: Variance maps of their corrupted versions, same shape.

    Returns:
        ``[N]``; values above 1 mean more variance on the corrupted image.

    Raises:
        ValueError: If the shapes differ, a map is negative or not finite, or a clean image's
            map is zero everywhere (the ratio is undefined).
    """
    if var_id.shape != var_ood.shape:
        raise ValueError(
            f"variance maps differ in shape: {tuple(var_id.shape)} vs {tuple(var_ood.shape)}"
        )
    _check_variance(var_id, "var_id")
    _check_variance(var_ood, "var_ood")
    clean = _per_image_sum(var_id)
    if bool((clean == 0).any()):
        i = int(torch.nonzero(clean == 0)[0])
        raise ValueError(
            f"var_id of image {i} is zero everywhere: its Pixel Ratio is undefined (a variance "
            "map of a point-mass posterior?); leave such images out or use the median over images"
        )
    return _per_image_sum(var_ood) / clean


def box_ratio(var_ood: Tensor, box: Tensor) -> Tensor:
    """Box Ratio (LSN Eq. 17): ``Σ_{k ∈ box} Var σ(η_k) / Σ_s Var σ(η_s)`` per corrupted image.

    For comparison: a variance spread uniformly over the image gives the box's area fraction.

    Args:
        var_ood: Variance maps of the corrupted images, ``[N, K, H, W]`` or ``[N, H, W]``.
        box: Boolean masks of the corrupted pixels, ``[N, 1, H, W]`` or ``[N, H, W]``
            (broadcast over the channels).

    Returns:
        ``[N]`` in ``[0, 1]``.

    Raises:
        ValueError: If the box masks are not binary or do not match the maps (one mask per
            map, the same image size), a map is negative or not finite, or zero everywhere
            (no variance to locate).
    """
    if var_ood.dim() == 3:
        var_ood = var_ood.unsqueeze(1)
    if box.dim() == 3:
        box = box.unsqueeze(1)
    if var_ood.dim() != 4 or box.dim() != 4 or box.shape[1] != 1:
        raise ValueError(
            f"expected maps [N, K, H, W] and box masks [N, 1, H, W]; got {tuple(var_ood.shape)} "
            f"and {tuple(box.shape)}"
        )
    if box.shape[0] != var_ood.shape[0] or box.shape[2:] != var_ood.shape[2:]:
        raise ValueError(
            f"box masks {tuple(box.shape)} do not match the variance maps "
            f"{tuple(var_ood.shape)}: give one mask of the image's size per map"
        )
    _check_binary(box, "box")
    _check_variance(var_ood, "var_ood")
    total = _per_image_sum(var_ood)
    if bool((total == 0).any()):
        i = int(torch.nonzero(total == 0)[0])
        raise ValueError(
            f"the variance map of image {i} is zero everywhere: its Box Ratio is undefined"
        )
    inside = var_ood * box.to(var_ood.dtype)
    return _per_image_sum(inside) / total


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
        generator: Random generator (boxes, then noise) on the CPU; the images may live on any
            device.

    Returns:
        ``(corrupted, box_masks)``: ``[N, C, S, S]`` and ``[N, 1, S, S]`` booleans.

    Raises:
        ValueError: If the images are not square ``[N, C, S, S]``, too small for a box, or not
            floating point.
    """
    _, masks = sample_boxes(images.shape[0], _side(images), generator=generator)
    if not images.is_floating_point():
        raise ValueError(
            f"noise_box needs floating images (uniform noise), got dtype {images.dtype}; convert "
            "them first, e.g. images.float()"
        )
    lo = images.flatten(1).amin(1).view(-1, 1, 1, 1)
    hi = images.flatten(1).amax(1).view(-1, 1, 1, 1)
    # drawn where the generator lives (the CPU by default), then moved to the images
    where = images.device if generator is None else generator.device
    u = torch.rand(images.shape, generator=generator, dtype=images.dtype, device=where)
    masks = masks.to(images.device)
    return torch.where(masks, lo + (hi - lo) * u.to(images.device), images), masks


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

    Raises:
        ValueError: If the images are not square ``[N, C, S, S]`` or too small for a box.
    """
    _, masks = sample_boxes(images.shape[0], _side(images), generator=generator)
    if black is None:
        black = images.flatten(1).amin(1).view(-1, 1, 1, 1)
    black = torch.as_tensor(black, dtype=images.dtype, device=images.device)
    masks = masks.to(images.device)
    return torch.where(masks, black, images), masks


def _side(images: Tensor) -> int:
    if images.dim() != 4 or images.shape[-1] != images.shape[-2]:
        raise ValueError(f"expected square images [N, C, S, S], got shape {tuple(images.shape)}")
    return images.shape[-1]


def per_image_entropy(entropy: Tensor) -> Tensor:
    """Mean per-pixel predictive entropy of each image (LSN Fig. 7): ``[N, …] → [N]``.

    Args:
        entropy: Per-pixel entropy maps, ``[N, *spatial]`` (any number of pixel axes, with or
            without a channel axis: all axes after the first are averaged).

    Returns:
        ``[N]``, the mean over each image's pixels.

    Raises:
        ValueError: For a tensor without pixel axes (``[N]`` is already one value per image).
    """
    if entropy.dim() < 2:
        raise ValueError(
            f"expected entropy maps [N, *spatial], got shape {tuple(entropy.shape)}; a [N] "
            "tensor is already one value per image"
        )
    return entropy.flatten(1).mean(1)


def auroc(scores_id: Tensor, scores_ood: Tensor) -> float:
    """Area under the ROC curve for telling OOD (positive) from ID by a score (higher: OOD).

    The Mann–Whitney statistic ``P(s_OOD > s_ID) + ½ P(s_OOD = s_ID)`` over all pairs (memory
    ``O(n_ID · n_OOD)``; :func:`roc_auc` sorts instead, for millions of scores).

    Args:
        scores_id: Scores of the in-distribution inputs, any shape (flattened).
        scores_ood: Scores of the out-of-distribution inputs, any shape (flattened).

    Returns:
        The AUROC in ``[0, 1]``; 0.5 is chance, 1 means every OOD score is above every ID score.

    Raises:
        ValueError: If either set is empty or a score is NaN or infinite.
    """
    a, b = scores_id.flatten(), scores_ood.flatten()
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError("auroc needs at least one ID and one OOD score")
    for name, t in (("scores_id", a), ("scores_ood", b)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} must be finite; got NaN or inf (check the predictive)")
    greater = (b[:, None] > a[None, :]).to(torch.float64).mean()
    ties = (b[:, None] == a[None, :]).to(torch.float64).mean()
    return (greater + 0.5 * ties).item()


def iou(prediction: Tensor, target: Tensor) -> float:
    """Intersection over union of binary masks, pooled over all images: ``|P ∩ T| / |P ∪ T|``.

    Args:
        prediction: Binary predicted masks (booleans or 0/1), any shape.
        target: Binary reference masks, the same shape.

    Returns:
        The IoU in ``[0, 1]``; 1 when both masks are empty.

    Raises:
        ValueError: If the shapes differ or a mask is not binary (threshold probabilities and
            soft labels first, e.g. ``p > 0.5``).
    """
    if prediction.shape != target.shape:
        raise ValueError(
            f"masks differ in shape: {tuple(prediction.shape)} vs {tuple(target.shape)}"
        )
    p = _check_binary(prediction, "prediction")
    t = _check_binary(target, "target")
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

    Returns:
        The average precision in ``[0, 1]``.

    Raises:
        ValueError: If the shapes differ, a score is NaN or infinite, a label is not binary, or
            there is no positive label.
    """
    s, y = _check_scores(scores, labels)
    n_pos = int(y.sum())
    if n_pos == 0:
        raise ValueError("average_precision needs at least one positive label")
    order = torch.argsort(s, descending=True)
    s, y = s[order], y[order].double()
    tp, seen = torch.cumsum(y, 0), torch.arange(1, len(y) + 1, dtype=torch.float64, device=y.device)
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

    Raises:
        ValueError: If ``width`` is not an int of at least 1, the mask is not ``[N, 1, H, W]``
            or ``[N, H, W]``, or it is not binary.
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int of at least 1 (pixels), got {width!r}")
    if mask.dim() not in (3, 4) or (mask.dim() == 4 and mask.shape[1] != 1):
        raise ValueError(
            f"expected masks [N, 1, H, W] or [N, H, W], got shape {tuple(mask.shape)} (add the "
            "batch axis to a single [H, W] mask: mask[None])"
        )
    _check_binary(mask, "mask")
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

    Returns:
        ``(variance_share, band_share)``, both in ``[0, 1]``.

    Raises:
        ValueError: If the shapes differ, or the maps are not finite or sum to zero.
    """
    if variance.shape != mask.shape:
        raise ValueError(f"variance {tuple(variance.shape)} and mask {tuple(mask.shape)} differ")
    _check_variance(variance, "variance")
    total = variance.sum()
    if not total > 0:
        raise ValueError(
            f"boundary_share needs finite non-negative variance maps with a positive sum; got "
            f"sum {total.item()} (a zero map has no share to split)"
        )
    band = boundary_band(mask, width).to(variance.dtype)
    return float((variance * band).sum() / total), float(band.mean())


# ----------------------------------------------------------------------------------------------
# Failure detection and calibration (uncertainty benchmarks)


def _check_binary(labels: Tensor, name: str = "labels") -> Tensor:
    """``labels`` as a flat boolean tensor; refuses anything but {0, 1} (or booleans)."""
    if labels.dtype != torch.bool:
        if labels.is_floating_point() and not bool(torch.isfinite(labels).all()):
            raise ValueError(f"{name} must be binary (0/1 or booleans); got non-finite values")
        bad = (labels != 0) & (labels != 1)
        if bool(bad.any()):
            raise ValueError(
                f"{name} must be binary (0/1 or booleans), got a value "
                f"{labels[bad].flatten()[0].item()!r}; threshold soft labels or probabilities "
                "first (e.g. labels > 0.5)"
            )
    return labels.flatten().bool()


def _check_scores(scores: Tensor, labels: Tensor, name: str = "scores") -> tuple[Tensor, Tensor]:
    """Flat float64 finite scores and flat boolean labels of the same shape."""
    if scores.shape != labels.shape:
        raise ValueError(
            f"{name} {tuple(scores.shape)} and labels {tuple(labels.shape)} differ in shape; "
            "pass one score per label"
        )
    if scores.numel() == 0:
        raise ValueError(f"{name} and labels are empty")
    s = scores.flatten().double()
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"{name} must be finite; got NaN or inf (check the predictive)")
    return s, _check_binary(labels)


def _check_probabilities(probs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    p, y = _check_scores(probs, labels, "probabilities")
    if bool(((p < 0) | (p > 1)).any()):
        raise ValueError(
            f"probabilities must lie in [0, 1]; got range [{p.min().item():.3g}, "
            f"{p.max().item():.3g}] (pass sigmoid(logits), not logits)"
        )
    return p, y


def _average_ranks(x: Tensor) -> Tensor:
    """1-based ranks of a flat tensor, ties sharing their average rank (float64)."""
    order = torch.argsort(x, stable=True)
    xs = x[order]
    n = len(x)
    first = torch.ones(n, dtype=torch.bool, device=x.device)
    first[1:] = xs[1:] != xs[:-1]
    group = torch.cumsum(first.long(), 0) - 1
    starts = torch.nonzero(first).flatten().double()
    counts = torch.bincount(group).double()
    mean_rank = starts + (counts + 1) / 2  # average of 1-based ranks start+1 … start+count
    ranks = torch.empty(n, dtype=torch.float64, device=x.device)
    ranks[order] = mean_rank[group]
    return ranks


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (higher score: positive).

    The Mann–Whitney statistic from average ranks, ``O(n log n)`` (for millions of pixels, where
    :func:`auroc`'s all-pairs comparison does not fit): ``P(s⁺ > s⁻) + ½ P(s⁺ = s⁻)``, as
    scikit-learn's ``roc_auc_score``.

    Args:
        scores: Any shape, finite (e.g. per-pixel uncertainty).
        labels: Same shape, 0/1 or booleans (e.g. "pixel misclassified").

    Returns:
        The AUROC in ``[0, 1]``; 0.5 is chance.

    Raises:
        ValueError: For mismatched shapes, non-finite scores, non-binary labels, or labels of
            only one class.
    """
    s, y = _check_scores(scores, labels)
    n_pos = int(y.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(
            f"roc_auc needs both classes among the labels; got {n_pos} positive and {n_neg} "
            "negative (undefined, e.g. a prediction without any error)"
        )
    r = _average_ranks(s)
    return float((r[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def expected_calibration_error(probs: Tensor, labels: Tensor, n_bins: int = 15) -> float:
    """Binary expected calibration error (Guo et al. 2017) of foreground probabilities.

    The prediction is ``p > ½``, its confidence ``max(p, 1 − p)``; the confidences fall in
    ``n_bins`` equal-width bins of ``[0, 1]`` (right-closed, the first also containing 0), and
    ``ECE = Σ_b (n_b / n) |acc_b − conf_b|``.

    Args:
        probs: Foreground probabilities in ``[0, 1]``, any shape.
        labels: Same shape, 0/1 or booleans.
        n_bins: Number of bins (15 as in Guo et al.).

    Returns:
        The ECE in ``[0, 1]``; 0 is perfectly calibrated.

    Raises:
        ValueError: For mismatched shapes, probabilities outside ``[0, 1]`` or non-finite,
            non-binary labels, or ``n_bins < 1``.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be at least 1, got {n_bins}")
    p, y = _check_probabilities(probs, labels)
    conf = torch.maximum(p, 1 - p)
    correct = ((p > 0.5) == y).double()
    b = (torch.ceil(conf * n_bins).long() - 1).clamp(0, n_bins - 1)
    acc = torch.bincount(b, correct, minlength=n_bins)
    cs = torch.bincount(b, conf, minlength=n_bins)
    return float((acc - cs).abs().sum() / len(p))


def binary_nll(probs: Tensor, labels: Tensor, eps: float = 1e-7) -> float:
    """Mean negative log-likelihood in nats per pixel, ``−mean(y log p + (1 − y) log(1 − p))``.

    Args:
        probs: Foreground probabilities in ``[0, 1]``, any shape.
        labels: Same shape, 0/1 or booleans.
        eps: ``p`` is clipped to ``[eps, 1 − eps]`` so that a confident error costs
            ``−log eps`` instead of infinity.

    Returns:
        The mean NLL in nats per pixel.

    Raises:
        ValueError: As :func:`expected_calibration_error`.
    """
    p, y = _check_probabilities(probs, labels)
    p = p.clamp(eps, 1 - eps)
    return float(-torch.where(y, p.log(), (1 - p).log()).mean())


def brier_score(probs: Tensor, labels: Tensor) -> float:
    """Mean squared error ``mean((p − y)²)`` of foreground probabilities (binary Brier score).

    Args:
        probs: Foreground probabilities in ``[0, 1]``, any shape.
        labels: Same shape, 0/1 or booleans.

    Returns:
        The Brier score in ``[0, 1]``; lower is better.

    Raises:
        ValueError: As :func:`expected_calibration_error`.
    """
    p, y = _check_probabilities(probs, labels)
    return float((p - y.double()).pow(2).mean())


def dice_per_image(prediction: Tensor, target: Tensor) -> Tensor:
    """Dice ``2|P ∩ T| / (|P| + |T|)`` of each image's binary masks, ``[N, …] → [N]`` float64.

    Convention: an image whose prediction and mask are both empty has Dice 1 (nothing to find,
    nothing found); one empty and the other not gives 0.

    Args:
        prediction: Binary predicted masks (booleans or 0/1), ``[N, …]``.
        target: Binary reference masks, the same shape.

    Returns:
        ``[N]`` float64 Dice scores in ``[0, 1]``.

    Raises:
        ValueError: For mismatched shapes or non-binary masks.
    """
    if prediction.shape != target.shape:
        raise ValueError(
            f"prediction {tuple(prediction.shape)} and target {tuple(target.shape)} differ"
        )
    if prediction.dim() < 2:
        raise ValueError(f"expected [N, …] masks, got shape {tuple(prediction.shape)}")
    n = prediction.shape[0]
    p = _check_binary(prediction, "prediction").view(n, -1).double()
    t = _check_binary(target, "target").view(n, -1).double()
    inter, total = (p * t).sum(1), p.sum(1) + t.sum(1)
    return torch.where(total > 0, 2 * inter / total.clamp_min(1), torch.ones_like(total))


def _check_risk(uncertainty: Tensor, risk: Tensor) -> tuple[Tensor, Tensor]:
    if uncertainty.dim() != 1 or uncertainty.shape != risk.shape or len(risk) == 0:
        raise ValueError(
            f"uncertainty {tuple(uncertainty.shape)} and risk {tuple(risk.shape)} must be "
            "non-empty 1-D tensors of the same length (one value per image)"
        )
    u, r = uncertainty.double(), risk.double()
    if not bool(torch.isfinite(u).all() and torch.isfinite(r).all()):
        raise ValueError("uncertainty and risk must be finite; got NaN or inf")
    return u, r


def risk_coverage(uncertainty: Tensor, risk: Tensor) -> tuple[Tensor, Tensor]:
    """Risk–coverage curve of selective prediction (Geifman and El-Yaniv 2017).

    The images are sorted by increasing uncertainty (ties keep their input order); at
    coverage ``k / n`` the ``k`` most certain images are kept and the selective risk is their
    mean risk.

    Args:
        uncertainty: ``[n]`` per-image uncertainty (higher: less certain).
        risk: ``[n]`` per-image risk, e.g. ``1 − Dice``.

    Returns:
        ``(coverage, selective_risk)``, each ``[n]`` float64, coverage ``1/n … 1``.

    Raises:
        ValueError: For shapes other than two equal-length 1-D tensors or non-finite values.
    """
    u, r = _check_risk(uncertainty, risk)
    order = torch.argsort(u, stable=True)
    k = torch.arange(1, len(r) + 1, dtype=torch.float64, device=r.device)
    return k / len(r), torch.cumsum(r[order], 0) / k


def aurc(uncertainty: Tensor, risk: Tensor) -> float:
    """Area under the risk–coverage curve (AURC); lower is better.

    The mean over ``k = 1…n`` of the selective risk of the ``k`` most certain images
    (:func:`risk_coverage`).

    Args:
        uncertainty: ``[n]`` per-image uncertainty (higher: less certain).
        risk: ``[n]`` per-image risk, e.g. ``1 − Dice``.

    Returns:
        The AURC, in the units of ``risk``.

    Raises:
        ValueError: As :func:`risk_coverage`.
    """
    return float(risk_coverage(uncertainty, risk)[1].mean())


def oracle_aurc(risk: Tensor) -> float:
    """The smallest AURC any ranking reaches: images sorted by their own risk.

    ``E-AURC = aurc(u, risk) − oracle_aurc(risk)`` is the excess over it.

    Args:
        risk: ``[n]`` per-image risk, e.g. ``1 − Dice``.

    Returns:
        The oracle AURC, in the units of ``risk``.

    Raises:
        ValueError: As :func:`risk_coverage`.
    """
    return aurc(risk, risk)


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks.

    Args:
        x: ``[n]`` values.
        y: ``[n]`` values paired with ``x``.

    Returns:
        The correlation in ``[−1, 1]``.

    Raises:
        ValueError: For shapes other than two equal-length 1-D tensors of at least 2 values,
            non-finite values, or a constant input (undefined correlation).
    """
    a, b = _check_risk(x, y)
    if len(a) < 2:
        raise ValueError("spearman needs at least 2 pairs")
    ra, rb = _average_ranks(a), _average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.pow(2).sum() * rb.pow(2).sum()).sqrt()
    if denom == 0:
        raise ValueError("spearman is undefined for a constant input (all ranks tied)")
    return float((ra * rb).sum() / denom)
