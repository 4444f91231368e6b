"""The LSN's questions at three training budgets, with each of its three curvatures (issue 26,
items 3 and 5).

``lsn_paper`` trains every network for 128 Adam steps (about 1.4 epochs), so its Laplace
approximations sit at weights that need not be a mode. Here the networks behind Table 2, Fig. 5
and the shift test are trained with caps of 128 (1×), 512 (4×) and 2,048 (16×) steps, each with
early stopping on validation Dice (every 50 steps, patience 4, not before step 300; the best
evaluation's weights), on the synthetic ISIC-like lesions (``lsn_ext.data.lesion_dataset``):

- U-Net + Dropout and U-Net + LA (BCE reweighted by 4, as in ``lsn_paper``), and
- the LSN on an SSN (rank 10, no reweighting; trained with Eq. 11 with M = 20, or with
  ``--ssn-loss expected`` the per-pixel expected BCE under its logit distribution, the demo's
  default) with each curvature of
  :func:`lsn_ext.lsn.fit_lsn`: ``"ce"`` (the BCE at the mean logits), ``"expected"`` (the
  per-pixel expected BCE under the SSN's logit distribution) and ``"logsumexp"`` (the PSD part
  of Eq. 11's Hessian);

every Laplace posterior with the Monte-Carlo GGN diagonal and its prior precision by
laplace-torch's scalar marginal likelihood (the demo's default). Measured per budget and seed:
IoU; the noise Box Ratio of the epistemic map (LSN Eq. 17, Table 2); the LSN's aleatoric
boundary ratio (Fig. 5: share of ``Var σ(η)`` within 2 px of the boundary ÷ the band's pixel
share); and shift detection: AUROC of the per-image entropy of each model's total predictive
(clean against shifted test images, the four ``kit.SHIFTS`` at their middle strength,
averaged), beside the MAP U-Net's entropy and a model-free image-statistics score.

Run: ``./dev bench lsn_budget [--caps 128,512,2048] [--seeds 0-4] [--ssn-loss expected]
[--workers 2] [--quick] [--report-only]``; writes
``integration/results/lsn_budget.md`` and ``lsn_budget_per_seed.csv``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from integration.experiments.kit import (
    CONVERGED_QUICK,
    SHIFTS,
    ConvergedBudget,
    ConvergedCache,
    NetSpec,
    boxed,
    entropy_binary,
    image_statistics,
    laplace_posterior,
    load_converged,
    loader,
    marglik_prior,
    parse_seeds,
    shift,
)
from integration.experiments.tables import fmt, geo, mean, table
from integration.harness import RESULTS, machine, run_units
from lsn_ext import predict
from lsn_ext.lsn import aleatoric_maps, fit_lsn, mc_dropout_predict, predict_lsn
from lsn_ext.metrics import auroc, boundary_share, box_ratio, iou, per_image_entropy

DATASET = "lesions"
CAPS = (128, 512, 2048)
CURVATURES = ("ce", "expected", "logsumexp")
SSN_LOSSES = {"logsumexp": "Eq. 11 with M = 20", "expected": "the expected BCE (M = 20)"}
MODELS = ("U-Net + Dropout", "U-Net + LA", *(f"LSN ({c})" for c in CURVATURES))
N_SAMPLES = 64
N_ALEATORIC = 16
UNET_FACTOR = 4


def budget(cap: int, quick: bool) -> ConvergedBudget:
    """The converged budget with ``cap`` steps (quick: the tiny one, cap scaled down to two
    steps per doubling over 64, at least 2: 2, 6 and 10 steps, each budget its own cache)."""
    if quick:
        return dataclasses.replace(CONVERGED_QUICK, steps=max(2, round(2 * math.log2(cap / 64))))
    return dataclasses.replace(ConvergedBudget(), steps=cap)


def _key(cap: int, seed: int, ssn_loss: str) -> str:
    key = f"budget-{DATASET}-c{cap}-s{seed}"
    return key if ssn_loss == "logsumexp" else f"{key}-{ssn_loss}"


def unit(
    cache: ConvergedCache, cap: int, seed: int, quick: bool, ssn_loss: str = "logsumexp"
) -> dict:
    """Train (or load) the three networks at one budget and seed, fit the posteriors, measure."""

    def compute() -> dict:
        b = cache.budget
        n = min(N_SAMPLES, 2) if quick else N_SAMPLES
        n_alea = min(N_ALEATORIC, 2) if quick else N_ALEATORIC
        data, n_id = load_converged(DATASET, b)
        unet, rec_unet = cache.net_and_record(NetSpec("unet"), data, UNET_FACTOR, seed)
        unet_do, rec_do = cache.net_and_record(
            NetSpec("unet", dropout=b.dropout), data, UNET_FACTOR, seed
        )
        ssn_spec = NetSpec("ssn", rank=b.rank, objective=ssn_loss)
        ssn, rec_ssn = cache.net_and_record(ssn_spec, data, 1, seed)
        train = loader(data.train_x, data.train_y, 64)
        t0 = time.perf_counter()
        la_unet = laplace_posterior(unet, UNET_FACTOR, "mc", seed)
        la_unet.fit(train)
        posteriors = {"U-Net + LA": (la_unet, float(marglik_prior(la_unet)))}
        for c in CURVATURES:
            la = fit_lsn(ssn, train, estimator="mc", seed=seed, curvature=c)
            posteriors[f"LSN ({c})"] = (la, float(marglik_prior(la)))
        fit_seconds = time.perf_counter() - t0

        x, y = data.test_x[:n_id][: b.n_test], data.test_y[:n_id][: b.n_test]
        xs = x[: b.n_shift]
        sets = {"clean": xs} | {k: shift(xs, k, st[len(st) // 2]) for k, (st, _) in SHIFTS.items()}
        _, _, x_box, box, _, _ = boxed(data, b, seed)

        def total(model: str, images: Tensor) -> tuple[Tensor, Tensor]:
            """(E p, per-image entropy) of the model's total predictive."""
            torch.manual_seed(seed)
            if model == "U-Net + Dropout":
                p = mc_dropout_predict(unet_do, images, n)
                return p.mean, per_image_entropy(p.entropy)
            la, prior = posteriors[model]
            la.prior_precision = prior
            if model == "U-Net + LA":
                p = predict(la, images, n, generator=torch.Generator().manual_seed(seed))
                return p.mean, per_image_entropy(p.entropy)
            p = predict_lsn(la, ssn, images, n, n_alea, seed=seed)
            return p.total_mean, per_image_entropy(p.entropy)

        def epistemic(model: str, images: Tensor) -> Tensor:
            torch.manual_seed(seed)
            if model == "U-Net + Dropout":
                return mc_dropout_predict(unet_do, images, n).variance
            la, prior = posteriors[model]
            la.prior_precision = prior
            return predict(la, images, n, generator=torch.Generator().manual_seed(seed)).variance

        out: dict = {"models": {}}
        for model in MODELS:
            mean, _ = total(model, x)
            ent = {k: total(model, v)[1].tolist() for k, v in sets.items()}
            out["models"][model] = {
                "iou": iou(mean > 0.5, y > 0.5),
                "box_ratio": box_ratio(epistemic(model, x_box), box).mean().item(),
                "shift": {
                    k: auroc(torch.tensor(ent["clean"]), torch.tensor(v))
                    for k, v in ent.items()
                    if k != "clean"
                },
                "prior": posteriors[model][1] if model in posteriors else None,
            }
        with torch.no_grad():
            map_ent = {
                k: per_image_entropy(entropy_binary(torch.sigmoid(unet(v))))
                for k, v in sets.items()
            }
        out["MAP entropy"] = {
            k: auroc(map_ent["clean"], v) for k, v in map_ent.items() if k != "clean"
        }
        stats = image_statistics(data.train_x, sets)
        out["image statistics"] = {
            k: auroc(torch.tensor(stats["clean"]), torch.tensor(v))
            for k, v in stats.items()
            if k != "clean"
        }
        _, var = aleatoric_maps(ssn, x, 32, generator=torch.Generator().manual_seed(seed))
        share, pixel_share = boundary_share(var.double(), (y > 0.5).double(), 2)
        out["aleatoric boundary ratio"] = share / pixel_share
        out["train"] = {"U-Net": rec_unet, "U-Net + Dropout": rec_do, "SSN": rec_ssn}
        out["fit seconds"] = fit_seconds
        return out

    return cache.result(_key(cap, seed, ssn_loss), compute)


def _run_unit(args: tuple) -> tuple[tuple, float]:
    root, cap, seed, quick, ssn_loss = args
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    unit(ConvergedCache(root, budget(cap, quick)), cap, seed, quick, ssn_loss)
    return ("budget", cap, seed), time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# Report


def _shift_mean(d: dict) -> float:
    return sum(d.values()) / len(d)


def write_report(
    root: Path,
    caps: list[int],
    seeds: list[int],
    out: Path,
    quick: bool,
    ssn_loss: str = "logsumexp",
) -> Path:
    res: dict[int, list[tuple[int, dict]]] = {}
    for cap in caps:
        cache = ConvergedCache(root, budget(cap, quick))
        res[cap] = [
            (s, r) for s in seeds if (r := cache.stored(_key(cap, s, ssn_loss))) is not None
        ]
    rows, csv_rows, paired = [], [], []
    for cap in caps:
        per = res[cap]
        if not per:
            continue
        rs = [r for _, r in per]
        for model in MODELS:
            iou_v = [r["models"][model]["iou"] for r in rs]
            box_v = [r["models"][model]["box_ratio"] for r in rs]
            sh_v = [_shift_mean(r["models"][model]["shift"]) for r in rs]
            priors = [r["models"][model]["prior"] for r in rs if r["models"][model]["prior"]]
            prior = f"{geo(priors):.3g}" if priors else "–"
            rows.append(
                [
                    f"{cap}",
                    model,
                    f"{len(rs)}",
                    fmt(iou_v),
                    f"{sum(v < 0.05 for v in iou_v)}",
                    fmt(box_v),
                    fmt(sh_v),
                    prior,
                ]
            )
            for s, r in per:
                m = r["models"][model]
                for k, v in (
                    ("IoU", m["iou"]),
                    ("Box Ratio (noise)", m["box_ratio"]),
                    ("shift AUROC", _shift_mean(m["shift"])),
                ):
                    csv_rows.append([cap, model, s, k, v])
        for name in ("MAP entropy", "image statistics"):
            rows.append(
                [
                    f"{cap}",
                    f"{name} (baseline)",
                    f"{len(rs)}",
                    "–",
                    "–",
                    "–",
                    fmt([_shift_mean(r[name]) for r in rs]),
                    "–",
                ]
            )
        ratio = [r["aleatoric boundary ratio"] for r in rs]
        rows.append(
            [
                f"{cap}",
                "SSN aleatoric boundary ratio",
                f"{len(rs)}",
                "–",
                "–",
                "–",
                "–",
                fmt(ratio, 2),
            ]
        )
        for s, r in per:
            csv_rows.append(
                [cap, "SSN", s, "aleatoric boundary ratio", r["aleatoric boundary ratio"]]
            )
            for name in ("MAP entropy", "image statistics"):
                csv_rows.append([cap, name, s, "shift AUROC", _shift_mean(r[name])])
        for c in CURVATURES[1:]:
            cells = [f"{cap}", f"LSN ({c}) − LSN (ce)"]
            for key in ("box_ratio", "shift", "iou"):
                d = []
                for r in rs:
                    a, b_ = r["models"][f"LSN ({c})"][key], r["models"]["LSN (ce)"][key]
                    d.append(_shift_mean(a) - _shift_mean(b_) if key == "shift" else a - b_)
                cells.append(f"{fmt(d)} ({sum(x > 0 for x in d)}/{len(d)} above)")
            paired.append(cells)
        cells = [f"{cap}", "LSN (ce) − U-Net + Dropout"]
        for key in ("box_ratio", "shift", "iou"):
            d = []
            for r in rs:
                a, b_ = r["models"]["LSN (ce)"][key], r["models"]["U-Net + Dropout"][key]
                d.append(_shift_mean(a) - _shift_mean(b_) if key == "shift" else a - b_)
            cells.append(f"{fmt(d)} ({sum(x > 0 for x in d)}/{len(d)} above)")
        paired.append(cells)
    steps = []
    for cap in caps:
        for net in ("U-Net", "U-Net + Dropout", "SSN"):
            recs = [r["train"][net] for _, r in res[cap]]
            if recs:
                best = mean([t["best_step"] for t in recs])
                capped = sum(not t["stopped_early"] for t in recs)
                secs = mean([t["seconds"] for t in recs])
                steps.append([f"{cap}", net, f"{best:.0f}", f"{capped}/{len(recs)}", f"{secs:.0f}"])
    quick_note = " (quick run: tiny sizes, numbers meaningless)" if quick else ""
    b = budget(caps[0], quick)
    text = "\n".join(
        [
            "# The LSN's questions at three training budgets and three curvatures (issue 26)",
            "",
            f"Generated by `integration/experiments/lsn_budget.py`{quick_note}; data set: "
            f"{DATASET} (synthetic, ISIC-like, `lsn_ext.data.lesion_dataset`); seeds "
            f"{', '.join(map(str, seeds))}. {machine()}",
            "",
            f"{b.n_train} training, {b.n_val} validation, {b.n_test} test images; U-Net widths "
            f"{'-'.join(map(str, b.widths))}; step caps {', '.join(map(str, caps))} with early "
            f"stopping on validation Dice (every {b.eval_every} steps, patience {b.patience}, not "
            f"before step {b.min_steps}); SSN rank {b.rank}, trained with "
            f"{SSN_LOSSES[ssn_loss]}; Laplace: "
            "Monte-Carlo GGN diagonal, prior by scalar marginal likelihood; "
            f"{N_SAMPLES} posterior / dropout samples ({N_ALEATORIC} logit samples each for "
            f"the LSN's total predictive); {b.n_shift} images per shift set; {b.n_eval} "
            "noise-box images.",
            "",
            "## Results per budget",
            "",
            table(
                [
                    "step cap",
                    "model",
                    "seeds",
                    "IoU",
                    "collapsed",
                    "Box Ratio (noise)",
                    "shift AUROC (entropy)",
                    "prior (geo. mean)",
                ],
                rows,
            ),
            "",
            "Mean ± 95 % t-interval over seeds. Shift AUROC: clean against shifted images by "
            "the per-image mean entropy of the model's predictive, averaged over the four "
            "shifts. Per-seed values: `lsn_budget_per_seed.csv`.",
            "",
            "## Paired per seed",
            "",
            table(
                ["step cap", "difference", "Δ Box Ratio (noise)", "Δ shift AUROC", "Δ IoU"], paired
            ),
            "",
            "## Training",
            "",
            table(
                ["step cap", "network", "best step (mean)", "ran to the cap", "seconds (mean)"],
                steps,
            ),
            "",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "lsn_budget.md"
    path.write_text(text)
    with open(out / "lsn_budget_per_seed.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step_cap", "model", "seed", "metric", "value"])
        w.writerows(csv_rows)
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", default=",".join(map(str, CAPS)), help="step caps")
    parser.add_argument("--seeds", default=None, help="e.g. 0-4 (default 0-4; quick 0,1)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--cache", type=Path, default=None, help="default results/.cache/...")
    parser.add_argument("--out", type=Path, default=None, help="default integration/results")
    parser.add_argument("--quick", action="store_true", help="tiny sizes into a temporary dir")
    parser.add_argument("--report-only", action="store_true", help="only write the report")
    parser.add_argument(
        "--ssn-loss",
        choices=sorted(SSN_LOSSES),
        default="logsumexp",
        help="the SSN's training loss",
    )
    args = parser.parse_args(argv)
    seeds = parse_seeds(args.seeds or ("0,1" if args.quick else "0-4"))
    caps = [int(c) for c in args.caps.split(",") if c]
    tmp = Path(tempfile.mkdtemp(prefix="lsn-budget-")) if args.quick else None
    out = args.out or (tmp if tmp else RESULTS)
    root = args.cache or ((tmp / "cache") if tmp else RESULTS / ".cache" / "uncertainty")
    # Seed by seed, the largest budget first within a seed.
    work = (
        []
        if args.report_only
        else [(root, c, s, args.quick, args.ssn_loss) for s in seeds for c in caps[::-1]]
    )
    run_units("lsn_budget", _run_unit, work, args.workers)
    path = write_report(root, caps, seeds, out, args.quick, args.ssn_loss)
    print(path.read_text())
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
