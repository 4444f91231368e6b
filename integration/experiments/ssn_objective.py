"""The SSN objective ablation: which rank, sample count and loss reproduce the paper's Fig. 5?

Grid (issue 26): covariance rank ``r`` ∈ {0, 1, 10} × logit samples ``M`` ∈ {1, 5, 20, 100} ×
loss ∈ {``logsumexp`` (LSN Eq. 11, per image), ``expected`` (per-pixel expected BCE under the
logit distribution)}; with ``M = 1`` the two losses are the same function, so the grid has
3 × (1 + 3 × 2) = 21 configurations. Even ``M`` use antithetic pairs (the SSN paper's
sampling), ``M`` = 1 and 5 plain samples. Every SSN trains without class reweighting (factor 1)
with early stopping on validation Dice (:class:`kit.ConvergedBudget`: cap 800
steps, patience 4 evaluations of 50 steps, no stop before step 300 or while the Dice is 0), on
the synthetic ISIC-like lesions (``lsn_ext.data.lesion_dataset``) of ``lsn_paper``.

Measured per configuration and seed, on the SSN alone (its aleatoric predictive ``E_η σ(η)``,
``Var_η σ(η)`` from 32 logit samples; no Laplace):

- IoU of ``E σ(η) > ½`` on the test images, and whether the network collapsed (IoU < 0.05);
- the aleatoric boundary ratio: share of ``Var σ(η)`` within 2 px of the mask boundary ÷ the
  band's share of the pixels (Fig. 5 as a number: > 1 marks boundaries), and the mean
  aleatoric variance inside the object, in the band and outside;
- the learnt logit spread: median marginal logit sd ``√(d + |P|²)`` against the median
  ``|μ|``;
- shift detection: AUROC of the per-image mean predictive entropy (and the entropy within the
  dilated predicted foreground) for clean against shifted test images (``kit.SHIFTS`` at
  their middle strength), beside two trivial baselines: the entropy of the mean network alone
  (``σ(μ)``, "MAP entropy") and a model-free image-statistics score;
- box detection: average precision of the aleatoric map for the pixels of a noise box, and its
  Box Ratio (LSN Eq. 17).

Statistics: mean ± 95 % t-interval over seeds; a bootstrap interval over test images (the same
resampled images for every seed, 1,000 resamples, of the seed mean); paired per-seed
differences against the paper's configuration (rank 10, M = 20, logsumexp).

Run: ``./dev bench ssn_objective [--seeds 0-4] [--workers 2] [--quick] [--report-only]``;
writes ``integration/results/ssn_objective.md`` and ``ssn_objective_per_seed.csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile
import time
from dataclasses import dataclass
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
    foreground_entropy,
    image_statistics,
    load_converged,
    parse_seeds,
    record_time,
    shift,
)
from integration.experiments.tables import fmt, mean, table
from integration.harness import RESULTS, machine, run_units
from lsn_ext.lsn import aleatoric_maps
from lsn_ext.metrics import auroc, average_precision, boundary_band, box_ratio

DATASET = "lesions"
PAPER = (10, 20, "logsumexp")  # the LSN paper's SSN: rank 10, M = 20, Eq. 11
N_ALEATORIC = 32
BAND = 2


@dataclass(frozen=True)
class Config:
    """One SSN training configuration."""

    rank: int
    samples: int
    objective: str

    @property
    def name(self) -> str:
        loss = "Eq. 11" if self.objective == "logsumexp" else "expected"
        return f"r{self.rank} M{self.samples} {loss}" if self.samples > 1 else f"r{self.rank} M1"

    def spec(self) -> NetSpec:
        return NetSpec(
            "ssn",
            rank=self.rank,
            ssn_samples=self.samples,
            antithetic=self.samples % 2 == 0,
            objective=self.objective,
        )


def reference(grid: list[Config]) -> Config:
    """The paper's configuration (quick grid: its largest rank and M with Eq. 11)."""
    paper = Config(*PAPER)
    if paper in grid:
        return paper
    return max((c for c in grid if c.objective == "logsumexp"), key=lambda c: (c.rank, c.samples))


def _reference_label(ref: Config) -> str:
    """The paired tables' heading: the paper's configuration, or what stands in for it."""
    if ref == Config(*PAPER):
        return f"the paper's configuration ({ref.name})"
    return (
        f"{ref.name} (the paper's configuration, {Config(*PAPER).name}, is not in this report: "
        "its largest rank and M with Eq. 11 stand in)"
    )


def configs(
    quick: bool = False,
    samples: tuple[int, ...] | None = None,
    ranks: tuple[int, ...] | None = None,
) -> list[Config]:
    """The grid (quick: rank {0, 2} × M {1, 4} × both losses, 6 configurations); ``samples``
    restricts M and ``ranks`` the ranks (e.g. ``(1, 20)`` and ``(10,)`` when the budget allows
    no more)."""
    all_ranks, all_samples = ((0, 2), (1, 4)) if quick else ((0, 1, 10), (1, 5, 20, 100))
    samples = all_samples if samples is None else tuple(m for m in all_samples if m in samples)
    ranks = all_ranks if ranks is None else tuple(r for r in all_ranks if r in ranks)
    out = []
    for r in ranks:
        for m in samples:
            out += [
                Config(r, m, o) for o in (("logsumexp",) if m == 1 else ("logsumexp", "expected"))
            ]
    return out


# ----------------------------------------------------------------------------------------------
# One unit: a configuration and a seed


def unit(cache: ConvergedCache, config: Config, seed: int) -> dict:
    """Train (or load) one SSN and measure it; per-image sums are kept for the bootstrap."""

    def compute() -> dict:
        b = cache.budget
        data, n_id = load_converged(DATASET, b)
        net, record = cache.net_and_record(config.spec(), data, 1, seed)
        x, y = data.test_x[:n_id][: b.n_test], data.test_y[:n_id][: b.n_test]
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            mean, var = aleatoric_maps(net, x, N_ALEATORIC, generator=gen)
            out = net.distribution(x)
            sd = (out.cov_diag.flatten(1) + out.cov_factor.pow(2).sum(-1)).sqrt()
            mu = out.mean.flatten(1).abs()
        truth = y > 0.5
        pred = mean > 0.5
        inter = (pred & truth).flatten(1).sum(1).double()
        union = (pred | truth).flatten(1).sum(1).double()
        band = boundary_band(truth.double(), BAND)
        v = var.double()
        region = {
            "inside": (v * (truth & ~band)).sum() / (truth & ~band).sum().clamp_min(1),
            "band": (v * band).sum() / band.sum().clamp_min(1),
            "outside": (v * (~truth & ~band)).sum() / (~truth & ~band).sum().clamp_min(1),
        }

        xs = x[: b.n_shift]
        sets = {"clean": xs} | {k: shift(xs, k, st[len(st) // 2]) for k, (st, _) in SHIFTS.items()}
        scores: dict[str, dict[str, list[float]]] = {"mean": {}, "fg": {}, "map": {}}
        for k, xk in sets.items():
            with torch.no_grad():
                pk, _ = aleatoric_maps(
                    net, xk, N_ALEATORIC, generator=torch.Generator().manual_seed(seed)
                )
                p_map = torch.sigmoid(net(xk))
            ent = entropy_binary(pk)
            scores["mean"][k] = ent.flatten(1).mean(1).tolist()
            scores["fg"][k] = foreground_entropy(ent, pk, b.fg_dilation).tolist()
            scores["map"][k] = entropy_binary(p_map).flatten(1).mean(1).tolist()
        stats = image_statistics(data.train_x, sets)

        _, _, x_box, box, _, _ = boxed(data, b, seed)
        with torch.no_grad():
            _, var_box = aleatoric_maps(
                net, x_box, N_ALEATORIC, generator=torch.Generator().manual_seed(seed)
            )
        return {
            "train": record,
            "iou_inter": inter.tolist(),
            "iou_union": union.tolist(),
            "band_var": (v * band).flatten(1).sum(1).tolist(),
            "total_var": v.flatten(1).sum(1).tolist(),
            "band_pixels": band.flatten(1).sum(1).double().tolist(),
            "pixels": float(band[0].numel()),
            "regions": {k: float(t) for k, t in region.items()},
            "logit_sd_median": float(sd.median()),
            "abs_mu_median": float(mu.median()),
            "shift_scores": scores,
            "image_stats": stats,
            "box_ap": average_precision(var_box.double(), box.expand_as(var_box)),
            "box_ratio": box_ratio(var_box, box).tolist(),
        }

    return cache.result(
        f"ssnobj-{DATASET}-{config.rank}-{config.samples}-{config.objective}-s{seed}", compute
    )


def _run_unit(args: tuple) -> tuple[tuple, float]:
    root, budget, threads, (config, seed) = args
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    unit(ConvergedCache(root, budget), config, seed)
    return ("ssnobj", config.name, seed), time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# Metrics from the stored per-image values (so that the bootstrap can resample images)


def iou_of(r: dict, idx: Tensor | None = None) -> float:
    inter, union = torch.tensor(r["iou_inter"]), torch.tensor(r["iou_union"])
    if idx is not None:
        inter, union = inter[idx], union[idx]
    return float(inter.sum() / union.sum()) if union.sum() > 0 else 1.0


def boundary_ratio(r: dict, idx: Tensor | None = None) -> float:
    bv, tv, bp = (torch.tensor(r[k]) for k in ("band_var", "total_var", "band_pixels"))
    if idx is not None:
        bv, tv, bp = bv[idx], tv[idx], bp[idx]
    pixel_share = bp.sum() / (len(bp) * r["pixels"])
    return float((bv.sum() / tv.sum()) / pixel_share)


def shift_auroc(clean: list[float], shifted: list[float], idx: Tensor | None = None) -> float:
    c, s = torch.tensor(clean), torch.tensor(shifted)
    if idx is not None:
        c, s = c[idx], s[idx]
    return auroc(c, s)


def _shift_mean(r: dict, kind: str, idx: Tensor | None = None) -> float:
    """AUROC averaged over the four shifts, for one score kind (``mean``, ``fg``, ``map``,
    ``stats``)."""
    src = r["image_stats"] if kind == "stats" else r["shift_scores"][kind]
    vals = [shift_auroc(src["clean"], src[k], idx) for k in SHIFTS]
    return sum(vals) / len(vals)


METRICS = {  # name: (per-seed function of (result, image idx or None), test-image set)
    "IoU": (iou_of, "test"),
    "boundary ratio": (boundary_ratio, "test"),
    "shift AUROC (entropy)": (lambda r, i: _shift_mean(r, "mean", i), "shift"),
    "shift AUROC (fg entropy)": (lambda r, i: _shift_mean(r, "fg", i), "shift"),
    "shift AUROC (MAP entropy)": (lambda r, i: _shift_mean(r, "map", i), "shift"),
    "shift AUROC (image stats)": (lambda r, i: _shift_mean(r, "stats", i), "shift"),
}


def bootstrap(results: list[dict], metric: str, n: int, n_boot: int) -> tuple[float, float]:
    """95 % percentile interval of the seed mean of ``metric`` over ``n_boot`` resamples of the
    ``n`` test images (the same indices for every seed)."""
    fn = METRICS[metric][0]
    gen = torch.Generator().manual_seed(0)
    vals = []
    for _ in range(n_boot):
        idx = torch.randint(0, n, (n,), generator=gen)
        try:
            vals.append(sum(fn(r, idx) for r in results) / len(results))
        except ValueError:  # a resample with one class only: skip
            continue
    v = torch.tensor(vals, dtype=torch.float64)
    return float(v.quantile(0.025)), float(v.quantile(0.975))


# ----------------------------------------------------------------------------------------------
# Report


def _collected(cache: ConvergedCache, grid: list[Config], seeds: list[int]) -> dict:
    res = {}
    for c in grid:
        rs = [
            cache.stored(f"ssnobj-{DATASET}-{c.rank}-{c.samples}-{c.objective}-s{s}") for s in seeds
        ]
        res[c] = [(s, r) for s, r in zip(seeds, rs, strict=True) if r is not None]
    return res


def _cell(vals: dict, boot: dict, metric: str, digits: int = 3) -> str:
    lo, hi = boot[metric]
    return f"{fmt(vals[metric], digits)} [{lo:.{digits}f}, {hi:.{digits}f}]"


def write_report(
    cache: ConvergedCache, grid: list[Config], seeds: list[int], out: Path, quick: bool
) -> Path:
    b = cache.budget
    res = _collected(cache, grid, seeds)
    rows, csv_rows = [], []
    for c in grid:
        per = res[c]
        if not per:
            continue
        rs = [r for _, r in per]
        vals = {m: [fn(r, None) for r in rs] for m, (fn, _) in METRICS.items()}
        n_test, n_shift = len(rs[0]["iou_inter"]), len(rs[0]["shift_scores"]["mean"]["clean"])
        boot = {
            m: bootstrap(rs, m, n_test if where == "test" else n_shift, 200 if quick else 1000)
            for m, (_, where) in METRICS.items()
            if m in ("IoU", "boundary ratio", "shift AUROC (entropy)")
        }
        collapsed = sum(v < 0.05 for v in vals["IoU"])
        steps = [r["train"]["best_step"] for r in rs]
        capped = sum(not r["train"]["stopped_early"] for r in rs)

        regions = " / ".join(
            f"{mean([r['regions'][k] for r in rs]):.3g}" for k in ("inside", "band", "outside")
        )
        sd = mean([r["logit_sd_median"] for r in rs])
        mu = mean([r["abs_mu_median"] for r in rs])
        rows.append(
            [
                c.name,
                f"{len(rs)}",
                _cell(vals, boot, "IoU"),
                f"{collapsed}/{len(rs)}",
                _cell(vals, boot, "boundary ratio", 2),
                regions,
                f"{sd:.2f} / {mu:.2f}",
                _cell(vals, boot, "shift AUROC (entropy)"),
                fmt(vals["shift AUROC (fg entropy)"]),
                fmt(vals["shift AUROC (MAP entropy)"]),
                fmt([r["box_ap"] for r in rs]),
                fmt([sum(r["box_ratio"]) / len(r["box_ratio"]) for r in rs]),
                f"{mean(steps):.0f} ({capped} capped)",
            ]
        )
        for s, r in per:
            row = {m: fn(r, None) for m, (fn, _) in METRICS.items()}
            row |= {
                "box AP": r["box_ap"],
                "box ratio": sum(r["box_ratio"]) / len(r["box_ratio"]),
                "logit sd median": r["logit_sd_median"],
                "|mu| median": r["abs_mu_median"],
                "best step": r["train"]["best_step"],
                "stopped early": int(r["train"]["stopped_early"]),
                "train seconds": r["train"]["seconds"],
            }
            csv_rows += [
                {
                    "config": c.name,
                    "rank": c.rank,
                    "M": c.samples,
                    "loss": c.objective,
                    "seed": s,
                    "metric": k,
                    "value": v,
                }
                for k, v in row.items()
            ]
    header = [
        "configuration",
        "seeds",
        "IoU (t-CI) [image bootstrap]",
        "collapsed",
        "boundary ratio (t-CI) [bootstrap]",
        "aleatoric var inside / band / outside",
        "logit sd / abs(μ) (medians)",
        "shift AUROC, entropy (t-CI) [bootstrap]",
        "shift AUROC, fg entropy",
        "shift AUROC, MAP entropy (baseline)",
        "box AP (aleatoric)",
        "Box Ratio (aleatoric)",
        "best step",
    ]
    ref = reference(grid)
    paper = res.get(ref, [])
    paired = []
    for c in grid:
        if c == ref or not res[c] or not paper:
            continue
        base = dict(paper)
        pairs = [(r, base[s]) for s, r in res[c] if s in base]
        if len(pairs) < 2:
            continue
        line = [c.name]
        for m in ("IoU", "boundary ratio", "shift AUROC (entropy)"):
            fn = METRICS[m][0]
            d = [fn(r, None) - fn(p, None) for r, p in pairs]
            line.append(f"{fmt(d)} ({sum(x > 0 for x in d)}/{len(d)} above)")
        paired.append(line)
    stats = [mean([_shift_mean(r, "stats") for _, r in res[c]]) for c in grid if res[c]]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ssn_objective.md"
    quick_note = " (quick run: tiny sizes, numbers meaningless)" if quick else ""
    widths = "-".join(map(str, b.widths))
    stats_mean = mean(stats) if stats else float("nan")
    paired_table = (
        table(["configuration", "Δ IoU", "Δ boundary ratio", "Δ shift AUROC (entropy)"], paired)
        if paired
        else "(not enough seeds)"
    )
    text = "\n".join(
        [
            "# The SSN objective ablation (issue 26): rank × samples × loss, converged training",
            "",
            f"Generated by `integration/experiments/ssn_objective.py`{quick_note}; data set: "
            f"{DATASET} "
            "(synthetic, ISIC-like, `lsn_ext.data.lesion_dataset`), seeds "
            f"{', '.join(map(str, seeds))}. {machine()}",
            "",
            f"Budget: {b.n_train} training, {b.n_val} validation and {b.n_test} test images "
            f"(64×64); U-Net backbone widths {widths} (tanh); Adam from {b.lr} with cosine decay "
            f"over a cap of {b.steps} steps of {b.batch_size} images, early stopping on "
            f"validation Dice every {b.eval_every} steps with patience {b.patience}, not before "
            f"step {b.min_steps}; no class reweighting (factor 1); {N_ALEATORIC} logit samples "
            f"per map; shift sets of {b.n_shift} images; {b.n_eval} noise-box images.",
            "",
            f"Configurations in this report: rank {sorted({c.rank for c in grid})} × M "
            f"{sorted({c.samples for c in grid})} × loss (Eq. 11, expected); the full grid of "
            f"`configs()` has M {sorted({c.samples for c in configs(quick)})} (`--samples` "
            "restricts it).",
            "",
            "## Results",
            "",
            table(header, rows),
            "",
            "IoU of `E σ(η) > ½`, pooled over the test images; collapsed: IoU < 0.05. Boundary "
            f"ratio: share of the aleatoric variance within {BAND} px of the mask boundary ÷ the "
            "band's share of the pixels (> 1: the map marks boundaries; the paper's Fig. 5). "
            "Shift AUROC: clean against shifted images by per-image mean entropy, averaged over "
            "the four shifts of `lsn_paper.SHIFTS` at their middle strength; the model-free "
            f"image-statistics score reaches {stats_mean:.3f} on the same images. t-CI: mean "
            "± 95 % t-interval over seeds; [..]: 95 % bootstrap interval of the seed mean over "
            "the test images. Per-seed values: `ssn_objective_per_seed.csv`.",
            "",
            f"## Paired against {_reference_label(ref)}, per seed",
            "",
            paired_table,
            "",
        ]
    )
    path.write_text(text)
    with open(out / "ssn_objective_per_seed.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["config", "rank", "M", "loss", "seed", "metric", "value"])
        w.writeheader()
        w.writerows(csv_rows)
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default=None, help="e.g. 0-4 (default 0-4; quick 0,1)")
    parser.add_argument("--samples", default=None, help="restrict M, e.g. 1,20 (default all)")
    parser.add_argument("--ranks", default=None, help="restrict the rank, e.g. 10 (default all)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--cache", type=Path, default=None, help="default results/.cache/...")
    parser.add_argument("--out", type=Path, default=None, help="default integration/results")
    parser.add_argument("--quick", action="store_true", help="tiny sizes into a temporary dir")
    parser.add_argument("--report-only", action="store_true", help="only write the report")
    args = parser.parse_args(argv)
    budget = CONVERGED_QUICK if args.quick else ConvergedBudget()
    seeds = parse_seeds(args.seeds or ("0,1" if args.quick else "0-4"))
    samples = tuple(int(m) for m in args.samples.split(",")) if args.samples else None
    ranks = tuple(int(r) for r in args.ranks.split(",")) if args.ranks else None
    grid = configs(args.quick, samples, ranks)
    if not grid:
        parser.error(f"--samples {args.samples} and --ranks {args.ranks} select no configuration")
    tmp = Path(tempfile.mkdtemp(prefix="ssn-objective-")) if args.quick else None
    out = args.out or (tmp if tmp else RESULTS)
    root = args.cache or ((tmp / "cache") if tmp else RESULTS / ".cache" / "uncertainty")
    cache = ConvergedCache(root, budget)
    # Seed by seed (a cut-short run leaves whole seeds), the M = 100 configurations (a third of
    # the cost) after all the others; within a seed the expensive configurations first.
    units = [] if args.report_only else [(c, s) for s in seeds for c in grid]
    big = max(c.samples for c in grid)
    units.sort(
        key=lambda u: (
            u[0].samples == big,
            seeds.index(u[1]),
            -(u[0].samples * (1 + u[0].rank)),
        )
    )
    work = [(root, budget, 1, u) for u in units]
    run_units("ssn_objective", _run_unit, work, args.workers, lambda k, t: record_time(cache, k, t))
    path = write_report(cache, grid, seeds, out, args.quick)
    print(path.read_text())
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
