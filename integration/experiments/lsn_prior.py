"""Choosing the LSN's prior precision, measured on the demo's own setting (issue 26, item 4).

The demo (``lsn-ext demo``) trains an SSN (rank 10, LSN Eq. 11 with M = 20, U-Net widths 8-16-32,
12 epochs) on the nuclei patches and fits the LSN with the Monte-Carlo GGN diagonal. This script
repeats that LSN on many seeds and asks which prior precision each selection rule picks, and
what each choice gives on the demo's measures:

- rules: laplace-torch's marginal likelihood, scalar (the demo's default) and layer-wise (200 Adam
  steps of 0.1 from 1); the validation-NLL grid search (:func:`lsn_ext.gridsearch_prior_precision`,
  ``10⁻⁴…10⁸``) scored with 2, 8 and 64 posterior samples per candidate; and selection on a
  held-out synthetic shift (the prior with the highest per-image-entropy AUROC of the clean
  against the shifted validation patches, the four ``kit.SHIFTS`` at their middle
  strength, 16 samples);
- measures on the test band: IoU, per-pixel NLL of ``E σ``, Pixel and Box Ratio of the noise and
  black boxes, and the AUROC of the per-image entropy and of the per-image epistemic variance for
  the far-OOD H&E patches, each from 200 posterior samples for the rules' priors (the demo's
  LSN row: the mean network's predictive), and from 32 samples on a coarse grid
  ``10⁻⁴, 10⁻², …, 10⁸`` for the prior each measure wants;
- the grid NLL's bias: the NLL estimated from ``n`` samples minus the NLL from 128 samples, for
  each candidate (``n`` = 2 and 8 repeated over 3 and 2 sample seeds).

Statistics: mean ± 95 % t-interval over seeds, a bootstrap over the test images (1,000
resamples of the seed mean; the far-OOD patches resampled too) and paired per-seed differences
against the demo's default. The decision rule for the demo's default is stated in the report
before the numbers: keep the marginal likelihood unless another rule raises the H&E entropy
AUROC (primary) with a paired 95 % interval above 0 and does not lower the IoU beyond its
interval.

Run: ``./dev bench lsn_prior [--seeds 0-9] [--ssn-loss logsumexp|expected] [--workers 2]
[--quick] [--report-only]``; writes ``integration/results/lsn_prior.md`` and
``lsn_prior_per_seed.csv`` (``lsn_prior_expected.*`` for the expected-BCE SSN).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from integration.experiments.kit import (
    SHIFTS,
    cached_json,
    demo_config,
    loader,
    marglik_prior,
    parse_seeds,
    shift,
    train_demo_ssn,
)
from integration.experiments.tables import fmt, geo, mean, mean_ci, table
from integration.harness import RESULTS, machine, run_units
from lsn_ext import demo, gridsearch_prior_precision, predict
from lsn_ext.lsn import fit_lsn
from lsn_ext.metrics import auroc, box_ratio, per_image_entropy, pixel_ratio

GRID = tuple(10.0**k for k in range(-4, 9))
N_EVAL = 200
N_REF = 128
BIAS_SAMPLES = {2: 3, 8: 2, 64: 1}  # samples per candidate: repeats (sample seeds)
N_SHIFT = 16
CURVE = tuple(10.0**k for k in range(-4, 9, 2))
N_CURVE = 32
DEFAULT = "marglik (scalar)"
LOSS_NAMES = {"logsumexp": "Eq. 11", "expected": "per-pixel expected BCE"}
RULES = (
    DEFAULT,
    "marglik (layer-wise)",
    "NLL grid, 2 samples",
    "NLL grid, 8 samples",
    "NLL grid, 64 samples",
    "shift selection",
)
MEASURES = (
    "IoU",
    "NLL",
    "Pixel Ratio (noise)",
    "Pixel Ratio (black)",
    "Box Ratio (noise)",
    "Box Ratio (black)",
    "Entropy AUROC (H&E)",
    "Variance AUROC (H&E)",
)
LOWER_IS_BETTER = {"NLL"}


def config(quick: bool, ssn_loss: str = "logsumexp") -> demo.DemoConfig:
    """The demo's settings with the SSN loss ``ssn_loss`` (quick: its tiny test sizes)."""
    return demo_config(quick, ssn_loss=ssn_loss)


def _grid(quick: bool) -> tuple[float, ...]:
    return (1e-2, 1.0, 1e2, 1e4) if quick else GRID


def _curve(quick: bool) -> tuple[float, ...]:
    return (1e-2, 1e2) if quick else CURVE


def _samples(quick: bool, n: int) -> int:
    return min(n, 4) if quick else n


# ----------------------------------------------------------------------------------------------
# One seed


def _per_image(la, data: demo.DemoData, n: int, seed: int) -> dict[str, list[float]]:
    """Per-image values of every measure at the current prior (the bootstrap resamples them)."""

    def pred(x: Tensor):
        return predict(la, x, n, generator=torch.Generator().manual_seed(seed))

    p = {k: pred(x) for k, x in (("id", data.test_x), ("noise", data.noise_x))}
    p |= {k: pred(x) for k, x in (("black", data.black_x), ("he", data.far_ood))}
    truth = data.test_y > 0.5
    mask = p["id"].mean > 0.5
    prob = p["id"].mean.double().clamp(1e-7, 1 - 1e-7)
    nll = -torch.where(truth, prob.log(), (1 - prob).log())
    return {
        "inter": (mask & truth).flatten(1).sum(1).double().tolist(),
        "union": (mask | truth).flatten(1).sum(1).double().tolist(),
        "nll_sum": nll.flatten(1).sum(1).tolist(),
        "pixels": float(nll[0].numel()),
        "pr_noise": pixel_ratio(p["id"].variance, p["noise"].variance).tolist(),
        "pr_black": pixel_ratio(p["id"].variance, p["black"].variance).tolist(),
        "br_noise": box_ratio(p["noise"].variance, data.noise_box).tolist(),
        "br_black": box_ratio(p["black"].variance, data.black_box).tolist(),
        "ent_id": per_image_entropy(p["id"].entropy).tolist(),
        "ent_he": per_image_entropy(p["he"].entropy).tolist(),
        "var_id": p["id"].variance.flatten(1).mean(1).tolist(),
        "var_he": p["he"].variance.flatten(1).mean(1).tolist(),
    }


def _shift_score(la, val_x: Tensor, n: int, seed: int) -> float:
    """Mean AUROC of the per-image entropy, clean against shifted validation patches."""
    gen = torch.Generator().manual_seed(seed)
    ent = per_image_entropy(predict(la, val_x, n, generator=gen).entropy)
    scores = []
    for kind, (strengths, _) in SHIFTS.items():
        xs = shift(val_x, kind, strengths[len(strengths) // 2])
        gen = torch.Generator().manual_seed(seed)
        scores.append(auroc(ent, per_image_entropy(predict(la, xs, n, generator=gen).entropy)))
    return sum(scores) / len(scores)


def _name(seed: int, quick: bool, ssn_loss: str) -> str:
    loss = "" if ssn_loss == "logsumexp" else f"-{ssn_loss}"
    return f"lsn-prior-s{seed}{loss}{'-quick' if quick else ''}.json"


def unit(seed: int, quick: bool, ssn_loss: str = "logsumexp") -> dict:
    """Train the demo's SSN with ``seed``, fit the LSN, and measure every prior choice."""
    cfg = config(quick, ssn_loss)
    cfg.seed = seed
    torch.manual_seed(seed)
    data = demo.load_data(cfg, torch.device("cpu"))
    t0 = time.perf_counter()
    ssn = train_demo_ssn(cfg, data, seed, ssn_loss)
    train = loader(data.train_x, data.train_y, cfg.batch_size)
    val = loader(data.val_x, data.val_y, cfg.batch_size)
    la = fit_lsn(ssn, train, estimator=cfg.estimator, mc_samples=cfg.mc_samples, seed=seed)
    seconds = {"train + fit": time.perf_counter() - t0}
    grid = _grid(quick)
    n_eval, n_ref = _samples(quick, N_EVAL), _samples(quick, N_REF)

    t0 = time.perf_counter()
    nll: dict[str, list[float]] = {}
    for n, repeats in BIAS_SAMPLES.items():
        for r in range(repeats):
            search = gridsearch_prior_precision(
                la, val, grid=list(grid), n_samples=_samples(quick, n), seed=seed * 100 + r
            )
            nll[f"{n}/{r}"] = [float(s) for s in search.scores]
    ref = gridsearch_prior_precision(la, val, grid=list(grid), n_samples=n_ref, seed=seed)
    nll["ref"] = [float(s) for s in ref.scores]
    seconds["NLL grids"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    shift = []
    for value in grid:
        la.prior_precision = value
        shift.append(_shift_score(la, data.val_x, _samples(quick, N_SHIFT), seed))
    seconds["shift selection"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    chosen = {
        DEFAULT: marglik_prior(la, "scalar"),
        "marglik (layer-wise)": marglik_prior(la, "layerwise"),
        "NLL grid, 2 samples": grid[min(range(len(grid)), key=lambda i: nll["2/0"][i])],
        "NLL grid, 8 samples": grid[min(range(len(grid)), key=lambda i: nll["8/0"][i])],
        "NLL grid, 64 samples": grid[min(range(len(grid)), key=lambda i: nll["64/0"][i])],
        "shift selection": grid[max(range(len(grid)), key=lambda i: shift[i])],
    }
    values: dict[str, dict] = {}
    done: dict[tuple[float, ...], dict] = {}  # rules that pick the same prior share its maps
    for name, prior in chosen.items():
        key = tuple(torch.as_tensor(prior).flatten().tolist())
        if key not in done:
            la.prior_precision = prior
            done[key] = _per_image(la, data, n_eval, seed)
        values[name] = done[key]
    for value in _curve(quick):
        la.prior_precision = value
        values[f"grid {value:g}"] = _per_image(la, data, _samples(quick, N_CURVE), seed)
    seconds["measures"] = time.perf_counter() - t0
    return {
        "seed": seed,
        "grid": list(grid),
        "curve": list(_curve(quick)),
        "nll": nll,
        "shift": shift,
        "chosen": {k: torch.as_tensor(v).flatten().tolist() for k, v in chosen.items()},
        "values": values,
        "seconds": seconds,
    }


def _run_unit(args: tuple) -> tuple[int, float]:
    root, seed, quick, ssn_loss = args
    torch.set_num_threads(1)
    path = root / _name(seed, quick, ssn_loss)
    t0 = time.perf_counter()
    cached_json(path, lambda: unit(seed, quick, ssn_loss))
    return seed, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# Measures from the per-image values


def _sel(v: list[float], idx: Tensor | None) -> Tensor:
    t = torch.tensor(v, dtype=torch.float64)
    return t if idx is None else t[idx]


def measure(v: dict, name: str, idx: Tensor | None = None, idx_he: Tensor | None = None) -> float:
    """One measure from one prior's per-image values (``idx``: resampled test images,
    ``idx_he``: resampled H&E patches)."""
    if name == "IoU":
        inter, union = _sel(v["inter"], idx), _sel(v["union"], idx)
        return float(inter.sum() / union.sum()) if union.sum() > 0 else 1.0
    if name == "NLL":
        s = _sel(v["nll_sum"], idx)
        return float(s.sum() / (len(s) * v["pixels"]))
    key = {
        "Pixel Ratio (noise)": "pr_noise",
        "Pixel Ratio (black)": "pr_black",
        "Box Ratio (noise)": "br_noise",
        "Box Ratio (black)": "br_black",
    }
    if name in key:
        return float(_sel(v[key[name]], idx).mean())
    kind = "ent" if name.startswith("Entropy") else "var"
    return auroc(_sel(v[f"{kind}_id"], idx), _sel(v[f"{kind}_he"], idx_he))


def bootstrap(results: list[dict], rule: str, name: str, n_boot: int) -> tuple[float, float]:
    """95 % percentile interval of the seed mean over resampled test images and H&E patches."""
    first = results[0]["values"][rule]
    n, n_he = len(first["inter"]), len(first["ent_he"])
    gen = torch.Generator().manual_seed(0)
    vals = []
    for _ in range(n_boot):
        idx = torch.randint(0, n, (n,), generator=gen)
        idx_he = torch.randint(0, n_he, (n_he,), generator=gen)
        vals.append(sum(measure(r["values"][rule], name, idx, idx_he) for r in results))
    v = torch.tensor(vals, dtype=torch.float64) / len(results)
    return float(v.quantile(0.025)), float(v.quantile(0.975))


# ----------------------------------------------------------------------------------------------
# Report


def _decision(results: list[dict]) -> tuple[str, list[str]]:
    """Apply the pre-stated rule; returns the chosen default and the lines that justify it."""
    lines, winners = [], []
    for rule in RULES[1:]:
        d_auc = [
            measure(r["values"][rule], "Entropy AUROC (H&E)")
            - measure(r["values"][DEFAULT], "Entropy AUROC (H&E)")
            for r in results
        ]
        d_iou = [
            measure(r["values"][rule], "IoU") - measure(r["values"][DEFAULT], "IoU")
            for r in results
        ]
        auc, iou_ = mean_ci(d_auc), mean_ci(d_iou)
        better = auc.mean - auc.half > 0 and iou_.mean + iou_.half >= 0
        lines.append(
            f"- {rule}: Δ H&E entropy AUROC {auc.fmt(sign=True)}, Δ IoU {iou_.fmt(sign=True)}"
            f" → {'better' if better else 'not better'}"
        )
        if better:
            winners.append((auc.mean, rule))
    return (max(winners)[1] if winners else DEFAULT), lines


def write_report(
    root: Path, seeds: list[int], out: Path, quick: bool, ssn_loss: str = "logsumexp"
) -> Path:
    results = []
    for s in seeds:
        path = root / _name(s, quick, ssn_loss)
        if path.exists():
            results.append(json.loads(path.read_text()))
    grid = results[0]["grid"]
    n_boot = 100 if quick else 1000
    have = [r["seed"] for r in results]
    rows = []
    for rule in RULES:
        priors = [r["chosen"][rule] for r in results]
        scalar = [p[0] for p in priors if len(p) == 1]
        if scalar:
            edge = sum(p in (grid[0], grid[-1]) for p in scalar)
            prior_cell = (
                f"{geo(scalar):.3g} ({min(scalar):.3g}–{max(scalar):.3g}; {edge} at an edge)"
            )
        else:
            flat = [x for p in priors for x in p]
            prior_cell = f"layer-wise, {min(flat):.3g}–{max(flat):.3g}"
        cells = [rule, prior_cell]
        for m in MEASURES:
            vals = [measure(r["values"][rule], m) for r in results]
            lo, hi = bootstrap(results, rule, m, n_boot)
            cells.append(f"{fmt(vals)} [{lo:.3f}, {hi:.3f}]")
        rows.append(cells)
    paired = []
    for rule in RULES[1:]:
        cells = [rule]
        for m in MEASURES:
            d = [measure(r["values"][rule], m) - measure(r["values"][DEFAULT], m) for r in results]
            cells.append(f"{fmt(d)} ({sum(x > 0 for x in d)}/{len(d)} above)")
        paired.append(cells)
    curve = []
    wants = []
    coarse = results[0]["curve"]
    for m in MEASURES:
        means = [mean([measure(r["values"][f"grid {g:g}"], m) for r in results]) for g in coarse]
        best = min if m in LOWER_IS_BETTER else max
        k = best(range(len(coarse)), key=lambda i: means[i])
        wants.append(f"{m}: {coarse[k]:g}")
        curve.append([m, *(f"{x:.3f}" for x in means)])
    bias_rows = []
    for n, repeats in BIAS_SAMPLES.items():
        cells = [f"{n} samples"]
        for i in range(len(grid)):
            d = [
                r["nll"][f"{n}/{k}"][i] - r["nll"]["ref"][i]
                for r in results
                for k in range(repeats)
                if math.isfinite(r["nll"][f"{n}/{k}"][i])
            ]
            cells.append(f"{mean(d):+.4f}" if d else "inf")
        picks = [grid[min(range(len(grid)), key=lambda i: r["nll"][f"{n}/0"][i])] for r in results]
        cells.append(f"{geo(picks):.3g}")
        bias_rows.append(cells)
    ref_picks = [grid[min(range(len(grid)), key=lambda i: r["nll"]["ref"][i])] for r in results]
    bias_rows.append([f"{N_REF} (reference)", *(["0"] * len(grid)), f"{geo(ref_picks):.3g}"])
    shift_curve = [mean([r["shift"][i] for r in results]) for i in range(len(grid))]
    chosen_default, decision_lines = _decision(results)
    cost = {k: mean([r["seconds"][k] for r in results]) for k in results[0]["seconds"]}
    cfg = config(quick, ssn_loss)
    quick_note = " (quick run: tiny sizes, numbers meaningless)" if quick else ""
    text = "\n".join(
        [
            "# The LSN's prior precision on the demo's setting (issue 26, item 4)",
            "",
            f"Generated by `integration/experiments/lsn_prior.py`{quick_note}; seeds "
            f"{', '.join(map(str, have))} ({len(have)}). {machine()}",
            "",
            f"Setting: `lsn-ext demo`'s LSN: SSN rank {cfg.rank}, loss {LOSS_NAMES[ssn_loss]} "
            "with M = 20, U-Net "
            f"widths {'-'.join(map(str, cfg.widths))}, {cfg.epochs} epochs of the 165 nuclei "
            "training patches (batch 32, Adam 3·10⁻³), Monte-Carlo GGN diagonal; test: the 15 "
            "test-band patches (a noise and a black box each, redrawn per seed) and the 28 H&E "
            f"patches as far OOD; {_samples(quick, N_EVAL)} posterior samples per map (the "
            "mean network's predictive, as the demo's LSN row). The nuclei black box is not "
            "out of distribution (black is the fluorescence background).",
            "",
            "**Decision rule, fixed before the run:** keep the marginal likelihood (scalar) as "
            "the demo's default unless another rule raises the H&E entropy AUROC with a paired "
            "95 % t-interval above 0 and a paired IoU interval that reaches 0 or above.",
            "",
            "## Each rule's prior and what it gives",
            "",
            table(["rule", "prior (geometric mean, range)", *MEASURES], rows),
            "",
            "Mean ± 95 % t-interval over seeds; [..]: 95 % bootstrap interval of the seed mean "
            "over the test images and H&E patches. Per-seed values: `lsn_prior_per_seed.csv`.",
            "",
            f"## Paired per seed against the default ({DEFAULT})",
            "",
            table(["rule", *MEASURES], paired),
            "",
            "## The decision",
            "",
            *decision_lines,
            "",
            f"Default after this run: **{chosen_default}**.",
            "",
            f"## Every measure on a coarse grid (mean over seeds, {N_CURVE} samples)",
            "",
            table(["measure", *(f"{g:g}" for g in coarse)], curve),
            "",
            "The prior each measure wants (best mean on the grid): " + "; ".join(wants) + ".",
            "Shift-selection score (validation AUROC) on the grid: "
            + ", ".join(f"{x:.3f}" for x in shift_curve)
            + ".",
            "",
            f"## The grid NLL's bias: NLL from n samples minus NLL from {N_REF}",
            "",
            table(["samples", *(f"{g:g}" for g in grid), "chosen (geo. mean)"], bias_rows),
            "",
            "Per-pixel validation NLL differences, mean over seeds and sample seeds. A positive "
            "bias that grows toward small priors (wide posteriors) pushes the choice toward "
            "large priors.",
            "",
            "Cost per seed (one thread, mean seconds): "
            + ", ".join(f"{k} {v:.0f}" for k, v in cost.items())
            + ".",
            "",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    stem = "lsn_prior" if ssn_loss == "logsumexp" else f"lsn_prior_{ssn_loss}"
    path = out / f"{stem}.md"
    path.write_text(text)
    with open(out / f"{stem}_per_seed.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seed", "rule", "prior", "measure", "value"])
        for r in results:
            for rule in (*RULES, *(f"grid {g:g}" for g in coarse)):
                prior = r["chosen"].get(
                    rule, [float(rule.split()[1])] if rule.startswith("grid") else []
                )
                for m in MEASURES:
                    w.writerow(
                        [r["seed"], rule, ";".join(f"{p:.6g}" for p in prior), m,
                         measure(r["values"][rule], m)]
                    )  # fmt: skip
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default=None, help="e.g. 0-9 (default 0-9; quick 0,1)")
    parser.add_argument(
        "--ssn-loss", choices=("logsumexp", "expected"), default="logsumexp", help="SSN loss"
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--cache", type=Path, default=None, help="default results/.cache/prior")
    parser.add_argument("--out", type=Path, default=None, help="default integration/results")
    parser.add_argument("--quick", action="store_true", help="tiny sizes into a temporary dir")
    parser.add_argument("--report-only", action="store_true", help="only write the report")
    args = parser.parse_args(argv)
    seeds = parse_seeds(args.seeds or ("0,1" if args.quick else "0-9"))
    tmp = Path(tempfile.mkdtemp(prefix="lsn-prior-")) if args.quick else None
    out = args.out or (tmp if tmp else RESULTS)
    root = args.cache or ((tmp / "cache") if tmp else RESULTS / ".cache" / "prior")
    root.mkdir(parents=True, exist_ok=True)
    work = [] if args.report_only else [(root, s, args.quick, args.ssn_loss) for s in seeds]
    run_units("lsn_prior", _run_unit, work, args.workers)
    path = write_report(root, seeds, out, args.quick, args.ssn_loss)
    print(path.read_text())
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
