"""What the experiments measure on a predictive: failure detection, calibration, the spread
against the MAP, and the per-image sums that let a bootstrap resample test images.

- :class:`Pred`: one method's predictive on a set of images; :func:`entropy_binary`,
  :func:`spread`, :func:`foreground_entropy`;
- :func:`measure`, :func:`histogram_edges`, :func:`measure_sets`: pixel and image measures of a
  predictive, exact, with the per-image sums behind their bootstrap;
- :func:`boot_pixel_metric`, :func:`boot_image_metric`, :func:`shift_boot`: those measures on
  resampled images ``idx [R, n]``, for :func:`integration.experiments.tables.percentile_bootstrap`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from integration.experiments.kit.budget import ConvergedBudget
from lsn_ext.metrics import (
    aurc,
    average_precision,
    binary_nll,
    brier_score,
    dice_per_image,
    expected_calibration_error,
    oracle_aurc,
    roc_auc,
    spearman,
)

ECE_BINS = 15


@dataclass
class Pred:
    """One method's predictive on a set of images."""

    mean: Tensor  # E p, [N, 1, H, W]
    entropy: Tensor  # H[E p], [N, H, W]
    mi: Tensor | None  # mutual information (epistemic part), [N, H, W]
    variance: Tensor | None  # epistemic Var p, [N, 1, H, W]


def entropy_binary(p: Tensor) -> Tensor:
    """The entropy of Bernoulli ``p [N, 1, H, W]`` (nats), ``[N, H, W]``."""
    p = p.clamp(1e-12, 1 - 1e-12)
    return -(p * p.log() + (1 - p) * (1 - p).log())[:, 0]


def spread(p: Pred, p_map: Pred) -> dict[str, float]:
    """A posterior predictive against the MAP's on the same images: the ratio of their mean
    entropies, the mean ``|E p − p_MAP|`` and the mean posterior sd of ``p``."""
    out = {
        "entropy_ratio": (p.entropy.double().mean() / p_map.entropy.double().mean()).item(),
        "mean_abs_dp": (p.mean.double() - p_map.mean.double()).abs().mean().item(),
    }
    if p.variance is not None:
        out["mean_sd_p"] = p.variance.double().clamp_min(0).sqrt().mean().item()
    return out


def foreground_entropy(entropy: Tensor, mean: Tensor, dilation: int) -> Tensor:
    """Mean entropy within the predicted foreground (``E p > ½``) dilated by ``dilation``
    pixels (square); the whole image's mean where nothing is predicted. ``[N]``."""
    fg = (mean > 0.5).double()
    region = F.max_pool2d(fg, 2 * dilation + 1, 1, dilation)[:, 0] > 0.5
    inside = (entropy * region).flatten(1).sum(1) / region.flatten(1).sum(1).clamp_min(1)
    return torch.where(region.flatten(1).any(1), inside, entropy.flatten(1).mean(1))


def _safe(fn, *args) -> float | None:
    try:
        return fn(*args)
    except ValueError:  # one class only (no error pixel), constant ranks: undefined
        return None


def _abs_logit(mean: Tensor) -> Tensor:
    """``|logit E p|``: the entropy of ``E p`` falls as it rises (same order, reversed)."""
    p = mean.double().clamp(1e-12, 1 - 1e-12)
    return (p.log() - (1 - p).log()).abs()


def histogram_edges(means: list[Tensor], b: ConvergedBudget) -> Tensor:
    """Bin edges for the bootstrap's entropy histograms of one method: quantiles of
    ``|logit E p|`` over all its pixels (all image sets), so that each bin holds about
    ``1 / hist_bins`` of them and few pixels share a bin."""
    z = torch.cat([_abs_logit(m).flatten() for m in means])
    if len(z) > 1_000_000:
        z = z[torch.randperm(len(z), generator=torch.Generator().manual_seed(0))[:1_000_000]]
    q = torch.linspace(0, 1, b.hist_bins + 1, dtype=torch.float64)[1:-1]
    return torch.unique(torch.quantile(z, q))


def measure(p: Pred, y: Tensor, b: ConvergedBudget, edges: Tensor) -> tuple[dict, dict]:
    """Pixel and image measures of one predictive on one set of images.

    Returns:
        ``(scalars_and_per_image, per_image_sums)``: the JSON part (exact pooled pixel metrics,
        per-image uncertainty and Dice) and the tensors for the bootstrap (per-image entropy
        histograms of wrong and right pixels, calibration bin sums, NLL and Brier sums).
    """
    mean, ent = p.mean.double(), p.entropy.double()
    truth = y > 0.5
    err = (mean > 0.5) != truth
    dice = dice_per_image(mean > 0.5, truth)
    u_mean = ent.flatten(1).mean(1)
    u_fg = foreground_entropy(ent, mean, b.fg_dilation)
    out: dict = {
        "auroc": _safe(roc_auc, ent, err[:, 0]),
        "auprc": _safe(average_precision, ent, err[:, 0]),
        "ece": expected_calibration_error(mean, truth),
        "nll": binary_nll(mean, truth),
        "brier": brier_score(mean, truth),
        "dice": dice.mean().item(),
        "error_rate": err.double().mean().item(),
        "aurc": aurc(u_mean, 1 - dice),
        "oracle_aurc": oracle_aurc(1 - dice),
        "aurc_fg": aurc(u_fg, 1 - dice),
        "spearman": _safe(spearman, u_mean, dice),
        "spearman_fg": _safe(spearman, u_fg, dice),
        "u_mean": u_mean.tolist(),
        "u_fg": u_fg.tolist(),
        "dice_per_image": dice.tolist(),
    }
    out["e_aurc"] = out["aurc"] - out["oracle_aurc"]
    out["e_aurc_fg"] = out["aurc_fg"] - out["oracle_aurc"]
    if p.mi is not None:
        mi = p.mi.double()
        out["auroc_mi"] = _safe(roc_auc, mi, err[:, 0])
        out["mi_mean"] = mi.flatten(1).mean(1).tolist()
        out["aurc_mi"] = aurc(mi.flatten(1).mean(1), 1 - dice)
    n = len(mean)
    e = err[:, 0].reshape(n, -1)
    idx = len(edges) - torch.bucketize(_abs_logit(mean.reshape(n, -1)), edges)  # by entropy
    hist_err = torch.zeros(n, len(edges) + 1, dtype=torch.int64)
    hist_ok = torch.zeros(n, len(edges) + 1, dtype=torch.int64)
    hist_err.scatter_add_(1, idx, e.long())
    hist_ok.scatter_add_(1, idx, (~e).long())
    pm = mean.reshape(n, -1)
    t = truth.reshape(n, -1)
    conf = torch.maximum(pm, 1 - pm)
    ece_bin = (torch.ceil(conf * ECE_BINS).long() - 1).clamp(0, ECE_BINS - 1)
    correct = ((pm > 0.5) == t).double()
    zeros = torch.zeros(n, ECE_BINS, dtype=torch.float64)
    pc = pm.clamp(1e-7, 1 - 1e-7)
    sums = {
        "hist_err": hist_err,
        "hist_ok": hist_ok,
        "ece_n": zeros.scatter_add(1, ece_bin, torch.ones_like(conf)),
        "ece_acc": zeros.scatter_add(1, ece_bin, correct),
        "ece_conf": zeros.scatter_add(1, ece_bin, conf),
        "nll": -torch.where(t, pc.log(), (1 - pc).log()).sum(1),
        "brier": (pm - t.double()).pow(2).sum(1),
        "pixels": torch.full((n,), pm.shape[1], dtype=torch.float64),
    }
    return out, sums


def measure_sets(
    preds: dict[str, Pred], truth: dict[str, Tensor], pooled: list[str], b: ConvergedBudget
) -> tuple[dict[str, dict], dict[str, dict], dict]:
    """:func:`measure` of one method's predictives on every set of images, with the histogram
    edges of all its sets, and on the sets ``pooled`` together.

    Returns:
        ``(per set: measures, per set: per-image sums, the pooled sets' measures)``.
    """
    edges = histogram_edges([p.mean for p in preds.values()], b)
    results, sums = {}, {}
    for k, p in preds.items():
        results[k], sums[k] = measure(p, truth[k], b, edges)
    pool = Pred(
        torch.cat([preds[k].mean for k in pooled]),
        torch.cat([preds[k].entropy for k in pooled]),
        None,
        None,
    )
    pooled_results, _ = measure(pool, torch.cat([truth[k] for k in pooled]), b, edges)
    return results, sums, pooled_results


def _rank_rows(x: Tensor) -> Tensor:
    """Average ranks along the last axis (ties share their mean rank)."""
    from scipy.stats import rankdata

    return torch.from_numpy(rankdata(x.numpy(), axis=-1))


def boot_image_metric(metric: str, per_image: dict, idx: Tensor) -> Tensor:
    """``[R]`` values of an image-level metric on resampled images ``idx [R, n]``."""
    dice = torch.tensor(per_image["dice_per_image"], dtype=torch.float64)[idx]
    u = torch.tensor(per_image["u_fg" if metric.endswith("_fg") else "u_mean"])[idx]
    risk = 1 - dice
    if metric.startswith("spearman"):
        ru, rd = _rank_rows(u), _rank_rows(dice)
        ru, rd = ru - ru.mean(1, keepdim=True), rd - rd.mean(1, keepdim=True)
        den = (ru.pow(2).sum(1) * rd.pow(2).sum(1)).sqrt()
        return torch.where(den > 0, (ru * rd).sum(1) / den.clamp_min(1e-300), torch.nan)
    k = torch.arange(1, idx.shape[1] + 1, dtype=torch.float64)
    order = torch.argsort(u, dim=1, stable=True)
    a = (torch.cumsum(torch.gather(risk, 1, order), 1) / k).mean(1)
    if metric.startswith("e_aurc"):
        a = a - (torch.cumsum(risk.sort(1).values, 1) / k).mean(1)
    return a


def _resampled_sum(per_image: Tensor, idx: Tensor) -> Tensor:
    """``per_image[idx].sum(1)`` as (multiplicities ``[R, n]``) @ ``per_image`` (float64),
    without the ``[R, n, …]`` gather."""
    weights = torch.zeros(idx.shape[0], len(per_image), dtype=torch.float64)
    weights.scatter_add_(1, idx, torch.ones(idx.shape, dtype=torch.float64))
    out = weights @ per_image.double().reshape(len(per_image), -1)
    return out.squeeze(1) if per_image.dim() == 1 else out


def boot_pixel_metric(metric: str, s: dict, idx: Tensor) -> Tensor:
    """``[R]`` values of a pooled pixel metric on resampled images, from per-image sums."""
    if metric in ("auroc", "auprc"):
        pos, neg = _resampled_sum(s["hist_err"], idx), _resampled_sum(s["hist_ok"], idx)
        n_pos, n_neg = pos.sum(1), neg.sum(1)
        if metric == "auroc":
            below = torch.cumsum(neg, 1) - neg
            auc = (pos * (below + 0.5 * neg)).sum(1) / (n_pos * n_neg)
            return torch.where((n_pos > 0) & (n_neg > 0), auc, torch.nan)
        pos, neg = pos.flip(1), neg.flip(1)  # thresholds from the highest entropy down
        tp, fp = torch.cumsum(pos, 1), torch.cumsum(neg, 1)
        prec = torch.where(tp + fp > 0, tp / (tp + fp).clamp_min(1), 0.0)
        return torch.where(n_pos > 0, (pos * prec).sum(1) / n_pos, torch.nan)
    if metric == "ece":
        n, acc, conf = (_resampled_sum(s[k], idx) for k in ("ece_n", "ece_acc", "ece_conf"))
        return (acc - conf).abs().sum(1) / n.sum(1)
    return _resampled_sum(s[metric], idx) / _resampled_sum(s["pixels"], idx)


def shift_boot(clean: list[float], shifted: list[float]) -> tuple[int, object]:
    """Shift AUROC on resampled images: ``idx`` runs over the clean images then the shifted
    ones; each group is resampled within itself (its own indices modulo its size)."""
    a, s = torch.tensor(clean, dtype=torch.float64), torch.tensor(shifted, dtype=torch.float64)
    n_a, n_s = len(a), len(s)
    n = n_a * n_s  # one draw in [0, n_a n_s) gives one clean and one shifted index

    def fn(idx: Tensor) -> Tensor:  # n_a n_s >= n_a + n_s columns for groups of >= 2 images
        ia, i_s = idx[:, :n_a] % n_a, (idx[:, n_a : n_a + n_s] // n_a) % n_s
        r = _rank_rows(torch.cat([a[ia], s[i_s]], 1))
        return (r[:, n_a:].sum(1) - n_s * (n_s + 1) / 2) / (n_a * n_s)

    return n, fn
