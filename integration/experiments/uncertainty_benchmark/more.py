"""The rows beyond the diagonal: one unit per data set and seed, cached apart from
:mod:`.units` (same networks, same test sets, same measures).

- ``TTA (flips)``: the MAP U-Net averaged over the four flips of the image (identity,
  horizontal, vertical, both), the cheap baseline ValUES recommends;
- ``U-Net + LA (kron | last layer | low rank, ...)``: :func:`lsn_ext.Laplace` on the MAP U-Net
  with KFAC over all weights, the 1×1 head's full GGN, or a rank-``b.rank`` Lanczos GGN plus
  its diagonal; the prior by the validation NLL of the predictive used (or laplace-torch's
  marginal likelihood for ``kron, glm, marglik``);
- ``LSN (demo setting)``: what the demo recommends, the SSN trained with the per-pixel
  expected BCE, the diagonal LSN posterior with the marginal-likelihood prior, the ``nn``
  predictive with 20 logit samples per posterior sample;
- ``Mixture of LA (5)``: one diagonal Laplace per ensemble member (each as ``U-Net + LA
  (glm)``: Monte-Carlo GGN diagonal, ``glm`` predictive, its prior by validation NLL), the
  predictive the average of the five (Eschenhagen et al., 2021).

The cost of every method of the report (training, fit, prior choice and predicting the clean
test images) is measured here in CPU seconds of the unit's process (one torch thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from integration.experiments.kit import (
    CONVERGED_FACTORS,
    ConvergedBudget,
    ConvergedCache,
    Pred,
    entropy_binary,
    la_predict,
    laplace_posterior,
    load_converged,
    loader,
    marglik_prior,
)
from integration.experiments.uncertainty_benchmark.design import (
    ENSEMBLE,
    LSN_DEMO,
    MIXTURE,
    MORE_LAPLACE,
    MORE_METHODS,
    STRUCTURES,
    TTA,
    more_specs,
)
from integration.experiments.uncertainty_benchmark.units import TestSets, measure_method, run_unit
from lsn_ext import BCEWithLogits, Laplace, gridsearch_prior_precision
from lsn_ext.lsn import (
    ensemble_predict,
    fit_lsn,
    mc_dropout_predict,
    mixture_predict,
    predict_lsn,
)

LSN_DEMO_ALEATORIC = 20  # the demo's logit samples per posterior sample (M)
FLIPS = ((), (-1,), (-2,), (-2, -1))


class Clock:
    """CPU seconds (``time.process_time``) per method and part."""

    def __init__(self) -> None:
        self.cost: dict[str, dict[str, float]] = {}

    def run(self, method: str, part: str, fn: Callable[[], object]) -> object:
        t0 = time.process_time()
        out = fn()
        parts = self.cost.setdefault(method, {})
        parts[part] = parts.get(part, 0.0) + time.process_time() - t0
        return out


def from_seg(p: object) -> Pred:
    return Pred(p.mean, p.entropy, p.mutual_information, p.variance)


@torch.no_grad()
def tta_predict(net: nn.Module, x: Tensor) -> Pred:
    """The MAP network over the four flips: ``E p``, its entropy, the mutual information
    ``H[E p] − E H[p]`` and the variance of ``p`` over the flips."""
    p = torch.stack([torch.sigmoid(net(x.flip(d)).flip(d)) for d in FLIPS])
    mean = p.mean(0)
    entropy = entropy_binary(mean)
    expected = torch.stack([entropy_binary(q) for q in p]).mean(0)
    return Pred(mean, entropy, (entropy - expected).clamp_min(0), p.var(0, unbiased=False))


def grid_prior(la: object, data: object, b: ConvergedBudget, pred_type: str, seed: int) -> dict:
    """Validation-NLL grid search of ``pred_type``'s predictive; sets and returns the prior."""
    grid = [10.0**k for k in b.prior_exponents]
    search = gridsearch_prior_precision(
        la, loader(data.val_x, data.val_y), grid=grid, n_samples=b.n_val_samples,
        pred_type=pred_type, seed=seed,
    )  # fmt: skip
    best = grid.index(search.prior_precision)
    return {"prior_precision": search.prior_precision, "at_edge": best in (0, len(grid) - 1)}


def more_unit(cache: ConvergedCache, dataset: str, seed: int) -> dict:
    """Load the networks (training the demo setting's SSN if needed), fit the posteriors
    beyond the diagonal and the mixture's members, predict, measure and time every method."""

    def compute() -> dict:
        b = cache.budget
        data, n_id = load_converged(dataset, b)
        factor = CONVERGED_FACTORS[dataset]
        nets, records = {}, {}
        for k, spec in more_specs(b).items():
            nets[k], records[k] = cache.net_and_record(spec, data, factor, seed)
        members = [nets[f"unet{k}"] for k in range(b.ensemble)]
        unet = members[0]
        train = loader(data.train_x, data.train_y, 64)
        loss = BCEWithLogits(pos_weight=factor)
        clock = Clock()
        priors: dict[str, dict] = {}

        structured = {}
        for name, (subset, structure) in STRUCTURES.items():
            extra = {"rank": b.rank} if structure == "lowrank" else {}
            la = Laplace(
                unet, "classification", subset, structure,
                backend_kwargs={"loss": loss, "estimator": "mc", "seed": seed}, **extra,
            )  # fmt: skip
            clock.run(name, "fit", lambda la=la: la.fit(train))
            structured[name] = la
        for method, (name, pred_type, choice) in MORE_LAPLACE.items():
            la = structured[name]
            if choice == "grid":
                priors[method] = clock.run(
                    method, "prior", lambda la=la, pt=pred_type: grid_prior(la, data, b, pt, seed)
                )
            else:
                value = clock.run(method, "prior", lambda la=la: float(marglik_prior(la)))
                priors[method] = {"prior_precision": value, "at_edge": False}

        mixture = []
        for k, member in enumerate(members):
            la = laplace_posterior(member, factor, "mc", seed)
            clock.run(MIXTURE, "fit", lambda la=la: la.fit(train))
            info = clock.run(MIXTURE, "prior", lambda la=la: grid_prior(la, data, b, "glm", seed))
            if k == 0:  # the member-0 posterior is U-Net + LA (glm)'s construction
                clock.cost["U-Net + LA (glm)"] = dict(clock.cost[MIXTURE])
            priors[f"{MIXTURE} member {k}"] = info
            mixture.append(la)

        ssn = nets["ssn_expected"]
        lsn = clock.run(
            LSN_DEMO, "fit",
            lambda: fit_lsn(ssn, train, pos_weight=factor, estimator="mc", seed=seed),
        )  # fmt: skip
        value = clock.run(LSN_DEMO, "prior", lambda: float(marglik_prior(lsn)))
        priors[LSN_DEMO] = {"prior_precision": value, "at_edge": False}

        def laplace(method: str) -> Callable[[Tensor], Pred]:
            name, pred_type, _ = MORE_LAPLACE[method]

            def run(x: Tensor) -> Pred:
                la = structured[name]
                la.prior_precision = priors[method]["prior_precision"]
                return from_seg(la_predict(la, x, b.n_epistemic, pred_type, seed))

            return run

        def lsn_demo(x: Tensor) -> Pred:
            lsn.prior_precision = priors[LSN_DEMO]["prior_precision"]
            p = predict_lsn(lsn, ssn, x, b.n_epistemic, LSN_DEMO_ALEATORIC, seed=seed)
            return Pred(
                p.total_mean, p.entropy, p.epistemic.mutual_information, p.epistemic.variance
            )

        def lsn_variance(x: Tensor) -> Tensor:  # the mean network's epistemic, as units.py
            lsn.prior_precision = priors[LSN_DEMO]["prior_precision"]
            return la_predict(lsn, x, b.n_epistemic, "nn", seed).variance

        fns: dict[str, Callable[[Tensor], Pred]] = {
            TTA: lambda x: tta_predict(unet, x),
            **{m: laplace(m) for m in MORE_LAPLACE},
            LSN_DEMO: lsn_demo,
            MIXTURE: lambda x: from_seg(
                mixture_predict(mixture, x, b.n_epistemic, pred_type="glm", seed=seed)
            ),
        }
        sets = TestSets.of(data, n_id, b, seed)
        with torch.no_grad():
            p_map = torch.sigmoid(unet(sets.x_id))
        map_clean = Pred(p_map, entropy_binary(p_map), None, None)
        res, sums = {}, {}
        for method in MORE_METHODS:
            fn = fns[method]
            clock.run(method, "predict", lambda fn=fn: fn(sets.x_id))
            variance = lsn_variance if method == LSN_DEMO else (lambda x, fn=fn: fn(x).variance)
            res[method], sums[method], _ = measure_method(
                fn, sets, b, None if method == TTA else map_clean, variance
            )
        _time_base_predictions(clock, nets, mixture[0], priors, sets.x_id, b, seed)
        cache.save(sums, cache.path("unc-more-sums", dataset, f"s{seed}"))
        return {
            "methods": res,
            "nets": records,
            "priors": priors,
            "cost_cpu_s": clock.cost,
            "threads": torch.get_num_threads(),
        }

    return cache.result(f"unc-more-{dataset}-s{seed}", compute)


def _time_base_predictions(
    clock: Clock, nets: dict, la0: object, priors: dict, x: Tensor, b: ConvergedBudget, seed: int
) -> None:
    """CPU seconds of predicting the clean test images with the base rows' methods that the
    cost table lists (MAP, MC dropout, ensemble, U-Net + LA (glm))."""
    members = [nets[f"unet{k}"] for k in range(b.ensemble)]
    with torch.no_grad():
        clock.run("MAP entropy", "predict", lambda: torch.sigmoid(members[0](x)))
    torch.manual_seed(seed)
    clock.run("MC dropout", "predict", lambda: mc_dropout_predict(nets["unet_do"], x, b.n_dropout))
    clock.run(ENSEMBLE, "predict", lambda: ensemble_predict(members, x))
    la0.prior_precision = priors[f"{MIXTURE} member 0"]["prior_precision"]
    clock.run("U-Net + LA (glm)", "predict", lambda: la_predict(la0, x, b.n_epistemic, "glm", seed))


def run_more_unit(args: tuple) -> tuple[tuple, float]:
    root, budget, threads, (dataset, seed) = args
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    more_unit(ConvergedCache(root, budget), dataset, seed)
    return ("uncertainty-more", dataset, seed), time.perf_counter() - t0


UNIT_KINDS = {"base": run_unit, "more": run_more_unit}


def run_any(args: tuple) -> tuple[tuple, float]:
    """Run one unit of either kind, ``(kind, root, budget, threads, (dataset, seed))``; a
    module-level function, so that spawned workers can unpickle it."""
    return UNIT_KINDS[args[0]](args[1:])
