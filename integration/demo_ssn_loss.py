"""The demo's SSN loss over 10 seeds: LSN Eq. 11 against the per-pixel expected BCE (issue 26).

``integration/ssn_objective.py`` asks which SSN objective reproduces the paper's Fig. 5 on the
synthetic lesions; this script asks the same of the demo's own setting (``lsn-ext demo``: the
nuclei patches, U-Net widths 8-16-32, rank 10, 20 logit samples, 12 epochs), so that the demo's
default rests on its own data. Per seed and loss, on the 15 test-band patches (32 logit samples):
IoU of ``E σ(η) > ½`` (collapsed: below 0.05), the aleatoric boundary ratio (share of
``Var σ(η)`` within 2 px of the mask boundary ÷ the band's pixel share; above 1: the map marks
boundaries, Fig. 5), the mean aleatoric variance inside / in the band / outside, the learnt
logit spread, and the AUROC of the SSN's per-image predictive entropy for the far-OOD H&E
patches. Mean ± 95 % t-interval over seeds and paired per-seed differences.

Run: ``./dev bench demo_ssn_loss [--seeds 0-9] [--workers 2] [--quick]``; writes
``integration/results/demo_ssn_loss.md`` and ``demo_ssn_loss_per_seed.csv``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lsn_paper as lp
from _common import machine, run_units

from lsn_ext import demo
from lsn_ext.lsn import aleatoric_maps
from lsn_ext.metrics import auroc, boundary_band, iou, per_image_entropy
from lsn_ext.models import SSN

RESULTS = lp.RESULTS
LOSSES = ("logsumexp", "expected")
NAMES = {"logsumexp": "Eq. 11", "expected": "expected BCE"}
N_LOGIT = 32
MEASURES = ("IoU", "boundary ratio", "H&E entropy AUROC", "logit sd", "abs mu")


def unit(seed: int, loss: str, quick: bool) -> dict:
    """Train the demo's SSN with ``loss`` and ``seed`` and measure it."""
    cfg = demo.DemoConfig(progress=False, threads=None, quick=quick, seed=seed, ssn_loss=loss)
    if quick:
        cfg.epochs, cfg.widths, cfg.rank = 1, (4, 8), 2
    torch.manual_seed(seed)
    data = demo.load_data(cfg, torch.device("cpu"))
    t0 = time.perf_counter()
    ssn = SSN.with_unet(1, widths=cfg.widths, rank=cfg.rank).float()
    objective = functools.partial(demo.ssn_objective, objective=loss)
    ssn = demo.train("SSN", ssn, objective, data.train_x, data.train_y, cfg, seed)
    seconds = time.perf_counter() - t0
    n = min(N_LOGIT, 4) if quick else N_LOGIT
    with torch.no_grad():
        mean, var = aleatoric_maps(ssn, data.test_x, n, generator=torch.Generator().manual_seed(0))
        out = ssn.distribution(data.test_x)
        he_mean, _ = aleatoric_maps(
            ssn, data.far_ood, n, generator=torch.Generator().manual_seed(0)
        )
    truth = data.test_y > 0.5
    band = boundary_band(truth.double(), 2)
    v = var.double()
    regions = {
        "inside": float((v * (truth & ~band)).sum() / (truth & ~band).sum().clamp_min(1)),
        "band": float((v * band).sum() / band.sum().clamp_min(1)),
        "outside": float((v * (~truth & ~band)).sum() / (~truth & ~band).sum().clamp_min(1)),
    }
    share = float((v * band).sum() / v.sum())
    entropy = lambda p: per_image_entropy(lp._entropy_binary(p))  # noqa: E731
    sd = (out.cov_diag.flatten(1) + out.cov_factor.pow(2).sum(-1)).sqrt()
    return {
        "IoU": iou(mean > 0.5, truth),
        "boundary ratio": share / float(band.double().mean()),
        "regions": regions,
        "H&E entropy AUROC": auroc(entropy(mean), entropy(he_mean)),
        "logit sd": float(sd.median()),
        "abs mu": float(out.mean.abs().median()),
        "train seconds": seconds,
    }


def _path(root: Path, seed: int, loss: str, quick: bool) -> Path:
    return root / f"demo-ssn-{loss}-s{seed}{'-quick' if quick else ''}.json"


def _run_unit(args: tuple) -> tuple[tuple, float]:
    root, seed, loss, quick = args
    torch.set_num_threads(1)
    path = _path(root, seed, loss, quick)
    t0 = time.perf_counter()
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(unit(seed, loss, quick)))
        tmp.replace(path)
    return (loss, seed), time.perf_counter() - t0


def write_report(root: Path, seeds: list[int], out: Path, quick: bool) -> Path:
    res = {
        loss: {
            s: json.loads(p.read_text())
            for s in seeds
            if (p := _path(root, s, loss, quick)).exists()
        }
        for loss in LOSSES
    }
    rows = []
    for loss in LOSSES:
        rs = list(res[loss].values())
        if not rs:
            continue
        cells = [NAMES[loss], str(len(rs)), f"{sum(r['IoU'] < 0.05 for r in rs)}/{len(rs)}"]
        cells += [lp.fmt([r[m] for r in rs], 2 if m != "IoU" else 3) for m in MEASURES]
        cells.append(
            " / ".join(
                f"{lp._mean([r['regions'][k] for r in rs]):.3g}"
                for k in ("inside", "band", "outside")
            )
        )
        rows.append(cells)
    both = sorted(set(res["logsumexp"]) & set(res["expected"]))
    paired = []
    for m in MEASURES[:3]:
        d = [res["expected"][s][m] - res["logsumexp"][s][m] for s in both]
        if d:
            paired.append([m, lp.fmt(d), f"{sum(x > 0 for x in d)}/{len(d)}"])
    header = ["loss", "seeds", "collapsed", *MEASURES, "aleatoric var inside / band / outside"]
    quick_note = " (quick run: tiny sizes, numbers meaningless)" if quick else ""
    text = "\n".join(
        [
            "# The demo's SSN loss: Eq. 11 against the per-pixel expected BCE",
            "",
            f"Generated by `integration/demo_ssn_loss.py`{quick_note}; seeds "
            f"{', '.join(map(str, seeds))}. {machine()}",
            "",
            "The demo's setting: nuclei patches (165 training, 15 test-band patches, 28 H&E "
            "patches as far OOD), SSN rank 10 on a U-Net of widths 8-16-32, 20 logit samples "
            f"in the loss, 12 epochs of batch 32 (Adam 3·10⁻³, flips); {N_LOGIT} logit samples "
            "per map.",
            "",
            lp._table(header, rows),
            "",
            "Mean ± 95 % t-interval over seeds. Boundary ratio: share of the aleatoric "
            "variance within 2 px of the mask boundary ÷ the band's share of the pixels. "
            "Logit sd and abs mu (the mean logit's size): medians over the test pixels.",
            "",
            "## Paired per seed: expected BCE − Eq. 11",
            "",
            lp._table(["measure", "difference", "seeds above 0"], paired) if paired else "",
            "",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "demo_ssn_loss.md"
    path.write_text(text)
    with open(out / "demo_ssn_loss_per_seed.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["loss", "seed", "measure", "value"])
        for loss in LOSSES:
            for s, r in sorted(res[loss].items()):
                w.writerows([loss, s, m, r[m]] for m in MEASURES)
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default=None, help="e.g. 0-9 (default 0-9; quick 0,1)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--cache", type=Path, default=None, help="default results/.cache/demo")
    parser.add_argument("--out", type=Path, default=None, help="default integration/results")
    parser.add_argument("--quick", action="store_true", help="tiny sizes into a temporary dir")
    args = parser.parse_args(argv)
    seeds = lp._seeds(args.seeds or ("0,1" if args.quick else "0-9"))
    tmp = Path(tempfile.mkdtemp(prefix="demo-ssn-")) if args.quick else None
    out = args.out or (tmp if tmp else RESULTS)
    root = args.cache or ((tmp / "cache") if tmp else RESULTS / ".cache" / "demo")
    root.mkdir(parents=True, exist_ok=True)
    work = [(root, s, loss, args.quick) for s in seeds for loss in LOSSES]
    run_units("demo_ssn_loss", _run_unit, work, args.workers)
    path = write_report(root, seeds, out, args.quick)
    print(path.read_text())
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
