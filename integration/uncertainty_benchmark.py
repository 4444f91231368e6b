"""Failure detection and calibration of segmentation uncertainty, with converged networks.

Nine uncertainty methods on the LSN paper's two data sets (``lesions``, ``nuclei``; see
``integration/lsn_paper.py``, whose data, networks, posteriors, cache and corruptions this
script imports): the MAP U-Net's own entropy, MC dropout, a deep ensemble, a diagonal Laplace
approximation on the U-Net and the LSN (rank 10 and rank 0), the last two each with the
sampling (``nn``) and the linearised (``glm``) predictive. Every network is trained with early
stopping on validation Dice.

Measured, per data set and seed:

- pixels (clean test images): AUROC and AUPRC of the predictive entropy for "pixel
  misclassified", ECE (15 bins), NLL and Brier score of ``E p``;
- images: AURC, oracle AURC and E-AURC of the per-image uncertainty for the risk ``1 − Dice``,
  and Spearman's correlation of that uncertainty with Dice;
- shift: AUROC of the per-image uncertainty for clean against shifted test images (lesions:
  the four corruptions of ``lsn_paper.SHIFTS`` at their middle strength; nuclei: the 2-D test
  patches against the 3-D volume's slices), also for a model-free image-statistics score, and
  the pixel AUROC and AURC on the shifted images;
- the Box Ratio of the epistemic variance for a noise box (the LSN paper's Table 2).

Statistics: mean ± 95 % t-interval over seeds, a bootstrap interval over test images, and
paired per-seed differences against the MAP entropy and the ensemble.

Run: ``./dev bench uncertainty_benchmark [--quick] [--seeds 0-4] [--datasets lesions,nuclei]
[--workers 2] [--cache DIR] [--out DIR] [--report-only]``. Writes
``integration/results/uncertainty.md``, ``uncertainty_per_seed.csv`` and
``uncertainty_risk_coverage.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lsn_paper as lp
from harness import machine
from stats import fmt, percentile_bootstrap
from stats import paired as stats_paired

from lsn_ext import gridsearch_prior_precision, predict
from lsn_ext.data import load_nuclei_3d, nuclei_patches, nuclei_volume_slices
from lsn_ext.lsn import ensemble_predict, mc_dropout_predict, predict_lsn
from lsn_ext.metrics import (
    aurc,
    auroc,
    average_precision,
    binary_nll,
    box_ratio,
    brier_score,
    dice_per_image,
    expected_calibration_error,
    oracle_aurc,
    risk_coverage,
    roc_auc,
    spearman,
)
from lsn_ext.models import SSN

RESULTS = lp.RESULTS
ENSEMBLE = "Ensemble (5)"
METHODS = (
    "MAP entropy",
    "MC dropout",
    ENSEMBLE,
    "U-Net + LA (nn)",
    "U-Net + LA (nn, marglik)",
    "U-Net + LA (glm)",
    "U-Net + LA (glm, marglik)",
    "LSN (nn)",
    "LSN (glm)",
    "LSN (glm, marglik)",
    "LSN (diag) (nn)",
    "LSN (diag) (glm)",
)
# Laplace methods: (posterior, predictive, prior). "grid": validation NLL of *that* predictive
# over the prior grid (gridsearch_prior_precision with pred_type); "marglik": laplace-torch's
# marginal likelihood, one scalar (independent of the predictive).
LAPLACE = {
    "U-Net + LA (nn)": ("U-Net + LA", "nn", "grid"),
    "U-Net + LA (nn, marglik)": ("U-Net + LA", "nn", "marglik"),
    "U-Net + LA (glm)": ("U-Net + LA", "glm", "grid"),
    "U-Net + LA (glm, marglik)": ("U-Net + LA", "glm", "marglik"),
    "LSN (nn)": ("LSN", "nn", "grid"),
    "LSN (glm)": ("LSN", "glm", "grid"),
    "LSN (glm, marglik)": ("LSN", "glm", "marglik"),
    "LSN (diag) (nn)": ("LSN (diag)", "nn", "grid"),
    "LSN (diag) (glm)": ("LSN (diag)", "glm", "grid"),
}
POSTERIOR_NETS = {"U-Net + LA": "unet0", "LSN": "ssn", "LSN (diag)": "ssn_diag"}
# BCE foreground weight of every network: the lesions' 1:8 imbalance makes unweighted U-Nets
# and rank-0 SSNs stay at background (lsn_paper Table 1); one factor for all keeps the
# calibration comparison fair (the weighting shifts every method's probabilities alike).
FACTORS = {"lesions": 4, "nuclei": 1}
IMAGE_STATS = "image statistics"
# The same score on the nuclei volume kept on the 2-D training image's intensity scale (the
# volume the models see is standardised by its own statistics, which removes a global intensity
# shift by construction; the lesions' corruptions are applied on the one fixed input scale).
IMAGE_STATS_RAW = "image statistics (training intensity scale)"
NETS = ("unet0", "unet1", "unet2", "unet3", "unet4", "unet_do", "ssn", "ssn_diag")
ECE_BINS = 15


@dataclass(frozen=True)
class ConvergedBudget(lp.Budget):
    """Sizes of the converged run (its own cache keys: the hash covers the added fields).

    Inherited fields as :class:`lsn_paper.Budget`; ``steps`` is the cap of early stopping.

    Attributes:
        eval_every, patience: Validation Dice every ``eval_every`` steps; stop after
            ``patience`` evaluations without improvement and keep the best weights.
        min_steps: No early stop before this many steps.
        stop_floor: No early stop while the best validation Dice is at or below it (0: a
            network still predicting background runs to the cap).
        n_dropout: MC-dropout passes.
        n_bootstrap: Bootstrap resamples of the test images.
        fg_dilation: Dilation (pixels) of the predicted foreground for the foreground-adjusted
            per-image uncertainty.
        hist_bins: Bins of the per-image entropy histograms behind the bootstrap of the pixel
            AUROC and AUPRC.
    """

    n_train: int = 480
    n_val: int = 64
    n_test: int = 64
    n_eval: int = 64
    n_shift: int = 32
    steps: int = 800
    n_val_samples: int = 8
    widths: tuple[int, ...] = (8, 16, 32, 64)
    ensemble: int = 5
    n_epistemic: int = 16
    n_aleatoric: int = 8
    eval_every: int = 50
    patience: int = 4
    min_steps: int = 300
    stop_floor: float = 0.0
    n_dropout: int = 50
    n_bootstrap: int = 1000
    fg_dilation: int = 3
    hist_bins: int = 1024


QUICK = ConvergedBudget(
    n_train=24,
    n_val=4,
    n_test=6,
    n_eval=6,
    n_shift=4,
    steps=6,
    batch_size=8,
    widths=(4, 8),
    rank=2,
    n_epistemic=2,
    n_aleatoric=2,
    n_val_samples=2,
    prior_exponents=(-2, 0, 2),
    eval_every=2,
    patience=1,
    min_steps=4,
    n_dropout=3,
    n_bootstrap=50,
    hist_bins=64,
)


# ----------------------------------------------------------------------------------------------
# Data and networks


def load(name: str, b: ConvergedBudget) -> tuple[lp.Data, int]:
    """The data set (nuclei training patches cut to ``n_train`` in quick mode) and the number of
    its in-distribution test images (nuclei: the 2-D patches before the volume's slices)."""
    data = lp.load_data(name, b)
    if name == "nuclei":
        data.train_x, data.train_y = data.train_x[: b.n_train], data.train_y[: b.n_train]
        n_volume = len(nuclei_volume_slices(64, dtype=torch.float32)[0])
        return data, len(data.test_x) - n_volume
    return data, len(data.test_x)


def volume_on_training_scale(volume_x: Tensor) -> Tensor:
    """The nuclei volume's slices as the models see them (standardised by the volume's own
    mean and sd, :func:`lsn_ext.data.nuclei_volume_slices`) brought back to the raw intensities
    and standardised by the 2-D training band's statistics instead, ``[31, 1, 64, 64]``. The
    reflect padding commutes with the affine maps, so this is exact."""
    volume, _ = load_nuclei_3d()
    raw = volume_x.double() * volume.std() + volume.mean()
    return nuclei_patches(64, 32, dtype=torch.float64).normalise(raw).to(volume_x.dtype)


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


def specs(b: ConvergedBudget) -> dict[str, lp.NetSpec]:
    """The eight networks of a seed: five U-Nets, a dropout U-Net, rank-r and rank-0 SSNs."""
    nets = {f"unet{k}": lp.NetSpec("unet", member=k) for k in range(b.ensemble)}
    nets["unet_do"] = lp.NetSpec("unet", dropout=b.dropout)
    nets["ssn"] = lp.NetSpec("ssn", rank=b.rank)
    nets["ssn_diag"] = lp.NetSpec("ssn", rank=0)
    return nets


def _mean_logits(net: nn.Module, x: Tensor) -> Tensor:
    return net.distribution(x).mean if isinstance(net, SSN) else net(x)


def validation_dice(net: nn.Module, data: lp.Data) -> float:
    """Dice of ``logit > 0`` (SSN: its mean logit) pooled over the validation images."""
    pred = _mean_logits(net, data.val_x) > 0
    return float(dice_per_image(pred.reshape(1, -1), (data.val_y > 0.5).reshape(1, -1))[0])


class ConvergedCache(lp.Cache):
    """:class:`lsn_paper.Cache` whose networks train with early stopping on validation Dice;
    each network's training record (steps, best Dice, seconds) is kept beside it."""

    def net(self, spec: lp.NetSpec, data: lp.Data, factor: float, seed: int) -> nn.Module:
        return self.net_and_record(spec, data, factor, seed)[0]

    def net_and_record(
        self, spec: lp.NetSpec, data: lp.Data, factor: float, seed: int
    ) -> tuple[nn.Module, dict]:
        path = self.path("net", data.name, spec.tag(), f"f{factor}", f"s{seed}")
        record_path = path.with_suffix(".json")
        if path.exists() and record_path.exists():
            net = lp.build(spec, self.budget, data.train_x.shape[1])
            net.load_state_dict(torch.load(path))
            return net.eval(), json.loads(record_path.read_text())
        b = self.budget
        stopping = lp.EarlyStopping(
            lambda n: validation_dice(n, data),
            b.eval_every,
            b.patience,
            b.min_steps,
            b.stop_floor,
        )
        t0 = time.perf_counter()
        net = lp.train(spec, data, factor, seed, b, stopping)
        record = {
            "best_step": stopping.best_step,
            "steps_run": stopping.steps_run,
            "stopped_early": stopping.stopped,
            "best_val_dice": stopping.best_score,
            "seconds": time.perf_counter() - t0,
        }
        self.save(net.state_dict(), path)
        record_path.write_text(json.dumps(record))
        return net, record


# ----------------------------------------------------------------------------------------------
# Predictives


@dataclass
class Pred:
    """One method's predictive on a set of images."""

    mean: Tensor  # E p, [N, 1, H, W]
    entropy: Tensor  # H[E p], [N, H, W]
    mi: Tensor | None  # mutual information (epistemic part), [N, H, W]
    variance: Tensor | None  # epistemic Var p, [N, 1, H, W]


def _la_predict(la: object, x: Tensor, n: int, pred_type: str, seed: int) -> object:
    gen = torch.Generator().manual_seed(seed)
    return predict(la, x, n, pred_type=pred_type, link_approx="mc", generator=gen)


def _set_prior(posteriors: dict, method: str) -> tuple[object, str]:
    """Set the prior precision that ``method`` uses on its posterior; ``(la, pred_type)``."""
    name, pred_type, choice = LAPLACE[method]
    la, priors = posteriors[name]
    la.prior_precision = priors[f"{pred_type}-{choice}"]
    return la, pred_type


def predictors(
    nets: dict[str, nn.Module], posteriors: dict[str, object], b: ConvergedBudget, seed: int
) -> dict[str, object]:
    """``method → f(x) -> Pred`` (total predictive) and, for the box, ``method → g(x) -> Var p``
    (epistemic variance; None for the MAP)."""
    members = [nets[f"unet{k}"] for k in range(b.ensemble)]

    def from_seg(p: object) -> Pred:
        return Pred(p.mean, p.entropy, p.mutual_information, p.variance)

    def map_(x: Tensor) -> Pred:
        with torch.no_grad():
            p = torch.sigmoid(members[0](x))
        return Pred(p, lp._entropy_binary(p), None, None)

    def dropout(x: Tensor) -> Pred:
        torch.manual_seed(seed)
        return from_seg(mc_dropout_predict(nets["unet_do"], x, b.n_dropout))

    def laplace(method: str):
        def run(x: Tensor) -> Pred:
            la, pt = _set_prior(posteriors, method)
            net = nets[POSTERIOR_NETS[LAPLACE[method][0]]]
            if not isinstance(net, SSN):
                return from_seg(_la_predict(la, x, b.n_epistemic, pt, seed))
            p = predict_lsn(la, net, x, b.n_epistemic, b.n_aleatoric, seed=seed, pred_type=pt)
            return Pred(
                p.total_mean, p.entropy, p.epistemic.mutual_information, p.epistemic.variance
            )

        return run

    total = {
        "MAP entropy": map_,
        "MC dropout": dropout,
        ENSEMBLE: lambda x: from_seg(ensemble_predict(members, x)),
    }
    total |= {m: laplace(m) for m in LAPLACE}
    return {m: total[m] for m in METHODS}


def _epistemic_variance(method: str, posteriors: dict, fn: object, x: Tensor, b, seed) -> Tensor:
    """Epistemic ``Var p`` for the Box Ratio; LA/LSN directly from their posteriors (the LSN's
    epistemic map is the mean network's, :func:`lsn_ext.lsn.predict_lsn`)."""
    if method in LAPLACE:
        la, pt = _set_prior(posteriors, method)
        return _la_predict(la, x, b.n_epistemic, pt, seed).variance
    return fn(x).variance


# ----------------------------------------------------------------------------------------------
# Per-set measures


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


def image_statistics(train_x: Tensor, sets: dict[str, Tensor]) -> dict[str, list[float]]:
    """Model-free shift score: Mahalanobis distance of each image's (intensity mean, intensity
    standard deviation) over all its pixels and channels from the training images' mean of
    those two statistics, under their 2×2 covariance over the training images."""

    def stats(x: Tensor) -> Tensor:
        f = x.double().flatten(1)
        return torch.stack([f.mean(1), f.std(1)], 1)

    s = stats(train_x)
    mu, cov = s.mean(0), torch.cov(s.T) + 1e-9 * torch.eye(2, dtype=torch.float64)
    prec = torch.linalg.inv(cov)

    def dist(x: Tensor) -> list[float]:
        d = stats(x) - mu
        return torch.einsum("ni,ij,nj->n", d, prec, d).sqrt().tolist()

    return {k: dist(v) for k, v in sets.items()}


# ----------------------------------------------------------------------------------------------
# One unit: a data set and a seed


def unit(cache: ConvergedCache, dataset: str, seed: int) -> dict:
    """Train (or load) the eight networks, fit the three posteriors, predict and measure."""

    def compute() -> dict:
        b = cache.budget
        data, n_id = load(dataset, b)
        timing: dict[str, float] = {}
        t0 = time.perf_counter()
        factor = FACTORS[dataset]
        nets, records = {}, {}
        for k, spec in specs(b).items():
            nets[k], records[k] = cache.net_and_record(spec, data, factor, seed)
        timing["train (this run)"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        posteriors, prior_info = {}, {}
        for name, key in POSTERIOR_NETS.items():
            la, info = lp.fit_posterior(cache, name, nets[key], data, factor, seed)
            info = dict(info, **tune_priors(la, info, data, b, seed))
            posteriors[name], prior_info[name] = (la, info), info
        timing["posteriors"] = time.perf_counter() - t0

        x_id, y_id = data.test_x[:n_id][: b.n_test], data.test_y[:n_id][: b.n_test]
        if dataset == "nuclei":
            shifted = {"volume": (data.test_x[n_id:], data.test_y[n_id:])}
        else:
            xs, ys = x_id[: b.n_shift], y_id[: b.n_shift]
            shifted = {
                k: (lp.shift(xs, k, st[len(st) // 2]), ys) for k, (st, _) in lp.SHIFTS.items()
            }
        _, _, x_box, box, _, _ = lp._boxed(data, b, seed)

        t0 = time.perf_counter()
        fns = predictors(nets, posteriors, b, seed)
        res: dict[str, dict] = {}
        sums: dict[str, dict] = {}
        for method, fn in fns.items():
            r: dict = {"sets": {}}
            sums[method] = {}
            preds = {"clean": fn(x_id)} | {k: fn(x) for k, (x, _) in shifted.items()}
            if method == "MAP entropy":
                map_clean = preds["clean"]
            truth = {"clean": y_id} | {k: y for k, (_, y) in shifted.items()}
            edges = histogram_edges([p.mean for p in preds.values()], b)
            for k, p in preds.items():
                r["sets"][k], sums[method][k] = measure(p, truth[k], b, edges)
            pooled = Pred(
                torch.cat([preds[k].mean for k in shifted]),
                torch.cat([preds[k].entropy for k in shifted]),
                None,
                None,
            )
            pooled_r, _ = measure(pooled, torch.cat([truth[k] for k in shifted]), b, edges)
            r["shifted"] = {k: v for k, v in pooled_r.items() if not isinstance(v, list)}
            clean = torch.tensor(r["sets"]["clean"]["u_mean"])
            clean_fg = torch.tensor(r["sets"]["clean"]["u_fg"])
            r["shift_auroc"] = {
                k: auroc(clean, torch.tensor(r["sets"][k]["u_mean"])) for k in shifted
            }
            r["shift_auroc_fg"] = {
                k: auroc(clean_fg, torch.tensor(r["sets"][k]["u_fg"])) for k in shifted
            }
            if method in LAPLACE:
                r["spread"] = spread(preds["clean"], map_clean)
            if method != "MAP entropy":
                var = _epistemic_variance(method, posteriors, fn, x_box, b, seed)
                r["box_ratio"] = box_ratio(var, box).mean().item()
            res[method] = r
        timing["predict and measure"] = time.perf_counter() - t0
        scores = image_statistics(
            data.train_x, {"clean": x_id} | {k: x for k, (x, _) in shifted.items()}
        )
        clean_s = torch.tensor(scores["clean"])
        res[IMAGE_STATS] = {
            "scores": scores,
            "shift_auroc": {k: auroc(clean_s, torch.tensor(scores[k])) for k in shifted},
        }
        if dataset == "nuclei":  # direction fixed in advance: larger distance = shifted
            raw = image_statistics(
                data.train_x,
                {"clean": x_id, "volume": volume_on_training_scale(shifted["volume"][0])},
            )
            res[IMAGE_STATS_RAW] = {
                "scores": raw,
                "shift_auroc": {
                    "volume": auroc(torch.tensor(raw["clean"]), torch.tensor(raw["volume"]))
                },
            }
        cache.save(sums, cache.path("unc-sums", dataset, f"s{seed}"))
        return {
            "methods": res,
            "nets": records,
            "posteriors": prior_info,
            "timing": timing,
            "box_area": box.double().flatten(1).mean(1).mean().item(),
            "shift_kinds": list(shifted),
            "n_images": {"clean": len(x_id)} | {k: len(x) for k, (x, _) in shifted.items()},
        }

    return cache.result(f"unc-{dataset}-s{seed}", compute)


def tune_priors(la: object, info: dict, data: lp.Data, b: ConvergedBudget, seed: int) -> dict:
    """The prior precisions of the Laplace methods: the validation-NLL grid of the ``nn``
    predictive (``info``, from :func:`lsn_paper.fit_posterior`), the same grid scored with the
    ``glm`` predictive, and laplace-torch's scalar marginal likelihood (one value, used with
    either predictive: ``nn-marglik`` and ``glm-marglik``)."""
    grid = [10.0**k for k in b.prior_exponents]
    search = gridsearch_prior_precision(
        la, lp._loader(data.val_x, data.val_y), grid=grid, n_samples=b.n_val_samples,
        pred_type="glm", seed=seed,
    )  # fmt: skip
    with warnings.catch_warnings():  # laplace-torch's note on link_approx is for its grid search
        warnings.filterwarnings("ignore", "By default `link_approx`", UserWarning)
        la.prior_precision = 1.0
        la.optimize_prior_precision(method="marglik", prior_structure="scalar", n_steps=200)
    marglik = float(la.prior_precision)
    la.prior_precision = info["prior_precision"]
    best = grid.index(search.prior_precision)
    return {
        "nn-grid": info["prior_precision"],
        "glm-grid": search.prior_precision,
        "glm-marglik": marglik,
        "nn-marglik": marglik,
        "glm_at_edge": best in (0, len(grid) - 1),
    }


def _run_unit(args: tuple) -> tuple[tuple, float]:
    root, budget, threads, (dataset, seed) = args
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    unit(ConvergedCache(root, budget), dataset, seed)
    return ("uncertainty", dataset, seed), time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# Statistics


HIGHER_IS_BETTER = {
    "auroc": True,
    "auprc": True,
    "ece": False,
    "nll": False,
    "brier": False,
    "dice": True,
    "aurc": False,
    "e_aurc": False,
    "aurc_fg": False,
    "e_aurc_fg": False,
    "spearman": False,
    "spearman_fg": False,
    "shift_auroc": True,
    "shift_auroc_fg": True,
    "shifted_auroc": True,
    "shifted_aurc": False,
    "box_ratio": True,
}


def _rank_rows(x: Tensor) -> Tensor:
    """Average ranks along the last axis (ties share their mean rank)."""
    from scipy.stats import rankdata

    return torch.from_numpy(rankdata(x.numpy(), axis=-1))


def _boot_image_metric(metric: str, per_image: dict, idx: Tensor) -> Tensor:
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


def _boot_pixel_metric(metric: str, s: dict, idx: Tensor) -> Tensor:
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


def bootstrap(per_seed: list[tuple[int, object]], b: ConvergedBudget, seed: int = 0):
    """Percentile 95 % interval of a metric's mean over seeds under resampled test images
    (:func:`stats.percentile_bootstrap` with ``b.n_bootstrap`` resamples)."""
    return percentile_bootstrap(per_seed, b.n_bootstrap, seed)


def _shift_boot(clean: list[float], shifted: list[float]) -> tuple[int, object]:
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


# ----------------------------------------------------------------------------------------------
# Report


def _value(r: dict, metric: str, kind: str | None = None) -> float | None:
    """One method's metric in one unit's result (``kind``: a shift)."""
    if metric in ("shift_auroc", "shift_auroc_fg"):
        v = r[metric]
        return v[kind] if kind else sum(v.values()) / len(v)
    if metric == "shifted_auroc":
        return r["shifted"]["auroc"]
    if metric == "shifted_aurc":
        return r["shifted"]["aurc"]
    if metric == "box_ratio":
        return r.get("box_ratio")
    return r["sets"]["clean"][metric]


class Report:
    """Cells of the report from the cached unit results of one budget."""

    def __init__(self, cache: ConvergedCache, datasets: list[str], seeds: list[int]):
        self.cache, self.datasets, self.seeds, self.b = cache, datasets, seeds, cache.budget
        self.res = {(d, s): cache.stored(f"unc-{d}-s{s}") for d in datasets for s in seeds}
        missing = [k for k, v in self.res.items() if v is None]
        if missing:
            raise SystemExit(f"no cached results for {missing}; run without --report-only first")
        self.sums = {
            (d, s): torch.load(cache.path("unc-sums", d, f"s{s}"), weights_only=False)
            for d in datasets
            for s in seeds
        }

    def values(self, d: str, method: str, metric: str, kind: str | None = None) -> list[float]:
        out = [_value(self.res[d, s]["methods"][method], metric, kind) for s in self.seeds]
        return [v for v in out if v is not None]

    def boot(self, d: str, method: str, metric: str, kind: str | None = None):
        per_seed: list[tuple[int, object]] = []
        for s in self.seeds:
            r = self.res[d, s]["methods"][method]
            if metric in ("shift_auroc", "shift_auroc_fg"):
                if kind is None:
                    return None
                key = "u_fg" if metric.endswith("_fg") else "u_mean"
                if method in (IMAGE_STATS, IMAGE_STATS_RAW):
                    clean, shifted = r["scores"]["clean"], r["scores"][kind]
                else:
                    clean, shifted = r["sets"]["clean"][key], r["sets"][kind][key]
                per_seed.append(_shift_boot(clean, shifted))
            elif metric in ("auroc", "auprc", "ece", "nll", "brier"):
                sm = self.sums[d, s][method]["clean"]
                fn = lambda idx, sm=sm: _boot_pixel_metric(metric, sm, idx)  # noqa: E731
                per_seed.append((len(sm["pixels"]), fn))
            elif metric in ("aurc", "e_aurc", "aurc_fg", "e_aurc_fg", "spearman", "spearman_fg"):
                per = r["sets"]["clean"]
                fn = lambda idx, per=per: _boot_image_metric(metric, per, idx)  # noqa: E731
                per_seed.append((len(per["u_mean"]), fn))
            elif metric == "dice":
                dice = torch.tensor(r["sets"]["clean"]["dice_per_image"], dtype=torch.float64)
                per_seed.append((len(dice), lambda idx, dice=dice: dice[idx].mean(1)))
            elif metric == "shifted_auroc":
                kinds = self.res[d, s]["shift_kinds"]
                sm = {
                    k: torch.cat([self.sums[d, s][method][c][k] for c in kinds])
                    for k in ("hist_err", "hist_ok", "pixels")
                }
                fn = lambda idx, sm=sm: _boot_pixel_metric("auroc", sm, idx)  # noqa: E731
                per_seed.append((len(sm["pixels"]), fn))
            elif metric == "shifted_aurc":
                kinds = self.res[d, s]["shift_kinds"]
                per = {
                    k: [v for c in kinds for v in r["sets"][c][k]]
                    for k in ("u_mean", "dice_per_image")
                }
                fn = lambda idx, per=per: _boot_image_metric("aurc", per, idx)  # noqa: E731
                per_seed.append((len(per["u_mean"]), fn))
            else:
                return None
        return bootstrap(per_seed, self.b)

    def cell(self, d: str, method: str, metric: str, kind: str | None = None) -> str:
        v = self.values(d, method, metric, kind)
        if not v:
            return "n/a"
        text = fmt(v)
        if len(v) < len(self.seeds):
            text += f" ({len(v)}/{len(self.seeds)} seeds)"
        bi = self.boot(d, method, metric, kind)
        return text + (f" [{bi[0]:.3f}, {bi[1]:.3f}]" if bi else "")

    def paired(self, d: str, method: str, ref: str, metric: str) -> str:
        if method == ref:
            return "—"
        a = [_value(self.res[d, s]["methods"][method], metric) for s in self.seeds]
        r = [_value(self.res[d, s]["methods"][ref], metric) for s in self.seeds]
        both = [(x, y) for x, y in zip(a, r, strict=True) if x is not None and y is not None]
        if not both:
            return "n/a"
        p = stats_paired([x for x, _ in both], [y for _, y in both], HIGHER_IS_BETTER[metric])
        return f"{p.diff.fmt(sign=True)} ({p.better}/{p.n})"


CLEAN_PIXEL = (
    ("auroc", "AUROC"),
    ("auprc", "AUPRC"),
    ("ece", "ECE"),
    ("nll", "NLL"),
    ("brier", "Brier"),
    ("dice", "Dice"),
)
CLEAN_IMAGE = (
    ("aurc_fg", "AURC, fg score"),
    ("e_aurc_fg", "E-AURC, fg score"),
    ("spearman_fg", "Spearman (fg score, Dice)"),
    ("aurc", "AURC, whole-image score (not to use)"),
    ("spearman", "Spearman (whole-image score, Dice)"),
)
PAIRED = (
    ("auroc", "pixel AUROC"),
    ("aurc_fg", "AURC, fg score"),
    ("e_aurc_fg", "E-AURC, fg score"),
    ("aurc", "AURC, whole-image score (not to use)"),
    ("shift_auroc_fg", "shift AUROC, fg score (mean over shifts)"),
    ("shift_auroc", "shift AUROC, whole-image score (mean over shifts)"),
    ("shifted_auroc", "pixel AUROC, shifted"),
    ("shifted_aurc", "AURC, shifted"),
)


def _section_pixels(rep: Report, d: str) -> str:
    rows = [[m] + [rep.cell(d, m, k) for k, _ in CLEAN_PIXEL] for m in METHODS]
    return f"### {d}\n\n" + lp._table(["Method"] + [h for _, h in CLEAN_PIXEL], rows)


def _section_images(rep: Report, d: str) -> str:
    rows = [[m] + [rep.cell(d, m, k) for k, _ in CLEAN_IMAGE] for m in METHODS]
    oracle = [
        rep.res[d, s]["methods"]["MAP entropy"]["sets"]["clean"]["oracle_aurc"] for s in rep.seeds
    ]
    return (
        f"### {d}\n\n"
        + lp._table(["Method"] + [h for _, h in CLEAN_IMAGE], rows)
        + f"\n\nOracle AURC of the MAP U-Net's segmentations: {fmt(oracle)} (each method "
        "has its own, from its own Dice; E-AURC subtracts it).\n"
    )


def _section_shift(rep: Report, d: str) -> str:
    kinds = rep.res[d, rep.seeds[0]]["shift_kinds"]
    rows = []
    present = rep.res[d, rep.seeds[0]]["methods"]
    stats_rows = [m for m in (IMAGE_STATS, IMAGE_STATS_RAW) if m in present]
    for m in (*METHODS, *stats_rows):
        row = [m] + [rep.cell(d, m, "shift_auroc", k) for k in kinds]
        if m in (IMAGE_STATS, IMAGE_STATS_RAW):
            row += ["—", "—", "—"]
        else:
            row += [rep.cell(d, m, k) for k in ("shifted_auroc", "shifted_aurc")]
            row += [fmt([rep.res[d, s]["methods"][m]["shifted"]["dice"] for s in rep.seeds])]
        rows.append(row)
    n = rep.res[d, rep.seeds[0]]["n_images"]
    what = (
        f"{n['clean']} clean test images against each corruption of the first "
        f"{n[kinds[0]]} at its middle strength, synthetic corruptions of the synthetic images "
        "on the standardised input scale ("
        + "; ".join(f"{k} {st[len(st) // 2]}: {mean}" for k, (st, mean) in lp.SHIFTS.items())
        + ")"
        if d == "lesions"
        else f"the {n['clean']} 2-D test patches against the {n['volume']} slices of stardist's "
        "synthetic 3-D nuclei volume, standardised by the volume's own statistics (which "
        "removes a global intensity shift by construction); "
        f"{IMAGE_STATS_RAW}: the same score with the slices on the 2-D training image's "
        "intensity scale"
    )
    return (
        f"### {d}\n\n"
        + lp._table(
            ["Method"]
            + [f"shift AUROC: {k}" for k in kinds]
            + ["pixel AUROC on shifted", "AURC on shifted", "Dice on shifted"],
            rows,
        )
        + f"\n\nShift AUROC: {what}; score = mean pixel entropy of the whole image (image "
        "statistics: see above; larger distance = shifted, fixed before any test label). "
        "Pixel AUROC and AURC on shifted: the failure-detection measures on all "
        "shifted images pooled.\n"
    )


def _section_paired(rep: Report, d: str) -> str:
    parts = []
    for ref in ("MAP entropy", ENSEMBLE):
        rows = [[m] + [rep.paired(d, m, ref, k) for k, _ in PAIRED] for m in METHODS]
        parts.append(
            f"### {d}: against {ref}\n\n" + lp._table(["Method"] + [h for _, h in PAIRED], rows)
        )
    return "\n\n".join(parts)


def _section_box(rep: Report) -> str:
    rows = []
    for m in METHODS[1:]:
        rows.append([m] + [rep.cell(d, m, "box_ratio") for d in rep.datasets])
    area = [lp._mean([rep.res[d, s]["box_area"] for s in rep.seeds]) for d in rep.datasets]
    return (
        lp._table(["Method"] + [f"Box Ratio noise ({d})" for d in rep.datasets], rows)
        + "\n\nBox Ratio (LSN Eq. 17) of the epistemic variance map on the first "
        f"{rep.b.n_eval} test images (nuclei: all 46, the volume's slices included, as in "
        "`lsn_paper.py`) with a noise box (`lsn_paper._boxed`, boxes redrawn per "
        "seed); epistemic map: Var p over the dropout passes, the ensemble members, the "
        "posterior samples of the U-Net (U-Net + LA) or of the SSN's mean network (LSN), with "
        "the `nn` or `glm` predictive. A variance spread evenly over the image gives "
        + ", ".join(f"{a:.3f} ({d})" for a, d in zip(area, rep.datasets, strict=True))
        + ". The MAP U-Net has no epistemic map.\n"
    )


def _spread_table(rep: Report) -> str:
    rows = []
    for d in rep.datasets:
        for m in LAPLACE:
            sp = [rep.res[d, s]["methods"][m].get("spread") for s in rep.seeds]
            if any(v is None for v in sp):  # a result from before the diagnostic existed
                continue
            cells = [fmt([v[k] for v in sp], 4) for k in ("entropy_ratio", "mean_abs_dp")]
            sd = [v["mean_sd_p"] for v in sp if "mean_sd_p" in v]
            rows.append([f"{d}: {m}", *cells, fmt(sd, 4) if sd else "—"])
    header = ["method", "mean entropy ÷ MAP's", "mean abs(E p − p_MAP)", "mean posterior sd of p"]
    return lp._table(header, rows)


def _section_training(rep: Report) -> str:
    rows = []
    n_stopped = n_all = 0
    for d in rep.datasets:
        for group, keys in (("U-Nets (6)", NETS[:6]), ("SSNs (2)", NETS[6:])):
            recs = [rep.res[d, s]["nets"][k] for s in rep.seeds for k in keys]
            best = torch.tensor([r["best_step"] for r in recs], dtype=torch.float64)
            run = torch.tensor([r["steps_run"] for r in recs], dtype=torch.float64)
            stopped = sum(r["stopped_early"] for r in recs)
            n_stopped, n_all = n_stopped + stopped, n_all + len(recs)
            dice = [r["best_val_dice"] for r in recs]
            secs = [r["seconds"] for r in recs]
            rows.append(
                [
                    f"{d}: {group}",
                    f"{best.median().item():.0f} ({best.min().item():.0f}–{best.max().item():.0f})",
                    f"{run.median().item():.0f} ({run.min().item():.0f}–{run.max().item():.0f})",
                    f"{stopped}/{len(recs)}",
                    f"{lp._mean(dice):.3f}",
                    f"{lp._mean(secs):.0f}",
                ]
            )
    priors = [
        (d, name, info) for (d, _), v in rep.res.items() for name, info in v["posteriors"].items()
    ]
    prior_rows = []

    def span(values: list[float]) -> str:
        return f"{min(values):.1e} … {max(values):.1e}"

    for d in rep.datasets:
        for name in POSTERIOR_NETS:
            infos = [i for dd, n, i in priors if dd == d and n == name]
            prior_rows.append(
                [
                    f"{d}: {name}",
                    span([i["nn-grid"] for i in infos]),
                    f"{sum(i['at_edge'] for i in infos)}/{len(infos)}",
                    span([i["glm-grid"] for i in infos]),
                    f"{sum(i['glm_at_edge'] for i in infos)}/{len(infos)}",
                    span([i["glm-marglik"] for i in infos]),
                ]
            )
    n_edge = sum(i["at_edge"] + i["glm_at_edge"] for _, _, i in priors)
    collapsed = [
        f"{d} seed {s} {k} ({r['best_val_dice']:.2f})"
        for (d, s), v in rep.res.items()
        for k, r in v["nets"].items()
        if r["best_val_dice"] < 0.05
    ]
    timing_rows = []
    for part in ("posteriors", "predict and measure"):
        t = [rep.res[k]["timing"][part] for k in rep.res]
        timing_rows.append([part, f"{sum(t) / 60:.1f}", f"{max(t) / 60:.1f}"])
    train_t = [sum(r["seconds"] for r in rep.res[k]["nets"].values()) for k in rep.res]
    timing_rows.insert(
        0, ["training (8 networks)", f"{sum(train_t) / 60:.1f}", f"{max(train_t) / 60:.1f}"]
    )
    return (
        lp._table(
            [
                "Networks",
                "step of best val. Dice: median (range)",
                "steps run: median (range)",
                "stopped by patience",
                "mean best val. Dice",
                "mean seconds",
            ],
            rows,
        )
        + f"\n\nEarly stopping reached its patience in {n_stopped} of {n_all} networks; the "
        f"others ran to the cap of {rep.b.steps} steps (their best checkpoint is still kept). "
        f"No stop before step {rep.b.min_steps} or while the best Dice was still "
        f"{rep.b.stop_floor:g}. Networks whose best validation Dice stayed "
        "below 0.05 (still predicting background): "
        + (", ".join(collapsed) or "none")
        + ".\n\n"
        + lp._table(
            [
                "posterior",
                "prior: nn grid (range over seeds)",
                "at edge",
                "prior: glm grid",
                "at edge",
                "prior: marglik",
            ],
            prior_rows,
        )
        + f"\n\nPrior precision by validation NLL of each predictive on "
        f"10^{rep.b.prior_exponents[0]}…10^{rep.b.prior_exponents[-1]} "
        f"({rep.b.n_val_samples} posterior samples per candidate), and by laplace-torch's "
        f"scalar marginal likelihood: at an end of the grid in {n_edge} of {2 * len(priors)} "
        "searches. At the upper end the posterior is nearly a point mass at the trained weights, "
        "so the Laplace predictive equals the MAP's (U-Net + LA ≈ MAP entropy; LSN ≈ the SSN's "
        "own aleatoric predictive) and `nn` and `glm` coincide.\n\n"
        + _spread_table(rep)
        + "\n\nThe posterior predictive against the MAP's on the clean test images (mean over "
        "seeds ± 95 % t-interval): the ratio of their mean entropies, the mean "
        "abs(E p − p_MAP) and the mean posterior sd of p. A ratio near 1 and a small "
        "difference mean the prior left the predictive where the MAP's is.\n\n"
        + lp._table(["part", "summed wall min, all units", "longest unit, min"], timing_rows)
        + "\n\nWall-clock time (`time.perf_counter`) of each part as it ran, one torch thread per "
        "unit and two units side by side on the 2 cores, summed over the units: not CPU time. "
        "Training times as recorded when each network was trained.\n"
    )


def risk_coverage_figure(rep: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rep.datasets), figsize=(5.2 * len(rep.datasets), 4.0))
    axes = [axes] if len(rep.datasets) == 1 else list(axes)
    for ax, d in zip(axes, rep.datasets, strict=True):
        for m in METHODS:
            curves = []
            for s in rep.seeds:
                per = rep.res[d, s]["methods"][m]["sets"]["clean"]
                dice = torch.tensor(per["dice_per_image"], dtype=torch.float64)
                cov, risk = risk_coverage(torch.tensor(per["u_mean"]), 1 - dice)
                curves.append(risk)
            ax.plot(cov.numpy(), torch.stack(curves).mean(0).numpy(), label=m, lw=1)
        oracle = []
        for s in rep.seeds:
            dice = torch.tensor(
                rep.res[d, s]["methods"]["MAP entropy"]["sets"]["clean"]["dice_per_image"],
                dtype=torch.float64,
            )
            oracle.append(risk_coverage(1 - dice, 1 - dice)[1])
        ax.plot(cov.numpy(), torch.stack(oracle).mean(0).numpy(), "k--", lw=1, label="oracle (MAP)")
        ax.set_title(f"{d}: clean test images, mean over {len(rep.seeds)} seeds", fontsize=9)
        ax.set_xlabel("coverage (most certain images kept)")
        ax.set_ylabel("selective risk, 1 − Dice")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CSV_COLUMNS = (
    "auroc",
    "auprc",
    "auroc_mi",
    "ece",
    "nll",
    "brier",
    "dice",
    "error_rate",
    "aurc",
    "oracle_aurc",
    "e_aurc",
    "aurc_fg",
    "e_aurc_fg",
    "aurc_mi",
    "spearman",
    "spearman_fg",
)


SPREAD = ("entropy_ratio", "mean_abs_dp", "mean_sd_p")


def write_csv(rep: Report, path: Path) -> None:
    kinds = sorted({k for v in rep.res.values() for k in v["shift_kinds"]})
    header = ["dataset", "seed", "method"] + [f"clean_{c}" for c in CSV_COLUMNS]
    header += ["shifted_auroc", "shifted_aurc", "shifted_dice"]
    header += [f"shift_auroc_{k}" for k in kinds] + [f"shift_auroc_fg_{k}" for k in kinds]
    header += ["box_ratio_noise", *SPREAD]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for (d, s), res in rep.res.items():
            for m in (*METHODS, IMAGE_STATS, IMAGE_STATS_RAW):
                if m not in res["methods"]:
                    continue
                r = res["methods"][m]
                row: list = [d, s, m]
                clean = r.get("sets", {}).get("clean", {})
                row += [clean.get(c, "") for c in CSV_COLUMNS]
                sh = r.get("shifted", {})
                row += [sh.get("auroc", ""), sh.get("aurc", ""), sh.get("dice", "")]
                row += [r["shift_auroc"].get(k, "") for k in kinds]
                row += [r.get("shift_auroc_fg", {}).get(k, "") for k in kinds]
                row += [r.get("box_ratio", "")]
                row += [r.get("spread", {}).get(k, "") for k in SPREAD]
                w.writerow(
                    ["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in row]
                )


def write_report(
    cache: ConvergedCache, datasets: list[str], seeds: list[int], out: Path, quick: bool
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(cache, datasets, seeds)
    b = rep.b
    intro = [
        "# Failure detection and calibration of segmentation uncertainty",
        f"Generated by `integration/uncertainty_benchmark.py` ({'--quick' if quick else 'full run'}"
        f"); {len(seeds)} seeds ({', '.join(map(str, seeds))}) per data set. " + machine(),
        "Budget: U-Net widths "
        f"{'-'.join(map(str, b.widths))} (tanh), SSN rank {b.rank} and 0; every network trained "
        f"with Adam ({b.batch_size} images per step, lr {b.lr} with cosine decay over the "
        f"cap of {b.steps} steps, random flips as `lsn_paper.train`) and early stopping: "
        f"validation Dice (pooled over the validation images, threshold ½ on the (mean) logit) "
        f"every {b.eval_every} steps, stop after {b.patience} evaluations without improvement "
        f"(not before step {b.min_steps}, nor while the best Dice is still {b.stop_floor:g}), "
        "best checkpoint kept. Foreground weight of every network's likelihood (U-Nets: "
        "BCE `pos_weight`; SSNs: `lsn_paper`'s `ssn_loss` objective, 20 antithetic logit "
        f"samples): {', '.join(f'{d} {FACTORS[d]}' for d in datasets)} (unweighted lesion U-Nets "
        "and rank-0 SSNs stay at background, `lsn_paper` Table 1; one weight for all keeps the "
        f"calibration comparison even). Ensemble: {b.ensemble} U-Nets, the first being the MAP "
        "U-Net and "
        f"U-Net + LA's; MC dropout: p = {b.dropout}, {b.n_dropout} passes. Laplace: diagonal GGN "
        '(`estimator="mc"`) over all weights of the U-Net, or of the SSN\'s backbone and mean '
        "head (LSN); prior precision by the validation NLL of the predictive used (`nn` or "
        f"`glm`, grid 10^{b.prior_exponents[0]}…10^{b.prior_exponents[-1]}), or by scalar "
        "marglik (`glm, marglik`); predictives with "
        f'{b.n_epistemic} posterior samples (`link_approx="mc"`), LSN with {b.n_aleatoric} '
        "logit samples per posterior sample; `nn`: the network at sampled weights, `glm`: "
        "its linearisation.",
    ]
    for d in datasets:
        data, n_id = load(d, b)
        intro.append(f"- {d}: {data.notes}; the first {min(n_id, b.n_test)} (clean) test images.")
    recs = [r for v in rep.res.values() for r in v["nets"].values()]
    intro.append(
        f"Early stopping reached its patience in {sum(r['stopped_early'] for r in recs)} of "
        f"{len(recs)} networks; the others hit the cap of {b.steps} steps (details and the cost "
        "of each part: last section)."
    )
    intro.append(
        "**Scores.** Pixel: predictive entropy of the total predictive `E p` (nats). Image: the "
        "mean pixel entropy; and a foreground-adjusted variant, the mean entropy within the "
        f"predicted foreground (`E p > ½`) dilated by {b.fg_dilation} pixels (the whole image "
        "where nothing is predicted) — chosen because the whole-image mean is diluted by the "
        "confidently empty background, whose share varies with object size, while a Dice "
        "failure can only happen at or near predicted objects. Image statistics (shift only): "
        "the Mahalanobis distance of an image's (intensity mean, intensity standard deviation) "
        "over all pixels and channels from the training images' mean of these two numbers, "
        "under their 2×2 covariance over the training images."
    )
    intro.append(
        "**Metrics.** Pixel misclassified: `(E p > ½) ≠ mask`. AUROC/AUPRC of the entropy for "
        "it, pooled over the test pixels of a seed; ECE: 15 equal-width bins of the confidence "
        "`max(p, 1 − p)` on [0, 1]; NLL (nats per pixel, p clipped to [1e-7, 1 − 1e-7]); Brier "
        "`mean (p − y)²`. AURC: images sorted by increasing uncertainty, the mean over k = 1…n "
        "of the mean risk `1 − Dice` of the k most certain images (Dice per image of `E p > ½`; "
        "both prediction and mask empty: Dice 1); oracle AURC: sorted by the risk itself; "
        "E-AURC = AURC − oracle. Spearman: rank correlation of the per-image uncertainty with "
        "Dice (negative is good). Shift AUROC: the per-image score for shifted (positive) "
        "against clean images (Mann–Whitney). Lower is better for ECE, NLL, Brier, AURC, "
        "E-AURC and Spearman."
    )
    intro.append(
        "**Statistics.** Each cell: mean ± 95 % t-interval over seeds, then in brackets a "
        f"bootstrap interval over test images: {b.n_bootstrap} resamples; in each, every "
        "seed's test images are resampled with replacement (independently per seed; clean and "
        "shifted images separately for the shift AUROC), the metric computed per seed and "
        "averaged over seeds; the interval is the 2.5 and 97.5 percentiles of these averages. "
        "It shows the uncertainty from the few test images given the trained networks; the "
        "t-interval shows the seed-to-seed spread. The pixel AUROC and AUPRC in the bootstrap "
        f"come from per-image histograms of the entropy ({b.hist_bins} bins per method at the "
        "quantiles of its pixels' |logit E p|, which orders pixels as the entropy does); the "
        "point estimates are exact. Paired differences: per-seed "
        "difference method − reference, mean ± 95 % t-interval, and (k/n) = better on k of n "
        "seeds."
    )
    sections = ["\n\n".join(intro)]
    sections.append(
        "## Pixel failure detection and calibration (clean test images)\n\n"
        + "\n\n".join(_section_pixels(rep, d) for d in datasets)
    )
    sections.append(
        "## Image failure detection: risk–coverage (clean test images)\n\n"
        + "\n\n".join(_section_images(rep, d) for d in datasets)
        + "\n\n![risk–coverage](uncertainty_risk_coverage.png)"
    )
    sections.append(
        "## Shift detection and failure detection under shift\n\n"
        + "\n\n".join(_section_shift(rep, d) for d in datasets)
    )
    sections.append(
        "## Paired differences against MAP entropy and Ensemble (5)\n\n"
        "Positive differences are better for AUROCs, negative ones for AURC and E-AURC. A "
        "difference whose interval includes 0 is no measured difference. Image-level "
        "conclusions rest on the fg score; the whole-image score is shown for comparison.\n\n"
        + "\n\n".join(_section_paired(rep, d) for d in datasets)
    )
    sections.append(
        "## Table 2 re-answered: Box Ratio with converged networks\n\n" + _section_box(rep)
    )
    sections.append("## Training and cost\n\n" + _section_training(rep))
    risk_coverage_figure(rep, out / "uncertainty_risk_coverage.png")
    write_csv(rep, out / "uncertainty_per_seed.csv")
    path = out / "uncertainty.md"
    path.write_text("\n\n".join(sections) + "\n")
    return path


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default=None, help="e.g. 0-4 or 0,2 (default 0-4; quick 0,1)")
    parser.add_argument("--datasets", default="lesions,nuclei")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--cache", type=Path, default=None, help="default results/.cache/...")
    parser.add_argument("--out", type=Path, default=None, help="default integration/results")
    parser.add_argument("--quick", action="store_true", help="tiny sizes into a temporary dir")
    parser.add_argument("--report-only", action="store_true", help="only write the report")
    args = parser.parse_args(argv)
    budget = QUICK if args.quick else ConvergedBudget()
    seeds = lp._seeds(args.seeds or ("0,1" if args.quick else "0-4"))
    datasets = [d for d in args.datasets.split(",") if d]
    unknown = sorted(set(datasets) - {"lesions", "nuclei"})
    if unknown:
        parser.error(f"unknown data sets {unknown}; use lesions and/or nuclei")
    tmp = Path(tempfile.mkdtemp(prefix="uncertainty-")) if args.quick else None
    out = args.out or (tmp if tmp else RESULTS)
    root = args.cache or ((tmp / "cache") if tmp else RESULTS / ".cache" / "uncertainty")
    cache = ConvergedCache(root, budget)
    units = [] if args.report_only else [(d, s) for d in datasets for s in seeds]
    work = [(root, budget, 1, u) for u in units]
    t0 = time.perf_counter()
    if args.workers > 1 and len(work) > 1:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            for key, dt in pool.imap_unordered(_run_unit, work):
                lp._record(cache, key, dt)
    else:
        for w in work:
            lp._record(cache, *_run_unit((*w[:2], torch.get_num_threads(), w[3])))
    if units:
        print(f"[uncertainty] all units: {time.perf_counter() - t0:.0f} s wall", flush=True)
    path = write_report(cache, datasets, seeds, out, args.quick)
    print(path.read_text())
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
