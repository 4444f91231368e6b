"""U-Net + LA prior selection, measured against the MAP's own entropy in one run (issue 42).

A focused study beside ``integration/experiments/uncertainty_benchmark/`` (a separate run with
its own report, not a part of ``uncertainty.md``): per data set (lesions, nuclei) and seed, the
MAP U-Net is trained with the benchmark's own code and budget (``kit.ConvergedCache``:
widths 8-16-32-64, early stopping on validation Dice, cap 800 steps), its diagonal Laplace
posterior fitted (Monte-Carlo GGN), and the prior precision chosen four ways:

- ``nn + grid``: validation NLL of the sampling (``nn``) predictive on ``10^-4 … 10^8``;
- ``nn + marglik``: laplace-torch's scalar marginal likelihood, predicted with ``nn`` (what the
  README recommends and the benchmark never ran);
- ``glm + grid``, ``glm + marglik``: the same with the linearised predictive.

Each is measured with the MAP's sigmoid entropy on the same networks and test images: pixel
failure AUROC, ECE, NLL, image-level AURC of the foreground score (mean entropy within the
dilated predicted foreground; the whole-image mean is reported too, as the score not to use),
shift AUROC (foreground and whole-image score) and pixel AUROC under shift, with paired per-seed
differences against the MAP (t-interval and k/n) and a paired bootstrap over test images. Prior
diagnostics: the chosen prior, how often a grid picks an end of its range, and the posterior
predictive's spread relative to the MAP's (the ratio of mean entropies, the mean |E p − p_MAP|,
the mean posterior sd of p). Image statistics (the benchmark's Mahalanobis score, larger means
shifted, fixed before any test label is seen) on the data as the model sees it and, for the
nuclei volume, on the training image's intensity scale.

Run: ``./dev bench prior_selection [--seeds 0-4] [--datasets lesions,nuclei] [--quick]
[--report-only]``; writes ``integration/results/prior_selection.md`` and
``prior_selection_per_seed.csv``.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from integration.experiments.kit import (
    CONVERGED_FACTORS,
    CONVERGED_QUICK,
    SHIFTS,
    ConvergedBudget,
    ConvergedCache,
    Data,
    NetSpec,
    Pred,
    boot_image_metric,
    boot_pixel_metric,
    entropy_binary,
    fit_posterior,
    image_statistics,
    la_predict,
    load_converged,
    measure_sets,
    parse_seeds,
    shift,
    shift_boot,
    spread,
    tune_priors,
    volume_on_training_scale,
)
from integration.experiments.tables import fmt, paired, percentile_bootstrap, table
from integration.harness import RESULTS, machine
from lsn_ext.metrics import auroc

MAP = "MAP entropy"
ARMS = {  # method: (predictive, prior rule)
    "LA nn + grid": ("nn", "grid"),
    "LA nn + marglik": ("nn", "marglik"),
    "LA glm + grid": ("glm", "grid"),
    "LA glm + marglik": ("glm", "marglik"),
}
METHODS = (MAP, *ARMS)
# metric key, header, higher is better, kind: "pixel" (from per-image sums), "image", "shift"
CLEAN = (
    ("auroc", "pixel AUROC", True),
    ("ece", "ECE", False),
    ("nll", "NLL", False),
    ("aurc_fg", "AURC, fg score", False),
    ("spearman_fg", "Spearman (fg score, Dice)", False),
    ("aurc", "AURC, whole-image score (not to use)", False),
    ("dice", "Dice", True),
)
VOLUME_OWN_SCALE = "volume (own standardisation)"
VOLUME_TRAIN_SCALE = "volume (training scale)"


def shift_sets(dataset: str, data: Data, n_id: int, b: ConvergedBudget) -> dict:
    """``name → (images, masks)`` of the shifted test sets, as the model sees them.

    Lesions: the benchmark's four synthetic corruptions of the first ``n_shift`` clean test
    images at their middle strength (applied on the standardised input scale). Nuclei: the 31
    slices of stardist's synthetic 3-D volume standardised by the volume's own statistics (the
    benchmark's set), and the same slices on the 2-D training image's scale
    (``(raw − mean_train) / sd_train``), which keeps the volume's intensity shift.
    """
    if dataset == "lesions":
        x, y = data.test_x[:n_id][: b.n_shift], data.test_y[:n_id][: b.n_shift]
        return {k: (shift(x, k, st[len(st) // 2]), y) for k, (st, _) in SHIFTS.items()}
    own_x, own_y = data.test_x[n_id:], data.test_y[n_id:]
    train_scale = volume_on_training_scale(own_x)
    return {
        "volume (own standardisation)": (own_x, own_y),
        VOLUME_TRAIN_SCALE: (train_scale, own_y),
    }


def unit(cache: ConvergedCache, dataset: str, seed: int) -> dict:
    """Train (or load) the MAP U-Net, fit the posterior, choose the priors, predict, measure."""

    def compute() -> dict:
        b = cache.budget
        data, n_id = load_converged(dataset, b)
        factor = CONVERGED_FACTORS[dataset]
        timing: dict[str, float] = {}
        net, record = cache.net_and_record(NetSpec("unet", member=0), data, factor, seed)
        timing["train"] = record["seconds"]
        t0 = time.perf_counter()
        la, info = fit_posterior(cache, "U-Net + LA", net, data, factor, seed)
        priors = tune_priors(la, info, data, b, seed)
        timing["posterior and priors"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        x_id, y_id = data.test_x[:n_id][: b.n_test], data.test_y[:n_id][: b.n_test]
        shifted = shift_sets(dataset, data, n_id, b)
        sets = {"clean": (x_id, y_id)} | shifted

        def predictive(method: str, x: Tensor) -> Pred:
            if method == MAP:
                with torch.no_grad():
                    p = torch.sigmoid(net(x))
                return Pred(p, entropy_binary(p), None, None)
            pred_type, rule = ARMS[method]
            la.prior_precision = priors[f"{pred_type}-{rule}"]
            s = la_predict(la, x, b.n_epistemic, pred_type, seed)
            return Pred(s.mean, s.entropy, s.mutual_information, s.variance)

        preds = {m: {k: predictive(m, x) for k, (x, _) in sets.items()} for m in METHODS}
        res: dict = {}
        sums: dict = {}
        for m in METHODS:
            pooled = [k for k in shifted if k != VOLUME_TRAIN_SCALE]
            truth = {k: y for k, (_, y) in sets.items()}
            r: dict = {}
            r["sets"], sums[m], pr = measure_sets(preds[m], truth, pooled, b)
            r["shifted_auroc"] = pr["auroc"]
            for score in ("u_mean", "u_fg"):
                clean = torch.tensor(r["sets"]["clean"][score])
                r[f"shift_{score}"] = {
                    k: auroc(clean, torch.tensor(r["sets"][k][score])) for k in shifted
                }
            if m != MAP:
                r["spread"] = spread(preds[m]["clean"], preds[MAP]["clean"])
            res[m] = r
        timing["predict and measure"] = time.perf_counter() - t0
        scores = image_statistics(data.train_x, {k: x for k, (x, _) in sets.items()})
        clean_s = torch.tensor(scores["clean"])
        stats_auroc = {k: auroc(clean_s, torch.tensor(scores[k])) for k in shifted}
        cache.save(sums, cache.path("prisel-sums", dataset, f"s{seed}"))
        grid = [10.0**k for k in b.prior_exponents]
        return {
            "methods": res,
            "priors": {
                "nn-grid": priors["nn-grid"],
                "glm-grid": priors["glm-grid"],
                "marglik": priors["glm-marglik"],
                "nn_at_edge": info["at_edge"],
                "glm_at_edge": priors["glm_at_edge"],
                "grid": grid,
            },
            "image_stats": {"scores": scores, "shift_auroc": stats_auroc},
            "net": record,
            "timing": timing,
            "shift_kinds": list(shifted),
            "n_images": {k: len(x) for k, (x, _) in sets.items()},
        }

    return cache.result(f"prisel-{dataset}-s{seed}", compute)


# ----------------------------------------------------------------------------------------------
# Report


def _value(r: dict, metric: str, kind: str | None = None) -> float | None:
    if metric in ("shift_u_mean", "shift_u_fg"):
        return r[metric][kind]
    if metric == "shifted_auroc":
        return r["shifted_auroc"]
    return r["sets"]["clean"][metric]


def _boot_fn(res: dict, sums: dict, m: str, metric: str, kind: str | None):
    """``(n, fn(idx) -> [R])`` of one seed's metric for method ``m`` on resampled images."""
    r = res["methods"][m]
    if metric in ("shift_u_mean", "shift_u_fg"):
        key = metric.removeprefix("shift_")
        return shift_boot(r["sets"]["clean"][key], r["sets"][kind][key])
    if metric in ("auroc", "ece", "nll"):
        s = sums[m]["clean"]
        return len(s["pixels"]), lambda idx: boot_pixel_metric(metric, s, idx)
    if metric == "shifted_auroc":
        kinds = [k for k in res["shift_kinds"] if k != VOLUME_TRAIN_SCALE]
        s = {
            k: torch.cat([sums[m][c][k] for c in kinds]) for k in ("hist_err", "hist_ok", "pixels")
        }
        return len(s["pixels"]), lambda idx: boot_pixel_metric("auroc", s, idx)
    if metric == "dice":
        dice = torch.tensor(r["sets"]["clean"]["dice_per_image"], dtype=torch.float64)
        return len(dice), lambda idx: dice[idx].mean(1)
    per = r["sets"]["clean"]
    return len(per["u_mean"]), lambda idx: boot_image_metric(metric, per, idx)


class Report:
    def __init__(self, cache: ConvergedCache, datasets: list[str], seeds: list[int]):
        self.datasets, self.seeds, self.b = datasets, seeds, cache.budget
        self.res = {(d, s): cache.stored(f"prisel-{d}-s{s}") for d in datasets for s in seeds}
        if missing := [k for k, v in self.res.items() if v is None]:
            raise SystemExit(f"no cached results for {missing}; run without --report-only first")
        self.sums = {
            k: torch.load(cache.path("prisel-sums", k[0], f"s{k[1]}"), weights_only=False)
            for k in self.res
        }

    def values(self, d: str, m: str, metric: str, kind: str | None = None) -> list[float]:
        return [_value(self.res[d, s]["methods"][m], metric, kind) for s in self.seeds]

    def boot(self, d: str, m: str, metric: str, kind: str | None, ref: str | None = None):
        """Bootstrap interval of the seed mean (of ``m − ref`` when ``ref``: the same images)."""
        per_seed = []
        for s in self.seeds:
            n, fn = _boot_fn(self.res[d, s], self.sums[d, s], m, metric, kind)
            if ref is not None:
                _, fr = _boot_fn(self.res[d, s], self.sums[d, s], ref, metric, kind)
                fn = lambda idx, fn=fn, fr=fr: fn(idx) - fr(idx)  # noqa: E731
            per_seed.append((n, fn))
        return percentile_bootstrap(per_seed, self.b.n_bootstrap)

    def cell(self, d: str, m: str, metric: str, kind: str | None = None) -> str:
        v = [x for x in self.values(d, m, metric, kind) if x is not None]
        if not v:
            return "n/a"
        n = len(self.seeds)
        text = fmt(v) + (f" (defined on {len(v)}/{n} seeds)" if len(v) < n else "")
        bi = self.boot(d, m, metric, kind)
        return text + (f" [{bi[0]:.3f}, {bi[1]:.3f}]" if bi else "")

    def paired_cell(self, d: str, m: str, metric: str, hib: bool, kind: str | None = None) -> str:
        both = [
            (a, r)
            for a, r in zip(
                self.values(d, m, metric, kind), self.values(d, MAP, metric, kind), strict=True
            )
            if a is not None and r is not None
        ]
        if not both:
            return "n/a"
        p = paired([a for a, _ in both], [r for _, r in both], hib)
        bi = self.boot(d, m, metric, kind, ref=MAP)
        boot = f" [{bi[0]:+.4f}, {bi[1]:+.4f}]" if bi else ""
        return f"{p.diff.fmt(4, sign=True)} ({p.count}){boot}"


def _section(rep: Report, d: str) -> str:
    kinds = rep.res[d, rep.seeds[0]]["shift_kinds"]
    clean = [[m] + [rep.cell(d, m, k) for k, _, _ in CLEAN] for m in METHODS]
    paired_rows = [
        [m] + [rep.paired_cell(d, m, k, hib) for k, _, hib in CLEAN if k != "dice"] for m in ARMS
    ]
    shift_rows = []
    for m in METHODS:
        row = [m] + [rep.cell(d, m, "shift_u_fg", k) for k in kinds]
        row += [rep.cell(d, m, "shift_u_mean", k) for k in kinds]
        shift_rows.append([*row, rep.cell(d, m, "shifted_auroc")])
    stats_row = ["image statistics (as the model sees the images)"]
    stats_row += [
        fmt([rep.res[d, s]["image_stats"]["shift_auroc"][k] for s in rep.seeds]) for k in kinds
    ]
    shift_paired = [
        [m]
        + [rep.paired_cell(d, m, "shift_u_fg", True, k) for k in kinds]
        + [rep.paired_cell(d, m, "shifted_auroc", True)]
        for m in ARMS
    ]
    diag_rows = []
    for m, (pt, rule) in ARMS.items():
        pr = [
            rep.res[d, s]["priors"][f"{pt}-grid" if rule == "grid" else "marglik"]
            for s in rep.seeds
        ]
        edge = (
            f"{sum(rep.res[d, s]['priors'][f'{pt}_at_edge'] for s in rep.seeds)}/{len(rep.seeds)}"
            if rule == "grid"
            else "–"
        )
        sp = [rep.res[d, s]["methods"][m]["spread"] for s in rep.seeds]
        diag_rows.append(
            [
                m,
                f"{min(pr):.3g} … {max(pr):.3g}",
                edge,
                fmt([v["entropy_ratio"] for v in sp]),
                fmt([v["mean_abs_dp"] for v in sp], 5),
                fmt([v["mean_sd_p"] for v in sp], 5),
            ]
        )
    return "\n\n".join(
        [
            f"## {d}",
            "### Clean test images",
            table(["Method"] + [h for _, h, _ in CLEAN], clean),
            "### Paired against the MAP entropy (clean)",
            table(["Method − MAP"] + [h for k, h, _ in CLEAN if k != "dice"], paired_rows),
            "### Shift",
            table(
                ["Method"]
                + [f"shift AUROC, fg score: {k}" for k in kinds]
                + [f"shift AUROC, whole-image score: {k}" for k in kinds]
                + ["pixel AUROC on shifted"],
                [*shift_rows, stats_row + ["—"] * (len(kinds) + 1)],
            ),
            "### Shift, paired against the MAP entropy",
            table(
                ["Method − MAP"]
                + [f"shift AUROC, fg score: {k}" for k in kinds]
                + ["pixel AUROC on shifted"],
                shift_paired,
            ),
            "### Prior selection diagnostics (clean test images)",
            table(
                [
                    "Method",
                    "prior (range over seeds)",
                    "grid picked an end",
                    "mean entropy ÷ MAP's",
                    "mean abs(E p − p_MAP)",
                    "mean posterior sd of p",
                ],
                diag_rows,
            ),
        ]
    )


def write_report(cache: ConvergedCache, datasets: list[str], seeds: list[int], out: Path,
                 quick: bool) -> Path:  # fmt: skip
    rep = Report(cache, datasets, seeds)
    b = rep.b
    nets = [rep.res[k]["net"] for k in rep.res]
    stopped = sum(r["stopped_early"] for r in nets)
    timing = {
        part: sum(rep.res[k]["timing"][part] for k in rep.res) / 60
        for part in ("train", "posterior and priors", "predict and measure")
    }
    head = [
        "# U-Net + LA prior selection against the MAP's own entropy (a separate run)",
        "Generated by `integration/experiments/prior_selection.py`"
        + (" (quick run: tiny sizes, numbers meaningless)" if quick else "")
        + f"; {len(seeds)} seeds ({', '.join(map(str, seeds))}) per data set. {machine()}",
        "**A separate run, not part of `uncertainty.md`.** It retrains the MAP U-Net of "
        "`uncertainty_benchmark.py` per seed and data set with that script's own code and budget "
        f"(widths {'-'.join(map(str, b.widths))}, Adam, cap {b.steps} steps, early stopping on "
        f"validation Dice every {b.eval_every} steps, patience {b.patience}, not before step "
        f"{b.min_steps}; foreground weight lesions {CONVERGED_FACTORS['lesions']}, nuclei "
        f"{CONVERGED_FACTORS['nuclei']}) and measures the four prior rules and the MAP on the same "
        "networks and images. Its seeds give the same training as the benchmark's, but the "
        "networks were trained again, so its numbers need not equal `uncertainty.md`'s "
        f"digit for digit. Early stopping reached its patience in {stopped} of {len(nets)} "
        "networks.",
        "**Data.** lesions: synthetic (`lsn_ext.data.lesion_dataset`), "
        f"{b.n_test} clean test images; shifts: four synthetic corruptions of the first "
        f"{b.n_shift} at their middle strength ("
        + "; ".join(f"{k} {st[len(st) // 2]}: {mean}" for k, (st, mean) in SHIFTS.items())
        + "). nuclei: 15 test-band patches of one real fluorescence image; shift: the 31 slices "
        "of stardist's *synthetic* 3-D nuclei volume, once standardised by the volume's own "
        "statistics (as `uncertainty.md`), once on the 2-D training image's intensity scale "
        "(the volume's own intensity shift kept). Every shift here is synthetic: corruptions "
        "(lesions) or a synthetic volume (nuclei).",
        "**Methods.** MAP entropy: the U-Net's sigmoid entropy. LA: diagonal Laplace over all "
        "weights (Monte-Carlo GGN), predictive with "
        f'{b.n_epistemic} posterior samples (`link_approx="mc"`); `nn` samples the network, '
        "`glm` its linearisation; grid: validation NLL of that predictive on "
        f"10^{b.prior_exponents[0]}…10^{b.prior_exponents[-1]} ({b.n_val_samples} samples per "
        "candidate); marglik: laplace-torch's scalar marginal likelihood (one value for `nn` "
        "and `glm`).",
        "**Scores and statistics.** Image score: mean entropy within the predicted foreground "
        f"dilated by {b.fg_dilation} px (fg score); the whole-image mean entropy is shown as "
        "the score not to use (it ranks images by object size, `uncertainty.md`). Shift AUROC: "
        "shifted (positive) against clean images by the per-image score. Image statistics: "
        "Mahalanobis distance of an image's (intensity mean, sd) from the training images', "
        "larger = shifted (direction fixed before any test label), on the images as the model "
        "sees them. Each cell: mean ± 95 % t-interval over seeds "
        "(`integration/experiments/tables.py`), "
        f"then [2.5 %, 97.5 %] of a bootstrap over test images ({b.n_bootstrap} resamples, "
        "networks fixed). Paired: per-seed difference method − MAP, t-interval, (k/n) = "
        "better on k of n seeds, then the bootstrap interval of the seed-mean difference with "
        "both methods on the same resampled images.",
    ]
    body = [_section(rep, d) for d in datasets]
    cost = (
        "## Cost\n\n"
        + table(
            ["part", "summed wall min, all units"],
            [[k, f"{v:.1f}"] for k, v in timing.items()],
        )
        + "\n\nWall-clock time summed over the units, one torch thread, one unit at a time, "
        "on a machine shared with other jobs (training as recorded when the network was "
        "trained): a rough cost, not a benchmark."
    )
    text = "\n\n".join([*head, *body, cost]) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "prior_selection.md"
    path.write_text(text)
    with open(out / "prior_selection_per_seed.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dataset", "seed", "method", "metric", "value"])
        for (d, s), r in sorted(rep.res.items()):
            for m in METHODS:
                rm = r["methods"][m]
                for k, _, _ in CLEAN:
                    w.writerow([d, s, m, k, rm["sets"]["clean"][k]])
                w.writerow([d, s, m, "shifted_auroc", rm["shifted_auroc"]])
                for score in ("u_fg", "u_mean"):
                    for kind, v in rm[f"shift_{score}"].items():
                        w.writerow([d, s, m, f"shift_auroc_{score}:{kind}", v])
                for k, v in rm.get("spread", {}).items():
                    w.writerow([d, s, m, k, v])
            for key in ("nn-grid", "glm-grid", "marglik"):
                w.writerow([d, s, "prior", key, r["priors"][key]])
            for kind, v in r["image_stats"]["shift_auroc"].items():
                w.writerow([d, s, "image statistics", f"shift_auroc:{kind}", v])
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default=None, help="default 0-4 (quick: 0,1)")
    parser.add_argument("--datasets", default="lesions,nuclei")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=None, help="default results/.cache/...")
    parser.add_argument("--out", type=Path, default=None, help="default integration/results")
    parser.add_argument("--quick", action="store_true", help="tiny sizes into a temporary dir")
    parser.add_argument("--report-only", action="store_true", help="only write the report")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = parse_seeds(args.seeds or ("0,1" if args.quick else "0-4"))
    datasets = args.datasets.split(",")
    budget = CONVERGED_QUICK if args.quick else ConvergedBudget()
    tmp = Path(tempfile.mkdtemp(prefix="prior-selection-")) if args.quick else None
    out = args.out or (tmp if tmp else RESULTS)
    root = args.cache or ((tmp / "cache") if tmp else RESULTS / ".cache" / "prior_selection")
    cache = ConvergedCache(root, budget)
    if not args.report_only:
        for s in seeds:  # seed by seed: a run stopped early has every data set's first seeds
            for d in datasets:
                t0 = time.perf_counter()
                unit(cache, d, s)
                print(
                    f"[prior_selection] {d} seed {s}: {time.perf_counter() - t0:.0f} s", flush=True
                )
    path = write_report(cache, datasets, seeds, out, args.quick)
    print(path.read_text())
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
