"""Downstream effect of the GGN-diagonal estimator on the LSN experiment (nuclei data).

Run from the repository root::

    ./dev bench lsn_estimators                      # ~12 minutes on 2 cores
    ./dev bench lsn_estimators --seeds 0 --quick    # a smoke run, into a temporary folder

or ``.venv/bin/python -m integration.experiments.lsn_estimators [...]``.

Per seed, the demo's SSN (LSN) and plain U-Net (U-Net + LA) are trained once
(:func:`lsn_ext.demo.train`, the demo's settings); then for each estimator the Laplace posterior is
fitted with that estimator (:func:`lsn_ext.lsn.fit_lsn`, :class:`lsn_ext.DiagBackprop`), its prior
precision tuned either by validation NLL on the same grid as the demo
(:func:`lsn_ext.demo.tune_prior`) or by laplace-torch's log marginal likelihood on the grid
``10⁻²…10⁷`` (which, unlike the validation NLL, depends on the curvature's magnitude), and the
demo's measures taken on the test band (:func:`lsn_ext.demo.measure`): IoU, Pixel Ratio
and Box Ratio for the noise and black boxes, and the entropy AUROC against H&E patches. The
estimators share the trained networks, the boxes and the posterior samples' seeds, so the
differences come from the curvature alone. ``tr H / tr H_DB`` is the total curvature relative to
diagonal backprop's; "share of H > prior" the fraction of parameters whose curvature exceeds the
tuned prior precision (where it does not, the posterior variance is close to ``1 / prior``
whatever the estimator).

Prints a table of mean ± standard deviation over seeds and writes it to
``integration/results/lsn_estimators.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from integration import harness
from integration.experiments.kit import demo_config
from integration.harness import machine
from lsn_ext import predict
from lsn_ext.demo import (
    COLUMNS,
    DemoConfig,
    bce_objective,
    laplace_unet,
    load_data,
    measure,
    ssn_objective,
    train,
    tune_prior,
)
from lsn_ext.lsn import fit_lsn
from lsn_ext.models import SSN, UNet

RESULTS = harness.RESULTS / "lsn_estimators.md"
ESTIMATORS = {
    "db": ("db", 1),
    "db_calibrated (k=1)": ("db_calibrated", 1),
    "mc (k=1)": ("mc", 1),
    "mc (k=8)": ("mc", 8),
}
EXTRA = ("prior precision", "share of H > prior", "tr H / tr H_DB", "fit (s)")
FORMATS = {"fit (s)": ".2f", "tr H / tr H_DB": ".2f", "share of H > prior": ".4f"}


def tune_marglik(la: Laplace) -> float:
    """The prior precision on ``10⁻²…10⁷`` with the largest log marginal likelihood; set it."""
    grid = [10.0**k for k in range(-2, 8)]
    best = max(grid, key=lambda p: la.log_marginal_likelihood(torch.tensor(p)).item())
    la.prior_precision = best
    return best


TUNING = {"val. NLL": tune_prior, "marglik": lambda la, val, cfg: tune_marglik(la)}


def run_seed(seed: int, cfg: DemoConfig) -> dict[tuple[str, str, str], dict[str, float]]:
    """Every estimator and tuning for both models on one seed.

    Returns:
        ``{(model, estimator, tuning): {column: value}}``.
    """
    cfg.seed = seed
    torch.manual_seed(seed)
    data = load_data(cfg, torch.device("cpu"))
    ssn = SSN.with_unet(1, widths=cfg.widths, rank=cfg.rank)
    ssn = train("SSN", ssn, ssn_objective, data.train_x, data.train_y, cfg, seed)
    unet = train(
        "U-Net",
        UNet(1, 1, widths=cfg.widths),
        bce_objective,
        data.train_x,
        data.train_y,
        cfg,
        seed + 1,
    )
    train_loader = DataLoader(TensorDataset(data.train_x, data.train_y), cfg.batch_size)
    val_loader = DataLoader(TensorDataset(data.val_x, data.val_y), cfg.batch_size)
    rows: dict[tuple[str, str, str], dict[str, float]] = {}
    db_trace: dict[str, float] = {}
    for name, (estimator, k) in ESTIMATORS.items():
        fits = {
            "LSN": lambda e=estimator, k=k: fit_lsn(
                ssn, train_loader, estimator=e, mc_samples=k, seed=seed
            ),
            "U-Net + LA": lambda e=estimator, k=k: laplace_unet(
                unet, train_loader, replace(cfg, estimator=e, mc_samples=k)
            ),
        }
        for model, fit in fits.items():
            t0 = time.perf_counter()
            la = fit()
            t_fit = time.perf_counter() - t0
            trace = la.H.sum().item()
            db_trace.setdefault(model, trace)
            for tuning, tune in TUNING.items():
                prior = tune(la, val_loader, cfg)
                torch.manual_seed(seed + 7)
                results, _ = measure(
                    lambda x, la=la: predict(
                        la, x, cfg.n_epistemic, generator=torch.Generator().manual_seed(seed)
                    ),
                    data,
                )
                rows[model, name, tuning] = results | {
                    "prior precision": prior,
                    "share of H > prior": la.H.gt(prior).double().mean().item(),
                    "tr H / tr H_DB": trace / db_trace[model],
                    "fit (s)": t_fit,
                }
                print(
                    f"  seed {seed} {model:10s} {name:20s} {tuning:8s} prior {prior:g}  "
                    + "  ".join(f"{c} {results[c]:.3f}" for c in COLUMNS[1:])
                )
    return rows


def _cell(values: list[float], column: str) -> str:
    t = torch.tensor(values, dtype=torch.float64)
    if column == "prior precision":
        return "/".join(f"{v:g}" for v in values)
    fmt = FORMATS.get(column, ".3f")
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{t.mean():{fmt}} ± {t.std():{fmt}}"


def table(all_rows: list[dict[tuple[str, str, str], dict[str, float]]]) -> str:
    """Markdown table, mean ± std over seeds (prior precisions listed per seed)."""
    columns = (*COLUMNS[1:], *EXTRA)
    lines = [
        "| Model | Estimator | Prior tuned by | " + " | ".join(columns) + " |",
        "|---|---|---" + "|---:" * len(columns) + "|",
    ]
    for key in sorted(all_rows[0], key=lambda k: (k[2] != "val. NLL", k[0] != "LSN")):
        cells = [_cell([rows[key][c] for rows in all_rows], c) for c in columns]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny data)")
    parser.add_argument("--out", type=Path, default=None, help="default: the committed report")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = demo_config(args.quick, epochs=args.epochs, prior="nll")
    print(machine())
    start = time.perf_counter()
    all_rows = [run_seed(seed, cfg) for seed in args.seeds]
    text = (
        f"{machine()}\n\nLSN experiment per GGN-diagonal estimator: seeds {args.seeds}, "
        f"{cfg.epochs} epochs, U-Net widths {'-'.join(map(str, cfg.widths))}, "
        f"{cfg.n_epistemic} posterior samples; mean ± std over seeds (prior precision per "
        f"seed).\n\n{table(all_rows)}\n\nTotal time {time.perf_counter() - start:.0f} s.\n"
    )
    print("\n" + text)
    quick_out = Path(tempfile.mkdtemp(prefix="lsn-estimators-")) / RESULTS.name
    out = args.out or (quick_out if args.quick else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
