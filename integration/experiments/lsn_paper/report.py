"""The LSN paper's report: Table 1 and 2, Fig. 4, 5 and 7 and the diagnosis from the cached unit
results, the per-seed CSV of every table, and the cost of the units."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import torch

from integration.experiments.kit import QUICK, REGIONS, SHIFTS, Cache, load_data
from integration.experiments.lsn_paper.design import (
    DIAGNOSE_SPECS,
    EVAL_FACTORS,
    MODELS,
    SSN_MODELS,
)
from integration.experiments.tables import fmt, geo, mean, mean_ci, table
from integration.harness import machine

# The paper's Table 2 (ISIC), arXiv:2303.13123v1 (2023); its 2024 version has no Box Ratio.
# Order here: Pixel Ratio noise, black; Box Ratio noise, black (the paper's columns: black, noise).
PAPER_TABLE2 = {
    "Ensemble": (0.95, 1.00, 0.13, 0.14),
    "U-Net + Dropout": (1.80, 1.82, 0.14, 0.13),
    "SSN (diag) + Dropout": (1.20, 1.09, 0.17, 0.15),
    "SSN + Dropout": (1.60, 1.51, 0.20, 0.14),
    "U-Net + LA": (1.47, 1.14, 0.24, 0.17),
    "LSN (diag)": (1.23, 1.33, 0.24, 0.23),
    "LSN": (1.64, 1.29, 0.29, 0.26),
}


def report_table1(cache: Cache, seeds: list[int]) -> str:
    res = {
        (f, s): cache.stored(f"table1-lesions-f{f}-s{s}")
        for f in cache.budget.factors
        for s in seeds
    }
    if any(v is None for v in res.values()):
        return "Table 1: not run (select `--parts table1`)."
    rows = []
    for name in MODELS:
        rows.append(
            [name] + [fmt([res[f, s][name]["iou"] for s in seeds]) for f in cache.budget.factors]
        )
    collapsed = [
        f"{name} {sum(res[f, s][name]['iou'] < 0.05 for s in seeds)}/{len(seeds)} at factor {f}"
        for name in MODELS
        for f in cache.budget.factors
        if any(res[f, s][name]["iou"] < 0.05 for s in seeds)
    ]
    edge = sum(res[k][n]["at_edge"] for k in res for n in ("U-Net + LA", "LSN (diag)", "LSN"))
    f0, n = cache.budget.factors[0], len(seeds)
    count = {name: sum(res[f0, s][name]["iou"] < 0.05 for s in seeds) for name in MODELS}
    low = count["SSN + Dropout"] + count["LSN"]
    diag = count["SSN (diag) + Dropout"] + count["LSN (diag)"]
    return (
        "## Table 1: IoU against the BCE class-reweighting factor (lesions)\n\n"
        + table(["Model"] + [f"factor {f}" for f in cache.budget.factors], rows)
        + f"\n\nTest IoU of the predictive mean (threshold ½) on {cache.budget.n_iou} test images, "
        f"mean ± 95 % CI over {len(seeds)} seeds. The factor weights the foreground term of the "
        "BCE (U-Nets) or of the SSN likelihood (SSN-based models). Laplace models: prior "
        f"precision by validation NLL; the chosen value was at an end of the grid in {edge} of "
        f"{3 * len(res)} fits. Runs that stayed at background (IoU below 0.05): "
        + ("; ".join(collapsed) or "none")
        + f". Fisher's exact test (two-sided) on these counts at factor {f0}: LSN "
        f"{count['LSN']}/{n} against LSN (diag) {count['LSN (diag)']}/{n}, p = "
        f"{fisher_exact(count['LSN'], n, count['LSN (diag)'], n):.2g}; the rank-"
        f"{cache.budget.rank} SSN models (SSN + Dropout, LSN; separate networks) {low}/{2 * n} "
        f"against the rank-0 ones (SSN (diag) + Dropout, LSN (diag)) {diag}/{2 * n}, p = "
        f"{fisher_exact(low, 2 * n, diag, 2 * n):.2g}. With {n} seeds per model, only a large "
        "difference in the rate of collapse can reach p < 0.05; the paper's Table 1 (arXiv v1, "
        "values without intervals) has every model but SSN + Dropout and LSN at IoU < 10^-10 at "
        "factors 1 and 2.\n"
    )


def fisher_exact(a: int, n_a: int, b: int, n_b: int) -> float:
    """Two-sided p of Fisher's exact test: ``a`` of ``n_a`` against ``b`` of ``n_b`` events
    (the sum of the hypergeometric probabilities of the tables no more likely than this one)."""
    k, n = a + b, n_a + n_b

    def prob(x: int) -> float:
        return math.comb(n_a, x) * math.comb(n_b, k - x) / math.comb(n, k)

    p_obs = prob(a)
    xs = range(max(0, k - n_b), min(n_a, k) + 1)
    return min(1.0, sum(prob(x) for x in xs if prob(x) <= p_obs * (1 + 1e-7)))


def _eval_results(cache: Cache, datasets: list[str], seeds_of: dict[str, list[int]]) -> dict | None:
    res = {(d, s): cache.stored(f"eval-{d}-s{s}") for d in datasets for s in seeds_of[d]}
    return None if any(v is None for v in res.values()) else res


def report_table2(cache: Cache, datasets: list[str], seeds_of: dict[str, list[int]]) -> str:
    res = _eval_results(cache, datasets, seeds_of)
    if res is None:
        return "Table 2: not run (select `--parts table2`)."
    cols = ("pixel_noise", "pixel_black", "box_noise", "box_black")
    parts = [
        "## Table 2: Pixel Ratio and Box Ratio of the epistemic maps",
        "The paper's numbers are its Table 2 in the 2023 arXiv version (arXiv:2303.13123v1; ISIC, "
        "networks trained for 60 epochs); the 2024 version has no Box Ratio. A network that stayed "
        "at background (IoU near 0) still has a variance map and a Box Ratio, so a model's Box "
        "Ratio and its per-seed rank below count such networks too: read them with the IoU "
        "column (for the lesions, Table 1 at the same factor has the same networks).",
    ]
    for d in datasets:
        seeds = seeds_of[d]
        rows = []
        for name in MODELS:
            per = [[mean(res[d, s][name][c]) for s in seeds] for c in cols]
            paper = " / ".join(f"{v:.2f}" for v in PAPER_TABLE2[name])
            rows.append([name, fmt([res[d, s][name]["iou"] for s in seeds])])
            rows[-1] += [fmt(v) for v in per] + [paper]
        area = mean([mean(res[d, s]["LSN"]["box_area_noise"]) for s in seeds])
        parts.append(
            f"### {d}\n\n"
            + table(
                [
                    "Model",
                    "IoU",
                    "Pixel Ratio noise",
                    "Pixel Ratio black",
                    "Box Ratio noise",
                    "Box Ratio black",
                    "paper, arXiv v1 Table 2 (ISIC): PR n / PR b / BR n / BR b",
                ],
                rows,
            )
            + f"\n\nReweighting factor {EVAL_FACTORS[d][0]} for the U-Net-based and "
            f"{EVAL_FACTORS[d][1]} for the SSN-based models; "
            f"{len(_eval_ids(res, d, seeds))} test images, one noise and one black box each "
            "(side 10–20 px, LSN §4.4); mean ± "
            f"95 % CI over {len(seeds)} seeds (the boxes are redrawn per seed). A Box Ratio of "
            f"{area:.3f} is what a variance spread evenly over the image gives. Epistemic "
            f"variance from {cache.budget.n_epistemic} samples "
            f"(Ensemble: {cache.budget.ensemble} members)."
            + (
                " Black is the background of the fluorescence image, so the black box is not out "
                "of distribution here: the black-box columns do not test OOD detection."
                if d == "nuclei"
                else ""
            )
            + "\n"
        )
        parts.append(_ordering(res, d, seeds) + "\n" + _pixel_medians(res, d, seeds))
    return "\n\n".join(parts)


def _pixel_medians(res: dict, d: str, seeds: list[int]) -> str:
    """The Pixel Ratio's median over the images: the mean is led by images of near-0 variance."""
    cells = []
    for name in MODELS:
        med = {
            k: fmt([torch.tensor(res[d, s][name][f"pixel_{k}"]).median().item() for s in seeds])
            for k in ("noise", "black")
        }
        cells.append(f"{name} {med['noise']} / {med['black']}")
    return (
        "- Pixel Ratio as the median over the images (noise / black), which single images with "
        "a near-0 clean variance cannot lead: " + "; ".join(cells) + "."
    )


def _eval_ids(res: dict, d: str, seeds: list[int]) -> list[float]:
    return res[d, seeds[0]]["LSN"]["box_noise"]


def _ordering(res: dict, d: str, seeds: list[int]) -> str:
    """Which seeds keep the paper's ordering, and whether the spread is the seed or the boxes."""
    lines = []
    for k in ("noise", "black"):
        wins = [
            mean(res[d, s]["LSN"][f"box_{k}"]) > mean(res[d, s]["U-Net + Dropout"][f"box_{k}"])
            for s in seeds
        ]
        best = [max(MODELS, key=lambda n, s=s: mean(res[d, s][n][f"box_{k}"])) for s in seeds]
        per_seed = [mean(res[d, s]["LSN"][f"box_{k}"]) for s in seeds]
        within = [
            torch.tensor(res[d, s]["LSN"][f"box_{k}"]).std().item()
            / math.sqrt(len(res[d, s]["LSN"][f"box_{k}"]))
            for s in seeds
        ]
        between = torch.tensor(per_seed).std().item() if len(seeds) > 1 else 0.0
        lines.append(
            f"- {k} box: LSN above U-Net + Dropout on {sum(wins)} of {len(seeds)} seeds; the "
            f"highest Box Ratio per seed: {', '.join(best)}. LSN's Box Ratio varies by "
            f"{between:.3f} (sd) between seeds against a standard error of "
            f"{mean(within):.3f} from the images and boxes within a seed."
        )
    return "\n".join(lines)


def report_fig4(cache: Cache, datasets: list[str], seeds_of: dict[str, list[int]]) -> str:
    res = _eval_results(cache, datasets, seeds_of)
    if res is None:
        return "Fig. 4: not run (select `--parts fig4`)."
    rows = []
    for d in datasets:
        seeds = seeds_of[d]
        for name in SSN_MODELS:
            row = [f"{name} ({d})"]
            for k in ("noise", "black"):
                for comp in ("aleatoric", "epistemic"):
                    row.append(fmt([res[d, s][name][f"ap_{comp}_{k}"] for s in seeds]))
            row.append(fmt([mean(res[d, s][name]["box_area_noise"]) for s in seeds]))
            rows.append(row)
    return (
        "## Fig. 4 as numbers: finding the corrupted pixels, aleatoric against epistemic\n\n"
        + table(
            [
                "Model",
                "AP aleatoric (noise)",
                "AP epistemic (noise)",
                "AP aleatoric (black)",
                "AP epistemic (black)",
                "chance (box share)",
            ],
            rows,
        )
        + "\n\nAverage precision (area under the precision-recall curve) of each per-pixel map "
        "as a score for the box pixels, pooled over the test images of a seed; mean ± 95 % CI "
        "over seeds. This adapts the paper's Fig. 4, which (arXiv v1) compares the "
        "precision-recall of the segmentations from each component on clean images; the "
        "question here, whether the epistemic map finds the corrupted box and the aleatoric one "
        "does not, is that of the paper's §4.4 and Fig. 6.\n"
    )


def report_fig5(cache: Cache, datasets: list[str], seeds_of: dict[str, list[int]]) -> str:
    res = _eval_results(cache, datasets, seeds_of)
    if res is None:
        return "Fig. 5: not run (select `--parts fig5`)."
    rows = []
    for d in datasets:
        seeds = seeds_of[d]
        for name in SSN_MODELS:
            r = [res[d, s][name] for s in seeds]
            rows.append(
                [
                    f"{name} ({d})",
                    fmt([v["boundary_aleatoric"] for v in r]),
                    fmt([v["boundary_epistemic"] for v in r]),
                    fmt([v["boundary_pixels"] for v in r]),
                    _regions_cell([v["boundary_aleatoric_mean"] for v in r]),
                ]
            )
    return (
        "## Fig. 5 as a number: aleatoric variance at the boundary\n\n"
        + table(
            [
                "Model",
                "aleatoric share within 2 px of the boundary",
                "epistemic share there",
                "pixel share there",
                "mean aleatoric: band / inside / outside",
            ],
            rows,
        )
        + "\n\nShare of the summed variance map of the clean test images within 2 pixels "
        "(Chebyshev) of the mask boundary. A map that marks boundaries (the paper's Fig. 5, "
        "arXiv v1: the LSN's aleatoric variance high at the boundary of one image) has a share "
        "well above the pixel share and a band mean above the inside and outside means; a share "
        "above the pixel share with the highest mean inside marks the object, not its boundary.\n"
    )


def _regions_cell(means: list[dict[str, float]]) -> str:
    """``band / in / out`` means over seeds of :func:`region_means` results, for a table."""
    return " / ".join(f"{mean([m[k] for m in means]):.2g}" for k in REGIONS)


def report_fig7(cache: Cache, seeds: list[int], out: Path) -> str:
    res = {s: cache.stored(f"fig7-lesions-s{s}") for s in seeds}
    if any(v is None for v in res.values()):
        return "Fig. 7: not run (select `--parts fig7`)."
    parts = ["## Fig. 7: predictive entropy under distribution shift (lesions)"]
    for kind, (strengths, meaning) in SHIFTS.items():
        rows = []
        for name in MODELS:
            row = [name, f"{mean([res[s][name]['clean'] for s in seeds]):.3f}"]
            for st in strengths:
                h = [res[s][name][f"{kind}:{st}"]["entropy"] for s in seeds]
                a = [res[s][name][f"{kind}:{st}"]["auroc"] for s in seeds]
                row.append(f"{mean(h):.3f} ({fmt(a, 2)})")
            rows.append(row)
        parts.append(
            f"### {kind} ({meaning})\n\n"
            + table(["Model", "entropy, clean"] + [f"strength {s}" for s in strengths], rows)
        )
    parts.append(
        f"Mean per-image predictive entropy (nats per pixel) of the full predictive on "
        f"{cache.budget.n_shift} test images, and in brackets the AUROC of that entropy for "
        f"telling the shifted from the clean images (mean ± 95 % CI over {len(seeds)} seeds). "
        "Figure: `lsn_paper_fig7.png`."
    )
    _plot_fig7(res, seeds, out / "lsn_paper_fig7.png")
    return "\n\n".join(parts)


def _plot_fig7(res: dict, seeds: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHIFTS), figsize=(3.2 * len(SHIFTS), 3.0), sharey=True)
    for ax, (kind, (strengths, meaning)) in zip(axes, SHIFTS.items(), strict=True):
        for name in MODELS:
            cis = [
                mean_ci([res[s][name][f"{kind}:{st}"]["auroc"] for s in seeds]) for st in strengths
            ]
            xs = list(range(1, len(strengths) + 1))
            ax.errorbar(xs, [c.mean for c in cis], [c.half for c in cis], label=name, capsize=2)
        ax.set_xticks(list(range(1, len(strengths) + 1)), [str(s) for s in strengths])
        ax.set_title(f"{kind}", fontsize=9)
        ax.set_xlabel(meaning, fontsize=7)
        ax.axhline(0.5, color="grey", lw=0.5)
    axes[0].set_ylabel("AUROC, shifted vs clean")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_diagnose(cache: Cache, seeds: list[int]) -> str:
    seeds = seeds[: cache.budget.diagnose_seeds]
    res = {s: cache.stored(f"diagnose-lesions-s{s}") for s in seeds}
    if any(v is None for v in res.values()):
        return "Diagnosis: not run (select `--parts diagnose`)."
    rows = []
    for label in DIAGNOSE_SPECS:
        r = [res[s]["aleatoric"][label] for s in seeds]
        rows.append(
            [
                label,
                fmt([v["iou"] for v in r]),
                fmt([v["boundary_share"] for v in r]),
                fmt([v["boundary_share_logit_var"] for v in r]),
                f"{mean([v['boundary_pixels'] for v in r]):.3f}",
                _regions_cell([v["region_means"] for v in r]),
                _regions_cell([v["logit_sd_region_means"] for v in r]),
                _regions_cell([v["abs_mean_region_means"] for v in r]),
            ]
        )
    text = [
        f"## Diagnosis (lesions, {len(seeds)} seeds, the factors of Table 2)\n\n"
        "### Where the SSN puts its aleatoric variance\n\n"
        + table(
            [
                "SSN training",
                "IoU of σ(μ)",
                "boundary share of Var σ(η)",
                "boundary share of Var η",
                "pixel share",
                "Var σ(η): band / in / out",
                "sd η: band / in / out",
                "abs μ: band / in / out",
            ],
            rows,
        )
        + "\n\nVar σ(η) is the aleatoric map of Fig. 5. It marks boundaries only where its band "
        "mean is above its inside and outside means; a boundary share above the pixel share "
        "with the highest mean inside marks the object's interior."
    ]
    rows = []
    for name in ("LSN", "U-Net + LA"):
        labels = [k for k in res[seeds[0]]["prior"][name] if k != "grid"]
        for label in labels:
            r = [res[s]["prior"][name][label] for s in seeds]
            rows.append(
                [
                    f"{name}: {label}",
                    _prior_range(r),
                    fmt([v["curvature_above_prior"] for v in r], 2),
                    fmt([v["val_nll"] for v in r], 4),
                    fmt([v["iou"] for v in r]),
                    fmt([v["pixel_noise"] for v in r]),
                    fmt([v["box_noise"] for v in r]),
                ]
            )
    edges = {
        n: sum(res[s]["prior"][n]["grid"]["at_edge"] for s in seeds) for n in ("LSN", "U-Net + LA")
    }
    text.append(
        "### The prior precision\n\n"
        + table(
            [
                "Posterior: prior choice",
                "prior precision (geometric mean over seeds; min–max over layers)",
                "share of parameters with curvature above the prior",
                "validation NLL",
                "IoU",
                "Pixel Ratio noise",
                "Box Ratio noise",
            ],
            rows,
        )
        + f"\n\nGrid 10^{cache.budget.prior_exponents[0]}…10^{cache.budget.prior_exponents[-1]}: "
        f"optimum at an end of the grid for LSN in {edges['LSN']} and for U-Net + LA in "
        f"{edges['U-Net + LA']} of {len(seeds)} seeds."
    )
    rows = []
    for e in ("db", "mc"):
        r = [res[s]["estimator"][e] for s in seeds]
        rows.append(
            [
                e,
                f"{geo([v['prior_precision'] for v in r]):.3g}",
                fmt([v["iou"] for v in r]),
                fmt([v["box_noise"] for v in r]),
            ]
        )
    rel = fmt([res[s]["estimator"]["relative_difference"] for s in seeds], 2)
    ratio = fmt([res[s]["estimator"]["sum_ratio_db_over_mc"] for s in seeds], 2)
    above = [res[s]["prior"]["LSN"]["validation NLL grid (used above)"] for s in seeds]
    above = [v["curvature_above_prior"] for v in above]
    note = (
        f" Each row's prior is its own validation-NLL grid choice. For the `mc` posterior a share "
        f"of {fmt(above, 2)} of the parameters has a curvature above that prior (the prior "
        "table's first row)"
        + (
            ", so for the others the posterior precision H + prior is within a factor 2 of the "
            "prior: the posterior is essentially the prior, and this table says nothing about "
            "the estimators. They were not compared at the marglik prior."
            if mean(above) < 0.05
            else "."
        )
    )
    text.append(
        "### The curvature estimator (LSN)\n\n"
        + table(["GGN diagonal", "prior precision", "IoU", "Box Ratio noise"], rows)
        + f"\n\n‖H_db − H_mc‖ / ‖H_mc‖ = {rel}; Σ H_db / Σ H_mc = {ratio}."
        + note
    )
    return "\n\n".join(text)


def _prior_range(r: list[dict]) -> str:
    lo, hi = geo([v["prior_min"] for v in r]), geo([v["prior_max"] for v in r])
    return f"{lo:.3g}" if lo == hi else f"{lo:.3g}–{hi:.3g}"


def write_report(
    cache: Cache,
    parts: list[str],
    seeds: list[int],
    datasets: list[str],
    out: Path,
    cost: str,
    nuclei_seeds: list[int] | None = None,
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    b = cache.budget
    intro = [
        "# The LSN paper's experiments, measured",
        "Generated by `integration/experiments/lsn_paper/` "
        f"({'--quick' if b is QUICK else 'full run'}); {len(seeds)} seeds "
        f"({', '.join(map(str, seeds))}). " + machine(),
        "Budget: U-Net widths "
        f"{'-'.join(map(str, b.widths))} (tanh, nearest upsampling), SSN rank {b.rank}, "
        f"{b.steps} Adam steps of {b.batch_size} images per network (cosine decay from "
        f"{b.lr}), dropout {b.dropout}, {b.ensemble} ensemble members, "
        f"{b.n_epistemic} epistemic and {b.n_aleatoric} aleatoric samples; Laplace: diagonal "
        'GGN by unbiased Monte Carlo (`estimator="mc"`), prior precision by validation NLL '
        f"over 10^{b.prior_exponents[0]}…10^{b.prior_exponents[-1]}.",
        f"**Training length.** Every network here is trained for {b.steps} Adam steps (the "
        f"diagnosis' 4× variant: {4 * b.steps}), not to convergence (the paper, arXiv v1 A.1: 60 "
        "epochs), so each Laplace approximation is taken at weights that need not be a mode of "
        "the loss, which the approximation assumes. The intervals are over few seeds and "
        "unpaired: read a difference between two models as within the seed-to-seed noise unless "
        'a per-seed comparison (the "k of n seeds" lines, `lsn_paper_per_seed.csv`) says '
        "otherwise. Every predictive is the sampling (`nn`) one. The same questions with "
        "early-stopped networks and the linearised (`glm`) predictive, beside failure-detection "
        "baselines, are answered in `uncertainty.md` "
        "(`integration/experiments/uncertainty_benchmark/`): Table 2's noise Box Ratio and "
        "Fig. 7's shift AUROC at the middle strength.",
        "Per-seed values of every table: `lsn_paper_per_seed.csv` (data set, part, model, seed, "
        "metric, value).",
    ]
    seeds_of = {"lesions": seeds, "nuclei": seeds if nuclei_seeds is None else nuclei_seeds}
    for d in datasets:
        data = load_data(d, b)
        epochs = b.steps * b.batch_size / len(data.train_x)
        intro.append(
            f"- {d} ({SOURCES[d]}): {data.notes}; {b.steps} steps are {epochs:.1f} epochs; seeds "
            f"{', '.join(map(str, seeds_of[d]))}."
        )
    intro.append(cost)
    sections = ["\n\n".join(intro)]
    if "table1" in parts:
        sections.append(report_table1(cache, seeds))
    if "table2" in parts:
        sections.append(report_table2(cache, datasets, seeds_of))
    if "fig4" in parts:
        sections.append(report_fig4(cache, datasets, seeds_of))
    if "fig5" in parts:
        sections.append(report_fig5(cache, datasets, seeds_of))
    if "fig7" in parts:
        sections.append(report_fig7(cache, seeds, out))
    if "diagnose" in parts:
        sections.append(report_diagnose(cache, seeds))
    path = out / "lsn_paper.md"
    path.write_text("\n\n".join(sections) + "\n")
    _write_per_seed(out / "lsn_paper_per_seed.csv", per_seed_rows(cache, parts, seeds, seeds_of))
    return path


SOURCES = {
    "lesions": "synthetic, not ISIC: ISIC-like images generated by `lsn_ext.data.lesion_dataset`",
    "nuclei": "a fluorescence image; black is its background, so a black box is not OOD here",
}


def per_seed_rows(
    cache: Cache, parts: list[str], seeds: list[int], seeds_of: dict[str, list[int]]
) -> list[tuple[str, str, str, int, str, float]]:
    """Every table's per-seed values as ``(data set, part, model, seed, metric, value)`` rows
    (the report's cells are their means over seeds); parts not run are left out."""
    rows: list[tuple[str, str, str, int, str, float]] = []
    b = cache.budget
    if "table1" in parts:
        for f in b.factors:
            for s in seeds:
                r = cache.stored(f"table1-lesions-f{f}-s{s}")
                for name in MODELS if r is not None else ():
                    rows.append(("lesions", "table1", name, s, f"iou_factor_{f}", r[name]["iou"]))
    datasets = list(seeds_of)
    for d in datasets:
        for s in seeds_of[d]:
            r = cache.stored(f"eval-{d}-s{s}")
            if r is None:
                continue
            for name in MODELS if "table2" in parts else ():
                v = r[name]
                rows.append((d, "table2", name, s, "iou", v["iou"]))
                for k in ("pixel_noise", "pixel_black", "box_noise", "box_black"):
                    rows.append((d, "table2", name, s, k, mean(v[k])))
                for k in ("pixel_noise", "pixel_black"):
                    median = torch.tensor(v[k]).median().item()
                    rows.append((d, "table2", name, s, f"{k}_median", median))
            for name in SSN_MODELS if "fig4" in parts else ():
                v = r[name]
                for k in ("noise", "black"):
                    for comp in ("aleatoric", "epistemic"):
                        rows.append((d, "fig4", name, s, f"ap_{comp}_{k}", v[f"ap_{comp}_{k}"]))
                rows.append((d, "fig4", name, s, "box_share_noise", mean(v["box_area_noise"])))
            for name in SSN_MODELS if "fig5" in parts else ():
                v = r[name]
                for k in ("boundary_aleatoric", "boundary_epistemic", "boundary_pixels"):
                    rows.append((d, "fig5", name, s, k, v[k]))
                for k, label in zip(REGIONS, ("band", "inside", "outside"), strict=True):
                    value = v["boundary_aleatoric_mean"][k]
                    rows.append((d, "fig5", name, s, f"aleatoric_mean_{label}", value))
    if "fig7" in parts:
        for s in seeds:
            r = cache.stored(f"fig7-lesions-s{s}")
            for name in MODELS if r is not None else ():
                rows.append(("lesions", "fig7", name, s, "entropy_clean", r[name]["clean"]))
                for kind, (strengths, _) in SHIFTS.items():
                    for st in strengths:
                        for k in ("entropy", "auroc"):
                            value = r[name][f"{kind}:{st}"][k]
                            rows.append(("lesions", "fig7", name, s, f"{k}_{kind}_{st}", value))
    if "diagnose" in parts:
        for s in seeds[: b.diagnose_seeds]:
            r = cache.stored(f"diagnose-lesions-s{s}")
            if r is None:
                continue
            for label, v in r["aleatoric"].items():
                for k in ("iou", "boundary_share", "boundary_share_logit_var", "boundary_pixels"):
                    rows.append(("lesions", "diagnose", label, s, k, v[k]))
                for m in ("region_means", "logit_sd_region_means", "abs_mean_region_means"):
                    for k, where in zip(REGIONS, ("band", "inside", "outside"), strict=True):
                        rows.append(("lesions", "diagnose", label, s, f"{m}_{where}", v[m][k]))
            for name, choices in r["prior"].items():
                for label, v in choices.items():
                    if label == "grid":
                        continue
                    for k in (
                        "prior_min",
                        "prior_max",
                        "curvature_above_prior",
                        "val_nll",
                        "iou",
                        "pixel_noise",
                        "box_noise",
                    ):
                        rows.append(("lesions", "diagnose", f"{name}: {label}", s, k, v[k]))
            est = r["estimator"]
            for e in ("db", "mc"):
                for k in ("prior_precision", "iou", "box_noise"):
                    rows.append(("lesions", "diagnose", f"LSN, GGN diagonal {e}", s, k, est[e][k]))
            for k in ("relative_difference", "sum_ratio_db_over_mc"):
                rows.append(("lesions", "diagnose", "LSN, GGN diagonal db vs mc", s, k, est[k]))
    return rows


def _write_per_seed(path: Path, rows: list[tuple]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["dataset", "part", "model", "seed", "metric", "value"])
        for *key, value in rows:
            writer.writerow([*key, f"{float(value):.6g}"])


def cost_section(cache: Cache, units: list[tuple]) -> str:
    """What the units of this report cost when they were computed: the wall-clock time of each
    unit as run (:func:`record_time`), not CPU time."""
    path = cache.path("timings", suffix=".json")
    timings = json.loads(path.read_text()) if path.exists() else {}
    per: dict[str, list[float]] = {}
    for u in units:
        per.setdefault(u[0], []).append(timings.get("/".join(map(str, u)), float("nan")))
    rows = [
        [k, str(len(v)), f"{sum(v) / 60:.1f}", f"{max(v) / 60:.1f}", f"{sum(v) / 120:.1f}"]
        for k, v in per.items()
    ]
    return (
        "Cost of the units behind this report: the wall-clock time of each unit as it ran "
        "(`time.perf_counter` around the unit, recorded when it was computed; with `--workers 2` "
        "one torch thread per unit and two units side by side on the 2 cores), not CPU time. A "
        "unit trains or loads its networks and posteriors first, so the first unit to need a "
        "network pays for it. The last column is the summed time divided by 2, an estimate of "
        "the wall time with 2 workers, not a measurement:\n\n"
        + table(
            [
                "unit",
                "units",
                "summed unit wall time, min",
                "longest unit, min",
                "summed ÷ 2 workers, min",
            ],
            rows,
        )
    )
