"""The units of work of the LSN paper's experiments (one data set, factor and seed each; run in
worker processes): Table 1's IoU, Table 2 with Fig. 4 and 5, Fig. 7's shifts, the diagnosis."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from laplace import Laplace
from torch import Tensor

from integration.experiments.kit import (
    SHIFTS,
    Budget,
    Cache,
    boxed,
    fit_posterior,
    load_data,
    region_means,
    shift,
)
from integration.experiments.lsn_paper.design import DIAGNOSE_SPECS, EVAL_FACTORS, models, specs
from lsn_ext import predict
from lsn_ext.lsn import aleatoric_maps
from lsn_ext.metrics import (
    auroc,
    average_precision,
    boundary_share,
    box_ratio,
    iou,
    per_image_entropy,
    pixel_ratio,
)
from lsn_ext.models import SSN


def unit_table1(cache: Cache, dataset: str, factor: int, seed: int) -> dict:
    """Test IoU of the seven models' predictive means at one reweighting factor and seed."""

    def compute() -> dict:
        data = load_data(dataset, cache.budget)
        b = cache.budget
        x, y = data.test_x[: b.n_iou], data.test_y[: b.n_iou]
        out = {}
        for name, model in models(cache, data, (factor, factor), seed).items():
            p = model.epistemic(x, b.n_iou_samples, seed)
            out[name] = {"iou": iou(p.mean > 0.5, y > 0.5), **model.info}
        return out

    return cache.result(f"table1-{dataset}-f{factor}-s{seed}", compute)


def unit_eval(cache: Cache, dataset: str, seed: int) -> dict:
    """Table 2, Fig. 4 and Fig. 5 of one data set and seed (shared predictions)."""

    def compute() -> dict:
        b = cache.budget
        data = load_data(dataset, b)
        x, y, x_noise, box_noise, x_black, box_black = boxed(data, b, seed)
        inputs = {"id": x, "noise": x_noise, "black": x_black}
        boxes = {"noise": box_noise, "black": box_black}
        out: dict[str, dict] = {}
        for name, model in models(cache, data, EVAL_FACTORS[dataset], seed).items():
            p = {k: model.epistemic(v, b.n_epistemic, seed) for k, v in inputs.items()}
            r: dict = {"iou": iou(p["id"].mean > 0.5, y > 0.5), **model.info}
            for k in ("noise", "black"):
                r[f"pixel_{k}"] = pixel_ratio(p["id"].variance, p[k].variance).tolist()
                r[f"box_{k}"] = box_ratio(p[k].variance, boxes[k]).tolist()
                r[f"box_area_{k}"] = boxes[k].double().flatten(1).mean(1).tolist()
            if model.aleatoric is not None:
                ale = {k: model.aleatoric(v, seed) for k, v in inputs.items()}
                for k in ("noise", "black"):
                    r[f"ap_aleatoric_{k}"] = average_precision(ale[k], boxes[k])
                    r[f"ap_epistemic_{k}"] = average_precision(p[k].variance, boxes[k])
                    r[f"box_aleatoric_{k}"] = box_ratio(ale[k], boxes[k]).mean().item()
                share, pixels = boundary_share(ale["id"], y)
                r["boundary_aleatoric"], r["boundary_pixels"] = share, pixels
                r["boundary_epistemic"] = boundary_share(p["id"].variance, y)[0]
                r["boundary_aleatoric_mean"] = region_means(ale["id"], y)
            r["boundary_epistemic_mean"] = region_means(p["id"].variance, y)
            out[name] = r
        return out

    return cache.result(f"eval-{dataset}-s{seed}", compute)


def unit_fig7(cache: Cache, dataset: str, seed: int) -> dict:
    """Per-image predictive entropy under each shift and strength, and AUROC against clean."""

    def compute() -> dict:
        b = cache.budget
        data = load_data(dataset, b)
        x = data.test_x[: b.n_shift]
        out: dict[str, dict] = {}
        for name, model in models(cache, data, EVAL_FACTORS[dataset], seed).items():
            clean = per_image_entropy(model.total(x, seed)[1])
            r: dict = {"clean": clean.mean().item()}
            for kind, (strengths, _) in SHIFTS.items():
                for s in strengths:
                    h = per_image_entropy(model.total(shift(x, kind, s), seed)[1])
                    r[f"{kind}:{s}"] = {"entropy": h.mean().item(), "auroc": auroc(clean, h)}
            out[name] = r
        return out

    return cache.result(f"fig7-{dataset}-s{seed}", compute)


def unit_diagnose(cache: Cache, dataset: str, seed: int) -> dict:
    """SSN loss variants' aleatoric maps, the prior precision, and the curvature estimator."""

    def compute() -> dict:
        b = cache.budget
        data = load_data(dataset, b)
        x, y, x_noise, box, _, _ = boxed(data, b, seed)
        out: dict[str, dict] = {"aleatoric": {}, "prior": {}, "estimator": {}}
        f_unet, f_ssn = EVAL_FACTORS[dataset]
        base = cache.net(specs(b)["ssn"], data, f_ssn, seed)
        for label, spec in DIAGNOSE_SPECS.items():
            ssn = base if spec is None else cache.net(spec, data, f_ssn, seed)
            out["aleatoric"][label] = _aleatoric_diagnosis(ssn, x, y, seed, b)
        for name in ("LSN", "U-Net + LA"):
            net = base if name == "LSN" else cache.net(specs(b)["unet0"], data, f_unet, seed)
            factor = f_ssn if name == "LSN" else f_unet
            la, info = fit_posterior(cache, name, net, data, factor, seed)
            out["prior"][name] = _prior_diagnosis(la, info, data, x, y, x_noise, box, seed, b)
        for estimator in ("db", "mc"):
            la, info = fit_posterior(cache, "LSN", base, data, f_ssn, seed, estimator)
            p_id = predict(
                la, x, b.n_diagnose_samples, generator=torch.Generator().manual_seed(seed)
            )
            p = predict(
                la, x_noise, b.n_diagnose_samples, generator=torch.Generator().manual_seed(seed)
            )
            out["estimator"][estimator] = {
                "prior_precision": info["prior_precision"],
                "H": la.H.detach().clone(),
                "iou": iou(p_id.mean > 0.5, y > 0.5),
                "box_noise": box_ratio(p.variance, box).mean().item(),
            }
        h_db, h_mc = (out["estimator"][e].pop("H") for e in ("db", "mc"))
        out["estimator"]["relative_difference"] = float((h_db - h_mc).norm() / h_mc.norm())
        out["estimator"]["sum_ratio_db_over_mc"] = float(h_db.sum() / h_mc.sum())
        return out

    return cache.result(f"diagnose-{dataset}-s{seed}", compute)


@torch.no_grad()
def _aleatoric_diagnosis(ssn: SSN, x: Tensor, y: Tensor, seed: int, b: Budget) -> dict:
    """Where an SSN puts its aleatoric variance: ``Var σ(η)``, ``Var η`` and IoU of ``σ(μ)``."""
    out = ssn.distribution(x)
    logit_var = out.cov_diag + out.cov_factor.pow(2).sum(-1).view_as(out.cov_diag)
    ale = aleatoric_maps(ssn, x, b.n_aleatoric, generator=torch.Generator().manual_seed(seed))[1]
    share, pixels = boundary_share(ale, y)
    return {
        "boundary_share": share,
        "boundary_pixels": pixels,
        "boundary_share_logit_var": boundary_share(logit_var, y)[0],
        "region_means": region_means(ale, y),
        "logit_sd_region_means": region_means(logit_var.sqrt(), y),
        "abs_mean_region_means": region_means(out.mean.abs(), y),
        "iou": iou(out.mean > 0, y > 0.5),
    }


def _prior_diagnosis(la, info, data, x, y, x_noise, box, seed, b) -> dict:
    """Validation NLL, IoU and noise Box Ratio under three choices of the prior precision."""
    out = {"grid": dict(info)}
    choices = {"validation NLL grid (used above)": info["prior_precision"]}
    try:
        for structure in ("scalar", "layerwise"):
            with warnings.catch_warnings():  # its link_approx note is for the grid search
                warnings.filterwarnings("ignore", "By default `link_approx`", UserWarning)
                la.optimize_prior_precision(
                    method="marglik", prior_structure=structure, n_steps=200, lr=0.1
                )
            choices[f"marglik, {structure}"] = la.prior_precision.detach().clone()
    finally:
        la.prior_precision = info["prior_precision"]
    for label, prior in choices.items():
        la.prior_precision = prior
        g = torch.Generator().manual_seed(seed)
        p_val = predict(la, data.val_x, b.n_diagnose_samples, generator=g)
        nll = F.binary_cross_entropy(p_val.mean.clamp(1e-7, 1 - 1e-7), data.val_y).item()
        p_id = predict(la, x, b.n_diagnose_samples, generator=torch.Generator().manual_seed(seed))
        p = predict(
            la, x_noise, b.n_diagnose_samples, generator=torch.Generator().manual_seed(seed)
        )
        prior_t = torch.as_tensor(prior, dtype=la.H.dtype)
        out[label] = {
            "prior_min": float(prior_t.min()),
            "prior_max": float(prior_t.max()),
            "val_nll": nll,
            "iou": iou(p_id.mean > 0.5, y > 0.5),
            "box_noise": box_ratio(p.variance, box).mean().item(),
            "pixel_noise": pixel_ratio(p_id.variance, p.variance).mean().item(),
            "curvature_above_prior": float((_per_param(la, prior_t) < la.H).double().mean()),
        }
    la.prior_precision = info["prior_precision"]
    return out


def _per_param(la: Laplace, prior: Tensor) -> Tensor:
    if prior.numel() in (1, la.n_params):
        return prior
    sizes = [p.numel() for p in la.model.parameters() if p.requires_grad]
    return torch.cat([v.expand(n) for v, n in zip(prior, sizes, strict=True)])


UNITS: dict[str, Callable[..., dict]] = {
    "table1": unit_table1,
    "eval": unit_eval,
    "fig7": unit_fig7,
    "diagnose": unit_diagnose,
}


def run_unit(args: tuple) -> tuple[tuple, float]:
    root, budget, threads, (unit, *key) = args
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    UNITS[unit](Cache(root, budget), *key)
    return (unit, *key), time.perf_counter() - t0


def plan(
    parts: Iterable[str],
    seeds: list[int],
    datasets: list[str],
    budget: Budget,
    seeds_of: dict[str, list[int]],
) -> list[tuple]:
    """The units behind the selected parts, training-heavy ones first."""
    parts = set(parts)
    units: list[tuple] = []
    if "table1" in parts:
        units += [("table1", "lesions", f, s) for f in budget.factors for s in seeds]
    if parts & {"table2", "fig4", "fig5"}:
        units += [("eval", d, s) for d in datasets for s in seeds_of[d]]
    if "fig7" in parts:
        units += [("fig7", "lesions", s) for s in seeds]
    if "diagnose" in parts:
        units += [("diagnose", "lesions", s) for s in seeds[: budget.diagnose_seeds]]
    return units
