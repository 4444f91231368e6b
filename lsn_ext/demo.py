"""``lsn-ext demo``: Laplacian Segmentation Networks and baselines on real nuclei images.

Trains a small LSN (an SSN whose mean network gets a diagonal Laplace posterior by diagonal
backpropagation) and the baselines of the LSN paper's Table 2 — U-Net + Laplace, U-Net + MC
dropout, SSN + MC dropout and a U-Net ensemble — on 64×64 patches of the fluorescence nuclei
image shipped with the package, then measures on the held-out test band:

- IoU of the predictive mean (threshold ½), pooled over the test patches;
- Pixel Ratio and Box Ratio (LSN Eq. 16–17) of the epistemic variance maps for a white-noise box
  and a black box (LSN §4.4, boxes scaled to the patch size);
- AUROC of the per-image mean predictive entropy for telling the H&E image's patches (far OOD)
  from the test patches.

Writes ``figure.png`` (maps), ``table.md`` and ``table.csv`` to the output directory.
"""

from __future__ import annotations

import csv
import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from lsn_ext._laplace import Laplace
from lsn_ext.data import histology_patches, nuclei_patches, random_flips
from lsn_ext.estimators import Estimator
from lsn_ext.laplace_ext import (
    DiagBackprop,
    SegmentationPrediction,
    gridsearch_prior_precision,
    predict,
)
from lsn_ext.lsn import (
    ensemble_predict,
    fit_lsn,
    mc_dropout_predict,
    predict_lsn,
)
from lsn_ext.metrics import (
    auroc,
    black_box,
    box_ratio,
    iou,
    noise_box,
    per_image_entropy,
    pixel_ratio,
)
from lsn_ext.models import SSN, UNet, ssn_loss
from lsn_ext.rules.losses import BCEWithLogits

__all__ = [
    "DemoConfig",
    "DemoData",
    "bce_objective",
    "laplace_unet",
    "load_data",
    "measure",
    "run_demo",
    "ssn_objective",
    "train",
    "tune_prior",
]

_PRIOR_NAMES = {"marglik": "marginal likelihood", "nll": "validation NLL grid search"}
MODELS = ("LSN", "U-Net + LA", "SSN + Dropout", "U-Net + Dropout", "Ensemble")
COLUMNS = (
    "Model",
    "IoU",
    "Pixel Ratio (noise)",
    "Pixel Ratio (black)",
    "Box Ratio (noise)",
    "Box Ratio (black)",
    "Entropy AUROC (H&E)",
)


@dataclass
class DemoConfig:
    """Settings of the demonstration (the command line's options).

    Attributes:
        out: Output directory.
        epochs: Training epochs per model (165 patches with random flips per epoch).
        seed: Seed of data order, initialisation, boxes and samples.
        quick: A tiny run for tests: few patches, one epoch, few samples, the figure at 50
            dots per inch (110 otherwise).
        widths: U-Net feature maps per level (the paper: 8-16-32-64-128).
        rank: Rank of the SSN covariance factor (the paper: 10). ``0`` gives the paper's
            "(diag)" variants, whose aleatoric map marks the objects (``lsn_paper.md``, Fig. 5).
        n_epistemic: Posterior / dropout samples (the paper: 50).
        n_aleatoric: Logit samples (the paper: 20).
        ensemble: Ensemble members (0: no ensemble; the first is the U-Net of U-Net + LA).
        dropout: Dropout probability of the MC-dropout models.
        lr: Adam learning rate.
        batch_size: Training batch size.
        progress: Show progress bars.
        threads: CPU threads for torch during the demo (restored afterwards). One thread was
            8× faster than two for these small convolutions on the project's shared 2-core
            machine; ``None`` keeps torch's setting.
        estimator: GGN-diagonal estimator of the Laplace posteriors (LSN and U-Net + LA):
            ``"db"``, ``"db_calibrated"`` or ``"mc"`` (:func:`lsn_ext.ggn_diagonal`).
        mc_samples: Monte-Carlo vectors per image for ``"db_calibrated"`` and ``"mc"``.
        prior: How :func:`tune_prior` sets the prior precision: ``"marglik"`` (laplace-torch's
            marginal likelihood, one scalar) or ``"nll"`` (validation NLL grid search).
        ssn_loss: The SSNs' training loss (:func:`lsn_ext.models.ssn_loss`'s ``objective``, 20
            logit samples): ``"expected"`` (default: the per-pixel expected BCE under the logit
            distribution, whose aleatoric map marks the objects and their boundaries,
            ``integration/results/demo_ssn_loss.md`` and ``ssn_objective.md``) or
            ``"logsumexp"`` (LSN Eq. 11, whose map is flat at this budget).
    """

    out: Path = Path("lsn-ext-output")
    epochs: int = 12
    seed: int = 0
    quick: bool = False
    widths: tuple[int, ...] = (8, 16, 32)
    rank: int = 10
    n_epistemic: int = 50
    n_aleatoric: int = 20
    ensemble: int = 3
    dropout: float = 0.1
    lr: float = 3e-3
    batch_size: int = 32
    progress: bool = True
    threads: int | None = 1
    estimator: Estimator = "mc"
    mc_samples: int = 1
    prior: Literal["marglik", "nll"] = "marglik"
    ssn_loss: Literal["logsumexp", "expected"] = "expected"

    def __post_init__(self) -> None:
        if self.prior not in _PRIOR_NAMES:
            raise ValueError(f"prior must be one of {sorted(_PRIOR_NAMES)}, got {self.prior!r}")
        if self.ssn_loss not in ("logsumexp", "expected"):
            raise ValueError(f"ssn_loss must be 'logsumexp' or 'expected', got {self.ssn_loss!r}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0 (0: diagonal logit covariance), got {self.rank}")
        if self.estimator == "db" and self.prior == "marglik":
            warnings.warn(
                "estimator='db' underestimates the curvature's size, and the marginal likelihood "
                "then picks far too small a prior precision (README, 'How accurate it is'); use "
                "prior='nll' (--prior nll) with DB",
                UserWarning,
                stacklevel=3,
            )


def bce_objective(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean binary cross-entropy of a U-Net's logits (the baselines' training loss)."""
    return F.binary_cross_entropy_with_logits(net(x), y)


def ssn_objective(
    net: SSN, x: Tensor, y: Tensor, objective: str = "logsumexp", n_samples: int = 20
) -> Tensor:
    """The SSN loss per image over its pixels (the BCE models' step size).

    ``objective``: ``"logsumexp"`` (LSN Eq. 11) or ``"expected"`` (per-pixel expected BCE);
    ``n_samples`` logit samples (the paper and the demo: 20), in antithetic pairs when even.
    """
    out = net.distribution(x)
    loss = ssn_loss(out, y, n_samples, antithetic=n_samples % 2 == 0, objective=objective)
    return loss / y[0].numel()


def train(
    name: str,
    net: nn.Module,
    objective: Callable[[nn.Module, Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    cfg: DemoConfig,
    seed: int,
) -> nn.Module:
    """Adam on ``objective`` for ``cfg.epochs`` epochs with random flips; returns ``net.eval()``."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    net.train()
    bar = tqdm(range(cfg.epochs), desc=f"train {name}", disable=not cfg.progress, leave=False)
    for _ in bar:
        for idx in torch.randperm(len(x), generator=gen).split(cfg.batch_size):
            xb, yb = random_flips(x[idx], y[idx], gen)
            loss = objective(net, xb, yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return net.eval()


def _loader(x: Tensor, y: Tensor, batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def laplace_unet(net: UNet, train: DataLoader, cfg: DemoConfig) -> Laplace:
    """U-Net + LA: a diagonal Laplace posterior of a binary U-Net with ``cfg``'s estimator."""
    la = Laplace(
        net,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=DiagBackprop,
        backend_kwargs={
            "loss": BCEWithLogits(),
            "estimator": cfg.estimator,
            "mc_samples": cfg.mc_samples,
            "seed": cfg.seed,
        },
    )
    la.fit(train)
    return la


def _estimator_name(cfg: DemoConfig) -> str:
    if cfg.estimator == "db":
        return "db (diagonal backprop)"
    return f"{cfg.estimator} ({cfg.mc_samples} Monte-Carlo vector(s) per image)"


def tune_prior(la: Laplace, val: DataLoader, cfg: DemoConfig) -> float:
    """Set the prior precision by ``cfg.prior``; returns it.

    - ``"marglik"`` (default): laplace-torch's log marginal likelihood, one scalar, 200 Adam
      steps of 0.1 on its logarithm from 1 (laplace-torch's start). The LSN paper's experiments
      (``integration/experiments/lsn_paper``) found it as good as the grid search in validation
      NLL, IoU and Box Ratio, with a stable Pixel Ratio, while the grid search put the LSN's prior
      at ``10⁵``, above the curvature of 99 % of the parameters.
      It needs a curvature of the right size: ``estimator="mc"`` or ``"db_calibrated"``
      (``"db"`` underestimates it and marglik then picks far too small priors).
    - ``"nll"``: grid search ``10⁻⁴…10⁸`` of the validation NLL
      (:func:`lsn_ext.gridsearch_prior_precision`); the grid is this wide because the LSN's
      optimum reached ``10⁵``–``10⁸``.

    Raises:
        ValueError: For another ``cfg.prior``.
    """
    if cfg.prior == "marglik":
        with warnings.catch_warnings():  # its link_approx note is for the grid search
            warnings.filterwarnings("ignore", "By default `link_approx`", UserWarning)
            la.optimize_prior_precision(
                method="marglik", prior_structure="scalar", n_steps=200, lr=0.1
            )
        return float(la.prior_precision)
    if cfg.prior == "nll":
        grid = [1.0, 100.0] if cfg.quick else [10.0**k for k in range(-4, 9)]
        result = gridsearch_prior_precision(la, val, grid=grid, n_samples=2 if cfg.quick else 8)
        return result.prior_precision
    raise ValueError(f"prior must be one of {sorted(_PRIOR_NAMES)}, got {cfg.prior!r}")


def _gen(x: Tensor, seed: int) -> torch.Generator:
    return torch.Generator(device=x.device).manual_seed(seed)


def _table_rows(results: dict[str, dict[str, float]]) -> list[list[str]]:
    return [
        [name, *(f"{results[name][c]:.3f}" for c in COLUMNS[1:])]
        for name in MODELS
        if name in results
    ]


def _write_tables(out: Path, results: dict[str, dict[str, float]], notes: list[str]) -> str:
    rows = _table_rows(results)
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    md = ["| " + " | ".join(COLUMNS) + " |", "|---" + "|---:" * (len(COLUMNS) - 1) + "|"]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(md) + "\n\n" + "\n".join(notes) + "\n"
    (out / "table.md").write_text(text)
    return text


def _figure(out: Path, panels: list[tuple[str, list[tuple[str, Tensor, str]]]], dpi: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rows, n_cols = len(panels), max(len(p) for _, p in panels)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(1.9 * n_cols, 2.0 * n_rows), squeeze=False)
    for r, (row_name, row) in enumerate(panels):
        for c in range(n_cols):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c >= len(row) or row[c][1] is None:
                ax.axis("off")
                continue
            title, img, cmap = row[c]
            vmin, vmax = (0, 1) if cmap == "gray01" else (None, None)
            ax.imshow(
                img.detach().cpu().float().numpy(),
                cmap="gray" if cmap.startswith("gray") else cmap,
                vmin=vmin,
                vmax=vmax,
            )
            if r == 0:
                ax.set_title(title, fontsize=8)
            if c == 0:
                ax.set_ylabel(row_name, fontsize=8)
    fig.suptitle(
        "prediction: E σ(μ) over the LSN posterior; aleatoric: Var σ(η) at θ_MAP; epistemic: "
        "Var of the probabilities over posterior / dropout samples (colour scale per panel)",
        fontsize=8,
    )
    fig.tight_layout()
    path = out / "figure.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


@dataclass
class DemoData:
    """The demo's data on one device: nuclei splits, corrupted test patches and far OOD.

    Attributes:
        train_x, train_y, val_x, val_y, test_x, test_y: Nuclei patches ``[P, 1, 64, 64]`` and
            masks (disjoint row bands, :func:`lsn_ext.data.nuclei_patches`).
        far_ood: H&E patches normalised like the nuclei, ``[P, 1, 64, 64]``.
        noise_x, noise_box: The test patches with a white-noise box, and the boxes' masks.
        black_x, black_box: The test patches with a black box, and the boxes' masks.
    """

    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor
    test_x: Tensor
    test_y: Tensor
    far_ood: Tensor
    noise_x: Tensor
    noise_box: Tensor
    black_x: Tensor
    black_box: Tensor


def load_data(cfg: DemoConfig, device: torch.device) -> DemoData:
    """The nuclei splits, boxes drawn with ``cfg.seed`` and the H&E patches (few if quick)."""
    splits = nuclei_patches(64, 32, dtype=torch.float32)
    far_ood = histology_patches(splits)
    x_tr, y_tr, x_val, y_val = splits.train_x, splits.train_y, splits.val_x, splits.val_y
    x_te, y_te = splits.test_x, splits.test_y
    if cfg.quick:
        x_tr, y_tr, x_val, y_val = x_tr[:8], y_tr[:8], x_val[:2], y_val[:2]
        x_te, y_te, far_ood = x_te[:2], y_te[:2], far_ood[:2]
    gen = torch.Generator().manual_seed(cfg.seed + 1000)
    x_noise, box_noise = noise_box(x_te, generator=gen)
    black = splits.normalise(torch.tensor(0.0)).item()
    x_black, box_black = black_box(x_te, black, generator=gen)
    tensors = (x_tr, y_tr, x_val, y_val, x_te, y_te, far_ood)
    tensors += (x_noise, box_noise, x_black, box_black)
    return DemoData(*(t.to(device) for t in tensors))


def measure(
    predictor: Callable[[Tensor], SegmentationPrediction], data: DemoData
) -> tuple[dict[str, float], dict[str, SegmentationPrediction]]:
    """The table's measures of one predictive, and its predictions on each input set.

    Returns:
        ``({column: value}, {"id" | "noise" | "black" | "he": prediction})``.
    """
    inputs = {"id": data.test_x, "noise": data.noise_x, "black": data.black_x, "he": data.far_ood}
    p = {k: predictor(v) for k, v in inputs.items()}
    results = {
        "IoU": iou(p["id"].mean > 0.5, data.test_y > 0.5),
        "Pixel Ratio (noise)": pixel_ratio(p["id"].variance, p["noise"].variance).mean().item(),
        "Pixel Ratio (black)": pixel_ratio(p["id"].variance, p["black"].variance).mean().item(),
        "Box Ratio (noise)": box_ratio(p["noise"].variance, data.noise_box).mean().item(),
        "Box Ratio (black)": box_ratio(p["black"].variance, data.black_box).mean().item(),
        "Entropy AUROC (H&E)": auroc(
            per_image_entropy(p["id"].entropy), per_image_entropy(p["he"].entropy)
        ),
    }
    return results, p


def run_demo(config: DemoConfig | None = None) -> int:
    """Train, fit the posteriors, evaluate, and write the figure and the tables.

    Returns:
        The process exit code (0).
    """
    cfg = config or DemoConfig()
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def quick_settings(cfg: DemoConfig) -> dict[str, Any]:
    """The settings a ``quick`` run replaces, and their values.

    One epoch, widths 4-8, rank and ensemble at most 2, 3 epistemic and 3 aleatoric samples.
    The command line refuses a flag given with ``--quick`` that these would change.
    """
    return {
        "epochs": min(cfg.epochs, 1),
        "widths": (4, 8),
        "rank": min(cfg.rank, 2),
        "n_epistemic": 3,
        "n_aleatoric": 3,
        "ensemble": min(cfg.ensemble, 2),
    }


def _run(cfg: DemoConfig) -> int:
    if cfg.quick:
        for name, value in quick_settings(cfg).items():
            setattr(cfg, name, value)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"lsn_ext demo — torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, "
        f"seed {cfg.seed}, {cfg.epochs} epochs, U-Net widths {'-'.join(map(str, cfg.widths))}"
    )

    data = load_data(cfg, device)
    x_tr, y_tr, x_val, y_val = data.train_x, data.train_y, data.val_x, data.val_y
    x_te, y_te, far_ood = data.test_x, data.test_y, data.far_ood
    print(
        f"Nuclei patches 64×64: {len(x_tr)} train, {len(x_val)} val, {len(x_te)} test "
        f"(disjoint row bands); {len(far_ood)} H&E patches as far OOD."
    )

    def unet(dropout: float = 0.0) -> UNet:
        return UNet(1, 1, widths=cfg.widths, dropout=dropout).to(device, torch.float32)

    def ssn(dropout: float = 0.0) -> SSN:
        net = SSN.with_unet(1, widths=cfg.widths, rank=cfg.rank, dropout=dropout)
        return net.to(device, torch.float32)

    t0 = time.perf_counter()
    nets: dict[str, nn.Module] = {}
    ssn_obj = functools.partial(ssn_objective, objective=cfg.ssn_loss)
    nets["ssn"] = train("SSN", ssn(), ssn_obj, x_tr, y_tr, cfg, cfg.seed)
    nets["unet"] = train("U-Net", unet(), bce_objective, x_tr, y_tr, cfg, cfg.seed + 1)
    nets["ssn_do"] = train(
        "SSN + dropout", ssn(cfg.dropout), ssn_obj, x_tr, y_tr, cfg, cfg.seed + 2
    )
    nets["unet_do"] = train(
        "U-Net + dropout", unet(cfg.dropout), bce_objective, x_tr, y_tr, cfg, cfg.seed + 3
    )
    members = [nets["unet"]]
    for k in range(1, cfg.ensemble):
        torch.manual_seed(cfg.seed + 10 + k)
        members.append(
            train(f"ensemble {k + 1}", unet(), bce_objective, x_tr, y_tr, cfg, cfg.seed + 10 + k)
        )
    t_train = time.perf_counter() - t0
    print(f"Trained {4 + max(cfg.ensemble - 1, 0)} networks in {t_train:.0f} s.")

    t0 = time.perf_counter()
    train_loader = _loader(x_tr, y_tr, cfg.batch_size)
    val_loader = _loader(x_val, y_val, cfg.batch_size)
    la_lsn = fit_lsn(
        nets["ssn"],
        train_loader,
        estimator=cfg.estimator,
        mc_samples=cfg.mc_samples,
        seed=cfg.seed,
    )
    prior_lsn = tune_prior(la_lsn, val_loader, cfg)
    la_unet = laplace_unet(nets["unet"], train_loader, cfg)
    prior_unet = tune_prior(la_unet, val_loader, cfg)
    n_mean = sum(p.numel() for p in nets["ssn"].backbone.parameters()) + sum(
        p.numel() for p in nets["ssn"].mean_head.parameters()
    )
    n_ssn = sum(p.numel() for p in nets["ssn"].parameters())
    print(
        f"Laplace posteriors (GGN diagonal: {_estimator_name(cfg)}) in "
        f"{time.perf_counter() - t0:.0f} s: LSN over "
        f"{la_lsn.n_params} of the SSN's {n_ssn} parameters (backbone + mean head: {n_mean}), "
        f"prior precision {prior_lsn:g}; U-Net + LA over {la_unet.n_params}, "
        f"prior precision {prior_unet:g} ({_PRIOR_NAMES[cfg.prior]})."
    )

    n_e = cfg.n_epistemic
    predictors: dict[str, Callable[[Tensor], SegmentationPrediction]] = {
        "LSN": lambda x: predict(la_lsn, x, n_e, generator=_gen(x, cfg.seed)),
        "U-Net + LA": lambda x: predict(la_unet, x, n_e, generator=_gen(x, cfg.seed)),
        "SSN + Dropout": lambda x: mc_dropout_predict(nets["ssn_do"], x, n_e),
        "U-Net + Dropout": lambda x: mc_dropout_predict(nets["unet_do"], x, n_e),
    }
    if cfg.ensemble >= 2:
        predictors["Ensemble"] = lambda x: ensemble_predict(members, x)

    t0 = time.perf_counter()
    results: dict[str, dict[str, float]] = {}
    preds: dict[str, dict[str, SegmentationPrediction]] = {}
    for name in tqdm(predictors, desc="evaluate", disable=not cfg.progress, leave=False):
        torch.manual_seed(cfg.seed + 7)
        results[name], preds[name] = measure(predictors[name], data)
    t_eval = time.perf_counter() - t0

    area = data.noise_box.float().flatten(1).mean(1).mean().item()
    area_black = data.black_box.float().flatten(1).mean(1).mean().item()
    notes = [
        f"Nuclei test band, {len(x_te)} patches of 64×64 (one noise box and one black box each; "
        f"the boxes cover {area:.3f} / {area_black:.3f} of a patch on average, the Box Ratio of "
        "variance spread evenly); far OOD: "
        f"{len(far_ood)} H&E patches. Epistemic variance from {n_e} samples "
        f"(Ensemble: {cfg.ensemble} members); seed {cfg.seed}, {cfg.epochs} epochs; "
        f"Laplace GGN diagonal: {_estimator_name(cfg)}; prior precision by "
        f"{_PRIOR_NAMES[cfg.prior]}.",
    ]
    table = _write_tables(out, results, notes)

    # Figure: LSN maps for one ID patch, its corrupted versions and an H&E patch, with the
    # epistemic maps of the baselines beside them.
    i = int(y_te.flatten(1).mean(1).argmax()) if not cfg.quick else 0
    j = int(far_ood.flatten(1).std(1).argmax())
    rows_x = {
        "ID": x_te[i : i + 1],
        "noise box": data.noise_x[i : i + 1],
        "black box": data.black_x[i : i + 1],
        "H&E (far OOD)": far_ood[j : j + 1],
    }
    masks = dict.fromkeys(rows_x, y_te[i, 0]) | {"H&E (far OOD)": None}
    keys = {"ID": ("id", i), "noise box": ("noise", i), "black box": ("black", i)}
    keys["H&E (far OOD)"] = ("he", j)
    panels = []
    for row, x in rows_x.items():
        lp = predict_lsn(la_lsn, nets["ssn"], x, n_e, cfg.n_aleatoric, seed=cfg.seed)
        row_panels = [
            ("image", x[0, 0], "gray"),
            ("mask", masks[row], "gray01"),
            ("LSN prediction", lp.epistemic.mean[0, 0], "gray01"),
            ("LSN aleatoric", lp.aleatoric[0, 0], "magma"),
            ("LSN epistemic", lp.epistemic.variance[0, 0], "magma"),
        ]
        key, k = keys[row]
        for name in ("U-Net + LA", "SSN + Dropout", "U-Net + Dropout"):
            row_panels.append((f"{name} epistemic", preds[name][key].variance[k, 0], "magma"))
        panels.append((row, row_panels))
    fig_path = _figure(out, panels, dpi=50 if cfg.quick else 110)

    print(f"\nEvaluation in {t_eval:.0f} s. Results (also {out / 'table.md'}, table.csv):\n")
    print(table)
    order = results["LSN"]["Box Ratio (noise)"] > results["U-Net + Dropout"]["Box Ratio (noise)"]
    print(
        "Paper's ordering (LSN localises the noise box better than U-Net + MC dropout, higher "
        f"Box Ratio): {'reproduced' if order else 'NOT reproduced'} on this run "
        f"({results['LSN']['Box Ratio (noise)']:.3f} vs "
        f"{results['U-Net + Dropout']['Box Ratio (noise)']:.3f})."
    )
    print(f"Figure: {fig_path}. Total time {time.perf_counter() - start:.0f} s.")
    if not all(math.isfinite(v) for r in results.values() for v in r.values()):
        print("Warning: some measures are not finite (see the table).")
    return 0
