"""One unit of the uncertainty benchmark: a data set and a seed. Train (or load) the eight
networks, fit the three posteriors and their priors, predict with every method and measure."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from integration.experiments.kit import (
    CONVERGED_FACTORS,
    SHIFTS,
    ConvergedBudget,
    ConvergedCache,
    Pred,
    boxed,
    entropy_binary,
    fit_posterior,
    image_statistics,
    la_predict,
    load_converged,
    measure_sets,
    shift,
    spread,
    tune_priors,
    volume_on_training_scale,
)
from integration.experiments.uncertainty_benchmark.design import (
    ENSEMBLE,
    IMAGE_STATS,
    IMAGE_STATS_RAW,
    LAPLACE,
    METHODS,
    POSTERIOR_NETS,
    specs,
)
from lsn_ext.lsn import ensemble_predict, mc_dropout_predict, predict_lsn
from lsn_ext.metrics import auroc, box_ratio
from lsn_ext.models import SSN


def _set_prior(posteriors: dict, method: str) -> tuple[object, str]:
    """Set the prior precision that ``method`` uses on its posterior; ``(la, pred_type)``."""
    name, pred_type, choice = LAPLACE[method]
    la, priors = posteriors[name]
    la.prior_precision = priors[f"{pred_type}-{choice}"]
    return la, pred_type


@dataclass
class TestSets:
    """The images every method is measured on: the clean test images, the shifted sets, and
    the noise-box images of the Box Ratio."""

    x_id: Tensor
    y_id: Tensor
    shifted: dict[str, tuple[Tensor, Tensor]]
    x_box: Tensor
    box: Tensor

    @classmethod
    def of(cls, data: object, n_id: int, b: ConvergedBudget, seed: int) -> TestSets:
        """Lesions: the four corruptions of ``kit.SHIFTS`` at their middle strength; nuclei:
        the 3-D volume's slices."""
        x_id, y_id = data.test_x[:n_id][: b.n_test], data.test_y[:n_id][: b.n_test]
        if data.name == "nuclei":
            shifted = {"volume": (data.test_x[n_id:], data.test_y[n_id:])}
        else:
            xs, ys = x_id[: b.n_shift], y_id[: b.n_shift]
            shifted = {k: (shift(xs, k, st[len(st) // 2]), ys) for k, (st, _) in SHIFTS.items()}
        _, _, x_box, box, _, _ = boxed(data, b, seed)
        return cls(x_id, y_id, shifted, x_box, box)


def measure_method(
    fn: Callable[[Tensor], Pred],
    sets: TestSets,
    b: ConvergedBudget,
    map_clean: Pred | None = None,
    variance: Callable[[Tensor], Tensor] | None = None,
) -> tuple[dict, dict, Pred]:
    """One method's measures on every set, its per-image sums and its clean predictive.

    ``map_clean``: the MAP's clean predictive, for the spread against it (posteriors only);
    ``variance``: the epistemic ``Var p`` on images, for the Box Ratio (None for the MAP).
    """
    shifted = sets.shifted
    r: dict = {}
    preds = {"clean": fn(sets.x_id)} | {k: fn(x) for k, (x, _) in shifted.items()}
    truth = {"clean": sets.y_id} | {k: y for k, (_, y) in shifted.items()}
    r["sets"], sums, pooled_r = measure_sets(preds, truth, list(shifted), b)
    r["shifted"] = {k: v for k, v in pooled_r.items() if not isinstance(v, list)}
    clean = torch.tensor(r["sets"]["clean"]["u_mean"])
    clean_fg = torch.tensor(r["sets"]["clean"]["u_fg"])
    r["shift_auroc"] = {k: auroc(clean, torch.tensor(r["sets"][k]["u_mean"])) for k in shifted}
    r["shift_auroc_fg"] = {k: auroc(clean_fg, torch.tensor(r["sets"][k]["u_fg"])) for k in shifted}
    if map_clean is not None:
        r["spread"] = spread(preds["clean"], map_clean)
    if variance is not None:
        r["box_ratio"] = box_ratio(variance(sets.x_box), sets.box).mean().item()
    return r, sums, preds["clean"]


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
        return Pred(p, entropy_binary(p), None, None)

    def dropout(x: Tensor) -> Pred:
        torch.manual_seed(seed)
        return from_seg(mc_dropout_predict(nets["unet_do"], x, b.n_dropout))

    def laplace(method: str):
        def run(x: Tensor) -> Pred:
            la, pt = _set_prior(posteriors, method)
            net = nets[POSTERIOR_NETS[LAPLACE[method][0]]]
            if not isinstance(net, SSN):
                return from_seg(la_predict(la, x, b.n_epistemic, pt, seed))
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
        return la_predict(la, x, b.n_epistemic, pt, seed).variance
    return fn(x).variance


def unit(cache: ConvergedCache, dataset: str, seed: int) -> dict:
    """Train (or load) the eight networks, fit the three posteriors, predict and measure."""

    def compute() -> dict:
        b = cache.budget
        data, n_id = load_converged(dataset, b)
        timing: dict[str, float] = {}
        t0 = time.perf_counter()
        factor = CONVERGED_FACTORS[dataset]
        nets, records = {}, {}
        for k, spec in specs(b).items():
            nets[k], records[k] = cache.net_and_record(spec, data, factor, seed)
        timing["train (this run)"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        posteriors, prior_info = {}, {}
        for name, key in POSTERIOR_NETS.items():
            la, info = fit_posterior(cache, name, nets[key], data, factor, seed)
            info = dict(info, **tune_priors(la, info, data, b, seed))
            posteriors[name], prior_info[name] = (la, info), info
        timing["posteriors"] = time.perf_counter() - t0

        sets = TestSets.of(data, n_id, b, seed)
        t0 = time.perf_counter()
        fns = predictors(nets, posteriors, b, seed)
        res: dict[str, dict] = {}
        sums: dict[str, dict] = {}
        map_clean = None
        for method, fn in fns.items():

            def variance(x: Tensor, method: str = method, fn: object = fn) -> Tensor:
                return _epistemic_variance(method, posteriors, fn, x, b, seed)

            res[method], sums[method], clean = measure_method(
                fn,
                sets,
                b,
                map_clean if method in LAPLACE else None,
                None if method == "MAP entropy" else variance,
            )
            if method == "MAP entropy":
                map_clean = clean
        timing["predict and measure"] = time.perf_counter() - t0
        x_id, shifted = sets.x_id, sets.shifted
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
            "box_area": sets.box.double().flatten(1).mean(1).mean().item(),
            "shift_kinds": list(shifted),
            "n_images": {"clean": len(x_id)} | {k: len(x) for k, (x, _) in shifted.items()},
        }

    return cache.result(f"unc-{dataset}-s{seed}", compute)


def run_unit(args: tuple) -> tuple[tuple, float]:
    root, budget, threads, (dataset, seed) = args
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    unit(ConvergedCache(root, budget), dataset, seed)
    return ("uncertainty", dataset, seed), time.perf_counter() - t0
