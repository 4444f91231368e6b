"""The uncertainty benchmark's report: cells with t-intervals and bootstrap intervals over test
images, paired differences, the sections, the risk-coverage figure and the per-seed CSV."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from integration.experiments.kit import (
    CONVERGED_FACTORS,
    SHIFTS,
    ConvergedBudget,
    ConvergedCache,
    boot_image_metric,
    boot_pixel_metric,
    load_converged,
    shift_boot,
)
from integration.experiments.tables import fmt, mean, percentile_bootstrap, table
from integration.experiments.tables import paired as stats_paired
from integration.experiments.uncertainty_benchmark import report_more
from integration.experiments.uncertainty_benchmark.design import (
    ALL_METHODS,
    ENSEMBLE,
    IMAGE_STATS,
    IMAGE_STATS_RAW,
    METHODS,
    POSTERIOR_NETS,
    specs,
)
from integration.harness import machine
from lsn_ext.metrics import risk_coverage

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


def bootstrap(per_seed: list[tuple[int, object]], b: ConvergedBudget, seed: int = 0):
    """Percentile 95 % interval of a metric's mean over seeds under resampled test images
    (:func:`stats.percentile_bootstrap` with ``b.n_bootstrap`` resamples)."""
    return percentile_bootstrap(per_seed, b.n_bootstrap, seed)


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
        more = {(d, s): cache.stored(f"unc-more-{d}-s{s}") for d in datasets for s in seeds}
        self.more = all(v is not None for v in more.values())
        self.methods = ALL_METHODS if self.more else METHODS
        if self.more:  # the rows beyond the diagonal, merged into the same tables
            for key, r in more.items():
                self.res[key]["methods"] |= r["methods"]
                self.res[key]["more"] = r
                d, s = key
                path = cache.path("unc-more-sums", d, f"s{s}")
                self.sums[key] |= torch.load(path, weights_only=False)

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
                per_seed.append(shift_boot(clean, shifted))
            elif metric in ("auroc", "auprc", "ece", "nll", "brier"):
                sm = self.sums[d, s][method]["clean"]
                fn = lambda idx, sm=sm: boot_pixel_metric(metric, sm, idx)  # noqa: E731
                per_seed.append((len(sm["pixels"]), fn))
            elif metric in ("aurc", "e_aurc", "aurc_fg", "e_aurc_fg", "spearman", "spearman_fg"):
                per = r["sets"]["clean"]
                fn = lambda idx, per=per: boot_image_metric(metric, per, idx)  # noqa: E731
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
                fn = lambda idx, sm=sm: boot_pixel_metric("auroc", sm, idx)  # noqa: E731
                per_seed.append((len(sm["pixels"]), fn))
            elif metric == "shifted_aurc":
                kinds = self.res[d, s]["shift_kinds"]
                per = {
                    k: [v for c in kinds for v in r["sets"][c][k]]
                    for k in ("u_mean", "dice_per_image")
                }
                fn = lambda idx, per=per: boot_image_metric("aurc", per, idx)  # noqa: E731
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
    rows = [[m] + [rep.cell(d, m, k) for k, _ in CLEAN_PIXEL] for m in rep.methods]
    return f"### {d}\n\n" + table(["Method"] + [h for _, h in CLEAN_PIXEL], rows)


def _section_images(rep: Report, d: str) -> str:
    rows = [[m] + [rep.cell(d, m, k) for k, _ in CLEAN_IMAGE] for m in rep.methods]
    oracle = [
        rep.res[d, s]["methods"]["MAP entropy"]["sets"]["clean"]["oracle_aurc"] for s in rep.seeds
    ]
    return (
        f"### {d}\n\n"
        + table(["Method"] + [h for _, h in CLEAN_IMAGE], rows)
        + f"\n\nOracle AURC of the MAP U-Net's segmentations: {fmt(oracle)} (each method "
        "has its own, from its own Dice; E-AURC subtracts it).\n"
    )


def _section_shift(rep: Report, d: str) -> str:
    kinds = rep.res[d, rep.seeds[0]]["shift_kinds"]
    rows = []
    present = rep.res[d, rep.seeds[0]]["methods"]
    stats_rows = [m for m in (IMAGE_STATS, IMAGE_STATS_RAW) if m in present]
    for m in (*rep.methods, *stats_rows):
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
        + "; ".join(f"{k} {st[len(st) // 2]}: {mean}" for k, (st, mean) in SHIFTS.items())
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
        + table(
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
        rows = [[m] + [rep.paired(d, m, ref, k) for k, _ in PAIRED] for m in rep.methods]
        parts.append(
            f"### {d}: against {ref}\n\n" + table(["Method"] + [h for _, h in PAIRED], rows)
        )
    return "\n\n".join(parts)


def _section_box(rep: Report) -> str:
    rows = []
    for m in rep.methods[1:]:
        rows.append([m] + [rep.cell(d, m, "box_ratio") for d in rep.datasets])
    area = [mean([rep.res[d, s]["box_area"] for s in rep.seeds]) for d in rep.datasets]
    return (
        table(["Method"] + [f"Box Ratio noise ({d})" for d in rep.datasets], rows)
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
        for m in rep.methods:
            sp = [rep.res[d, s]["methods"][m].get("spread") for s in rep.seeds]
            if any(v is None for v in sp):  # a result from before the diagnostic existed
                continue
            cells = [fmt([v[k] for v in sp], 4) for k in ("entropy_ratio", "mean_abs_dp")]
            sd = [v["mean_sd_p"] for v in sp if "mean_sd_p" in v]
            rows.append([f"{d}: {m}", *cells, fmt(sd, 4) if sd else "—"])
    header = ["method", "mean entropy ÷ MAP's", "mean abs(E p − p_MAP)", "mean posterior sd of p"]
    return table(header, rows)


def _section_training(rep: Report) -> str:
    rows = []
    n_stopped = n_all = 0
    nets = specs(rep.b)  # the seed's networks: the ensemble's U-Nets, the dropout U-Net, SSNs
    groups = {
        kind: tuple(k for k, spec in nets.items() if spec.kind == kind) for kind in ("unet", "ssn")
    }
    for d in rep.datasets:
        for group, keys in (
            (f"U-Nets ({len(groups['unet'])})", groups["unet"]),
            (f"SSNs ({len(groups['ssn'])})", groups["ssn"]),
        ):
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
                    f"{mean(dice):.3f}",
                    f"{mean(secs):.0f}",
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
        table(
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
        + table(
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
        + table(["part", "summed wall min, all units", "longest unit, min"], timing_rows)
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
        for m in rep.methods:
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
            for m in (*rep.methods, IMAGE_STATS, IMAGE_STATS_RAW):
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
        "Generated by `python -m integration.experiments.uncertainty_benchmark` "
        f"({'--quick' if quick else 'full run'}); {len(seeds)} seeds "
        f"({', '.join(map(str, seeds))}) per data set. " + machine(),
        "Budget: U-Net widths "
        f"{'-'.join(map(str, b.widths))} (tanh), SSN rank {b.rank} and 0; every network trained "
        f"with Adam ({b.batch_size} images per step, lr {b.lr} with cosine decay over the "
        f"cap of {b.steps} steps, random flips as `lsn_paper.train`) and early stopping: "
        f"validation Dice (pooled over the validation images, threshold ½ on the (mean) logit) "
        f"every {b.eval_every} steps, stop after {b.patience} evaluations without improvement "
        f"(not before step {b.min_steps}, nor while the best Dice is still {b.stop_floor:g}), "
        "best checkpoint kept. Foreground weight of every network's likelihood (U-Nets: "
        "BCE `pos_weight`; SSNs: `lsn_paper`'s `ssn_loss` objective, 20 antithetic logit "
        f"samples): {', '.join(f'{d} {CONVERGED_FACTORS[d]}' for d in datasets)} "
        "(unweighted lesion U-Nets and rank-0 SSNs stay at background, `lsn_paper` Table 1; "
        "one weight for all keeps the "
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
    if rep.more:
        intro.append(report_more.description(rep))
    for d in datasets:
        data, n_id = load_converged(d, b)
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
    if rep.more:
        sections.append(
            "## Beyond the diagonal: against the MAP's entropy and the ensemble\n\n"
            "Paired per-seed differences (as above) on the measures of issue 39's goal: the pixel "
            "AUROC on the shifted images and the image AURC (fg score) on the clean ones, and the "
            "AURC on the shifted images.\n\n"
            + "\n\n".join(report_more.section_question(rep, d) for d in datasets)
        )
    sections.append("## Training and cost\n\n" + _section_training(rep))
    if rep.more:
        sections.append(
            "## Cost per method\n\n"
            + report_more.section_cost(rep)
            + "\n"
            + report_more.section_priors(rep)
            + "\n\nPriors of the rows beyond the diagonal: validation-NLL grid "
            f"10^{b.prior_exponents[0]}…10^{b.prior_exponents[-1]} of the predictive used "
            "(marglik rows: laplace-torch's scalar marginal likelihood, no grid).\n"
        )
    risk_coverage_figure(rep, out / "uncertainty_risk_coverage.png")
    write_csv(rep, out / "uncertainty_per_seed.csv")
    path = out / "uncertainty.md"
    path.write_text("\n\n".join(sections) + "\n")
    return path
