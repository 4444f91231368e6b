"""The LSN paper's experiments at a scale that fits a 2-core CPU.

The experiments follow the 2023 arXiv version of the paper (Zepf et al., "Laplacian Segmentation
Networks: Improved Epistemic Uncertainty from Spatial Aleatoric Uncertainty", arXiv:2303.13123v1):
its Table 1 (IoU against loss reweighting), Table 2 (Pixel and Box Ratio of noise and black
boxes), Fig. 5 (aleatoric variance at the boundary) and Fig. 7 (entropy under distribution shift),
with Fig. 4 adapted (see ``report_fig4``). The 2024 version (MICCAI 2024, "Laplacian Segmentation
Networks Improve Epistemic Uncertainty Quantification") has no Box Ratio; it reports image-level
OOD detection AUROC instead, which is not reproduced here.

Seven models, by the paper's names: Ensemble, U-Net + Dropout, SSN (diag) + Dropout,
SSN + Dropout, U-Net + LA, LSN (diag) and LSN ("(diag)": rank-0 logit covariance), trained on

- ``lesions``: synthetic images, not ISIC: :func:`lsn_ext.data.lesion_dataset` generates
  ISIC-like 64×64 RGB images with a foreground share of about 1/9 (the paper's ISIC imbalance
  of about 1:8), and
- ``nuclei``: the fluorescence nuclei image (:func:`lsn_ext.data.nuclei_patches`), with the 31
  slices of stardist's synthetic 3-D nuclei volume as a second test set. Black is the
  background of a fluorescence image, so the black box is not out of distribution there.

Every network is trained for ``Budget.steps`` Adam steps (128: about 1.4 epochs of the lesions),
not to convergence, so each Laplace approximation is taken at weights that need not be a mode.

Parts (``--parts``, each separately selectable; trained networks and fitted posteriors are
cached in ``--cache``, so parts that share them train them once):

- ``table1``: IoU after training with BCE class-reweighting factors 1, 2, 4, 8 (lesions).
- ``table2``: Pixel Ratio and Box Ratio for noise and black boxes (LSN Eq. 16–17, §4.4).
- ``fig4``: average precision (PR-AUC) of the aleatoric against the epistemic map for finding the
  corrupted box pixels, SSN-based models (the paper's Fig. 4 instead compares the components'
  segmentations on clean images).
- ``fig5``: share of the aleatoric variance within 2 pixels of the mask boundary, against the
  share of pixels there.
- ``fig7``: per-image predictive entropy under blur, contrast, noise and intensity shifts of
  increasing strength, and the AUROC against in-distribution images per strength (lesions).
- ``diagnose``: why the aleatoric map is where it is (SSN loss variants, the map's definition),
  the prior precision (validation NLL on a wide grid, scalar and layer-wise marginal
  likelihood), the curvature estimator, and where the seed-to-seed spread comes from.

Every number is a mean over seeds with a 95 % t-interval. The report is written to
``integration/results/lsn_paper.md`` with the figures beside it and every table's per-seed
values in ``lsn_paper_per_seed.csv`` (data set, part, model, seed, metric, value); the cost
table gives each unit's wall-clock time as run. ``--quick`` runs a tiny version (tests) into a
temporary directory.

Run: ``./dev bench lsn_paper [--parts table1,table2] [--seeds 0-4] [--workers 2] [--quick]``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from laplace import Laplace
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine
from stats import fmt, mean_ci

from lsn_ext import BCEWithLogits, DiagBackprop, gridsearch_prior_precision, predict
from lsn_ext.data import (
    lesion_dataset,
    nuclei_patches,
    nuclei_volume_slices,
    random_flips,
)
from lsn_ext.lsn import (
    MeanNetwork,
    aleatoric_maps,
    ensemble_predict,
    fit_lsn,
    mc_dropout_predict,
    predict_lsn,
)
from lsn_ext.metrics import (
    auroc,
    average_precision,
    black_box,
    boundary_band,
    boundary_share,
    box_ratio,
    iou,
    noise_box,
    per_image_entropy,
    pixel_ratio,
)
from lsn_ext.models import SSN, UNet, ssn_loss

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("table1", "table2", "fig4", "fig5", "fig7", "diagnose")
MODELS = (
    "Ensemble",
    "U-Net + Dropout",
    "SSN (diag) + Dropout",
    "SSN + Dropout",
    "U-Net + LA",
    "LSN (diag)",
    "LSN",
)
SSN_MODELS = ("SSN (diag) + Dropout", "SSN + Dropout", "LSN (diag)", "LSN")
# Reweighting factors of Table 2, Fig. 4, 5 and 7 and the diagnosis: (U-Net-based, SSN-based)
# models. The paper finds that its U-Nets need reweighting on ISIC and its SSNs do not (Table 1);
# fixed before the full run. The nuclei (foreground 1:4) train unweighted in the demo.
EVAL_FACTORS = {"lesions": (4, 1), "nuclei": (1, 1)}
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
SHIFTS = {  # name: (strengths, what a strength means)
    "blur": ((0.75, 1.5, 3.0), "Gaussian blur, σ in pixels"),
    "contrast": ((0.6, 0.35, 0.1), "contrast kept around each image's mean"),
    "noise": ((0.25, 0.5, 1.0), "added Gaussian noise, σ in standardised units"),
    "intensity": ((1.5, 2.0, 3.0), "intensities multiplied (standardised scale)"),
}


@dataclass(frozen=True)
class Budget:
    """Sizes of one run (the full run's defaults; :data:`QUICK` for tests).

    Attributes:
        n_train, n_val, n_test: Lesion images per split (the nuclei splits are fixed).
        n_iou: Test images for Table 1's IoU.
        n_eval: Test images for Table 2 and Fig. 4/5 (their first ``n_eval``).
        n_shift: Test images per shift and strength (Fig. 7).
        steps: Optimiser steps per network (Adam, cosine decay from ``lr``).
        batch_size, lr: Training batch and learning rate.
        widths: U-Net feature maps per level (the paper: 8-16-32-64-128, tanh).
        rank: SSN covariance rank (the paper: 10); the "(diag)" models use 0.
        dropout: Dropout probability of the MC-dropout models.
        ensemble: Ensemble members (the first is the U-Net of U-Net + LA).
        n_epistemic, n_aleatoric: Samples (the paper: 50 and 20).
        n_iou_samples: Posterior / dropout samples for Table 1's predictive mean.
        n_shift_epistemic, n_shift_aleatoric: Samples for Fig. 7's predictive entropy.
        n_val_samples: Posterior samples per candidate of the prior grid search.
        prior_exponents: The prior grid ``10^k``.
        factors: BCE reweighting factors of Table 1.
        diagnose_seeds: The diagnosis runs on the first this many seeds.
        n_diagnose_samples: Posterior samples per prior choice in the diagnosis.
    """

    n_train: int = 1500
    n_val: int = 64
    n_test: int = 128
    n_iou: int = 128
    n_eval: int = 64
    n_shift: int = 48
    steps: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    widths: tuple[int, ...] = (8, 16, 32, 64, 128)
    rank: int = 10
    dropout: float = 0.1
    ensemble: int = 3
    n_epistemic: int = 50
    n_aleatoric: int = 20
    n_iou_samples: int = 8
    n_shift_epistemic: int = 16
    n_shift_aleatoric: int = 8
    n_val_samples: int = 2
    prior_exponents: tuple[int, ...] = tuple(range(-4, 9))
    factors: tuple[int, ...] = (1, 2, 4, 8)
    diagnose_seeds: int = 3
    n_diagnose_samples: int = 16

    def key(self) -> str:
        """A short hash of the sizes, part of every cache file name."""
        return hashlib.sha1(json.dumps(asdict(self)).encode()).hexdigest()[:8]


QUICK = Budget(
    n_train=24,
    n_val=4,
    n_test=6,
    n_iou=6,
    n_eval=6,
    n_shift=4,
    steps=2,
    batch_size=8,
    widths=(4, 8),
    rank=2,
    ensemble=2,
    n_epistemic=3,
    n_aleatoric=4,
    n_iou_samples=2,
    n_shift_epistemic=2,
    n_shift_aleatoric=2,
    n_val_samples=2,
    prior_exponents=(-2, 0, 2),
    factors=(1, 8),
    n_diagnose_samples=2,
)


# ----------------------------------------------------------------------------------------------
# Data


@dataclass
class Data:
    """One data set's splits, ``[P, C, 64, 64]`` images and ``[P, 1, 64, 64]`` masks."""

    name: str
    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor
    test_x: Tensor
    test_y: Tensor
    black: float | None  # the value of black on the input scale (None: each image's minimum)
    notes: str


def load_data(name: str, budget: Budget) -> Data:
    """The ``lesions`` or ``nuclei`` splits (fixed data; the seeds vary the training)."""
    if name == "lesions":
        n = budget.n_train + budget.n_val + budget.n_test
        x, y = lesion_dataset(n, 64, generator=torch.Generator().manual_seed(2024))
        a, b = budget.n_train, budget.n_train + budget.n_val
        fg = y[:a].mean().item()
        notes = (
            f"{a} training, {budget.n_val} validation and {budget.n_test} test images, 64×64 RGB, "
            f"foreground share {fg:.3f} (1:{(1 - fg) / fg:.1f})"
        )
        return Data(name, x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:], None, notes)
    if name == "nuclei":
        s = nuclei_patches(64, 32, dtype=torch.float32)
        vx, vy = nuclei_volume_slices(64, dtype=torch.float32)
        test_x, test_y = torch.cat([s.test_x, vx]), torch.cat([s.test_y, vy])
        if budget is QUICK:
            s.train_x, s.train_y = s.train_x[: budget.n_train], s.train_y[: budget.n_train]
        notes = (
            f"{len(s.train_x)} training and {len(s.val_x)} validation patches of the 2-D nuclei "
            f"image; test: its {len(s.test_x)} test-band patches and the {len(vx)} z-slices of "
            "stardist's synthetic 3-D nuclei volume (reflect-padded to 64×64)"
        )
        black = s.normalise(torch.tensor(0.0)).item()
        return Data(name, s.train_x, s.train_y, s.val_x, s.val_y, test_x, test_y, black, notes)
    raise ValueError(f"unknown data set {name!r}; use 'lesions' or 'nuclei'")


def _loader(x: Tensor, y: Tensor, batch_size: int = 32) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


# ----------------------------------------------------------------------------------------------
# Networks


@dataclass(frozen=True)
class NetSpec:
    """One network to train: architecture and loss."""

    kind: str  # "unet" or "ssn"
    rank: int = 0
    dropout: float = 0.0
    member: int = 0
    ssn_samples: int = 20
    antithetic: bool = True
    step_factor: int = 1
    objective: str = "logsumexp"  # ssn_loss's objective

    def tag(self) -> str:
        tag = (
            f"{self.kind}-r{self.rank}-d{self.dropout}-m{self.member}-M{self.ssn_samples}"
            f"-a{int(self.antithetic)}-x{self.step_factor}"
        )
        return tag if self.objective == "logsumexp" else f"{tag}-{self.objective}"


def specs(budget: Budget) -> dict[str, NetSpec]:
    """The networks behind the seven models (shared: the Ensemble's first member is U-Net + LA's
    U-Net; LSN and LSN (diag) put posteriors on the rank-10 and rank-0 SSNs)."""
    p, r = budget.dropout, budget.rank
    nets = {f"unet{k}": NetSpec("unet", member=k) for k in range(budget.ensemble)}
    nets |= {
        "unet_do": NetSpec("unet", dropout=p),
        "ssn": NetSpec("ssn", rank=r),
        "ssn_diag": NetSpec("ssn", rank=0),
        "ssn_do": NetSpec("ssn", rank=r, dropout=p),
        "ssn_diag_do": NetSpec("ssn", rank=0, dropout=p),
    }
    return nets


DIAGNOSE_SPECS = {
    "SSN, Eq. 11 with M = 20, antithetic (the models above)": None,
    "SSN, M = 20 without antithetic pairs": NetSpec("ssn", rank=10, antithetic=False),
    "SSN, M = 1 (expected BCE under logit noise)": NetSpec(
        "ssn", rank=10, ssn_samples=1, antithetic=False
    ),
    "SSN, M = 20, antithetic, 4× the steps": NetSpec("ssn", rank=10, step_factor=4),
}


def build(spec: NetSpec, budget: Budget, in_channels: int) -> nn.Module:
    if spec.kind == "unet":
        return UNet(in_channels, 1, widths=budget.widths, dropout=spec.dropout)
    rank = min(spec.rank, budget.rank)
    return SSN.with_unet(in_channels, widths=budget.widths, rank=rank, dropout=spec.dropout)


def _objective(spec: NetSpec, factor: float) -> Callable[[nn.Module, Tensor, Tensor], Tensor]:
    if spec.kind == "unet":
        weight = torch.tensor(float(factor))
        return lambda net, x, y: F.binary_cross_entropy_with_logits(net(x), y, pos_weight=weight)

    def ssn_objective(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        out = net.distribution(x)
        loss = ssn_loss(
            out,
            y,
            spec.ssn_samples,
            antithetic=spec.antithetic,
            pos_weight=factor,
            objective=spec.objective,
        )
        return loss / y[0].numel()

    return ssn_objective


@dataclass
class EarlyStopping:
    """Early stopping for :func:`train`: a validation score (higher is better) every
    ``every`` steps; training stops after ``patience`` evaluations without improvement and
    the network returns with the weights of its best evaluation. :func:`train` fills in
    ``best_step``, ``best_score`` and ``steps_run``; ``stopped`` says whether the patience ran
    out before the step cap. No stop before ``min_steps``, nor while the best score is still at
    or below ``floor`` (e.g. a network at background, Dice 0, runs to the cap).
    """

    score: Callable[[nn.Module], float]
    every: int
    patience: int
    min_steps: int = 0
    floor: float = -math.inf
    best_step: int = 0
    best_score: float = -math.inf
    steps_run: int = 0
    stopped: bool = False

    def check(self, net: nn.Module, step: int, last: bool = False) -> bool:
        """Evaluate after ``step`` steps (eval mode, no gradients); True: stop now."""
        self.steps_run = step
        if step % self.every and not last:
            return False
        net.eval()
        with torch.no_grad():
            score = float(self.score(net))
        net.train()
        if score > self.best_score:
            self.best_score, self.best_step = score, step
            self._best = {k: v.detach().clone() for k, v in net.state_dict().items()}
        self.stopped = (
            step >= self.min_steps
            and self.best_score > self.floor
            and step - self.best_step >= self.patience * self.every
        )
        return self.stopped

    def restore(self, net: nn.Module) -> None:
        if hasattr(self, "_best"):
            net.load_state_dict(self._best)
            del self._best


def train(
    spec: NetSpec,
    data: Data,
    factor: float,
    seed: int,
    budget: Budget,
    stopping: EarlyStopping | None = None,
) -> nn.Module:
    """Adam with cosine decay for ``budget.steps × spec.step_factor`` steps, random flips.

    With ``stopping``, the steps are a cap: training ends when the validation score has not
    improved for ``stopping.patience`` evaluations, with the best evaluation's weights.
    """
    torch.manual_seed(seed * 1000 + hash_int(spec.tag()))
    net = build(spec, budget, data.train_x.shape[1])
    objective = _objective(spec, factor)
    steps = budget.steps * spec.step_factor
    opt = torch.optim.Adam(net.parameters(), lr=budget.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed * 7919 + hash_int(spec.tag()))
    net.train()
    order: list[Tensor] = []
    for step in range(1, steps + 1):
        if not order:
            order = list(torch.randperm(len(data.train_x), generator=gen).split(budget.batch_size))
        idx = order.pop(0)
        xb, yb = random_flips(data.train_x[idx], data.train_y[idx], gen)
        loss = objective(net, xb, yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{spec.tag()} diverged (loss {loss.item()})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        if stopping is not None and stopping.check(net, step, last=step == steps):
            break
    if stopping is not None:
        stopping.restore(net)
    return net.eval()


def hash_int(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest()[:6], 16)


class Cache:
    """Networks, posteriors and unit results on disk, keyed by data set, factor, seed, budget."""

    def __init__(self, root: Path, budget: Budget):
        self.root, self.budget = root, budget
        root.mkdir(parents=True, exist_ok=True)

    def path(self, kind: str, *key: object, suffix: str = ".pt") -> Path:
        return self.root / ("-".join(map(str, (kind, *key, self.budget.key()))) + suffix)

    def net(self, spec: NetSpec, data: Data, factor: float, seed: int) -> nn.Module:
        path = self.path("net", data.name, spec.tag(), f"f{factor}", f"s{seed}")
        if path.exists():
            net = build(spec, self.budget, data.train_x.shape[1])
            net.load_state_dict(torch.load(path))
            return net.eval()
        net = train(spec, data, factor, seed, self.budget)
        self.save(net.state_dict(), path)
        return net

    @staticmethod
    def save(obj: object, path: Path) -> None:
        """Write through a temporary file, so that a killed run leaves no half-written entry."""
        tmp = path.with_suffix(".tmp")
        torch.save(obj, tmp)
        tmp.replace(path)

    def result(self, name: str, compute: Callable[[], dict]) -> dict:
        path = self.path("result", name, suffix=".json")
        if path.exists():
            return json.loads(path.read_text())
        value = compute()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(path)
        return value

    def stored(self, name: str) -> dict | None:
        path = self.path("result", name, suffix=".json")
        return json.loads(path.read_text()) if path.exists() else None


# ----------------------------------------------------------------------------------------------
# Posteriors and predictives


def _laplace(net: nn.Module, factor: float, estimator: str, seed: int) -> Laplace:
    """The (unfitted) posterior object: on the U-Net, or on the SSN's mean network (LSN)."""
    return Laplace(
        MeanNetwork(net) if isinstance(net, SSN) else net,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=DiagBackprop,
        backend_kwargs={
            "loss": BCEWithLogits(pos_weight=factor),
            "estimator": estimator,
            "mc_samples": 1,
            "seed": seed,
        },
    )


def fit_posterior(
    cache: Cache,
    name: str,
    net: nn.Module,
    data: Data,
    factor: float,
    seed: int,
    estimator: str = "mc",
) -> tuple[Laplace, dict]:
    """A diagonal Laplace posterior (U-Net + LA, or the LSN on an SSN's mean network) with the
    prior precision chosen by validation NLL on ``10^k``; cached (laplace-torch state dict)."""
    budget = cache.budget
    path = cache.path("la", data.name, name, estimator, f"f{factor}", f"s{seed}")
    if path.exists():
        la = _laplace(net, factor, estimator, seed)
        state = torch.load(path, weights_only=False)
        la.load_state_dict(state["la"])
        return la, state["info"]
    train = _loader(data.train_x, data.train_y, 64)
    if isinstance(net, SSN):
        la = fit_lsn(net, train, pos_weight=factor, estimator=estimator, seed=seed)
    else:
        la = _laplace(net, factor, estimator, seed)
        la.fit(train)
    grid = [10.0**k for k in budget.prior_exponents]
    search = gridsearch_prior_precision(
        la,
        _loader(data.val_x, data.val_y),
        grid=grid,
        n_samples=budget.n_val_samples,
        seed=seed,
    )
    best = grid.index(search.prior_precision)
    info = {
        "prior_precision": search.prior_precision,
        "grid_scores": [float(s) for s in search.scores],
        "at_edge": best in (0, len(grid) - 1),
        "curvature_above_prior": float((search.prior_precision < la.H).double().mean()),
    }
    cache.save({"la": la.state_dict(), "info": info}, path)
    return la, info


@dataclass
class Model:
    """One of the seven models as three predictives on images ``x``.

    ``epistemic(x, n, seed)``: :class:`lsn_ext.SegmentationPrediction` over the epistemic samples
    (its variance is the epistemic map); ``aleatoric(x, seed)``: ``Var_η σ(η)`` at the trained
    weights (SSN-based models, else None); ``total(x, seed)``: ``(E p, entropy)`` of the full
    predictive with Fig. 7's sample counts.
    """

    name: str
    epistemic: Callable[[Tensor, int, int], object]
    aleatoric: Callable[[Tensor, int], Tensor] | None
    total: Callable[[Tensor, int], tuple[Tensor, Tensor]]
    info: dict = field(default_factory=dict)


def _entropy_binary(p: Tensor) -> Tensor:
    p = p.clamp(1e-12, 1 - 1e-12)
    return -(p * p.log() + (1 - p) * (1 - p).log())[:, 0]


@torch.no_grad()
def _dropout_total(ssn: SSN, x: Tensor, n_e: int, n_a: int, seed: int) -> tuple[Tensor, Tensor]:
    """Full predictive of an SSN + Dropout: dropout passes, each with ``n_a`` logit samples."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dropouts = [m for m in ssn.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    total = torch.zeros_like(x[:, :1])
    try:
        for m in dropouts:
            m.train()
        for _ in range(n_e):
            eta = ssn.distribution(x).rsample(n_a, antithetic=False, generator=gen)
            total += torch.sigmoid(eta).mean(0) / n_e
    finally:
        for m in dropouts:
            m.eval()
    return total, _entropy_binary(total)


def models(cache: Cache, data: Data, factors: tuple[int, int], seed: int) -> dict[str, Model]:
    """The seven models of one data set and seed, trained or loaded from the cache.

    ``factors``: the BCE reweighting factors of the U-Net-based and of the SSN-based models.
    """
    budget = cache.budget
    nets = {k: cache.net(s, data, factors[s.kind == "ssn"], seed) for k, s in specs(budget).items()}
    n_se, n_sa = budget.n_shift_epistemic, budget.n_shift_aleatoric
    out: dict[str, Model] = {}

    def seeded(fn: Callable[[Tensor, int], object]) -> Callable[[Tensor, int, int], object]:
        def run(x: Tensor, n: int, s: int) -> object:
            torch.manual_seed(s)
            return fn(x, n)

        return run

    def sample_total(epi: Callable) -> Callable[[Tensor, int], tuple[Tensor, Tensor]]:
        def run(x: Tensor, s: int) -> tuple[Tensor, Tensor]:
            p = epi(x, n_se, s)
            return p.mean, p.entropy

        return run

    for name in MODELS:
        if name == "Ensemble":
            members = [nets[f"unet{k}"] for k in range(budget.ensemble)]
            epi = seeded(lambda x, n, m=members: ensemble_predict(m, x))
            out[name] = Model(name, epi, None, sample_total(epi))
        elif name in ("U-Net + Dropout", "SSN (diag) + Dropout", "SSN + Dropout"):
            key = {"U-Net + Dropout": "unet_do", "SSN + Dropout": "ssn_do"}
            net = nets[key.get(name, "ssn_diag_do")]
            epi = seeded(lambda x, n, net=net: mc_dropout_predict(net, x, n))
            if isinstance(net, SSN):
                ale = _aleatoric(net, budget)
                tot = lambda x, s, net=net: _dropout_total(net, x, n_se, n_sa, s)  # noqa: E731
                out[name] = Model(name, epi, ale, tot)
            else:
                out[name] = Model(name, epi, None, sample_total(epi))
        else:
            net = {"U-Net + LA": nets["unet0"], "LSN (diag)": nets["ssn_diag"], "LSN": nets["ssn"]}
            net = net[name]
            factor = factors[isinstance(net, SSN)]
            la, info = fit_posterior(cache, name, net, data, factor, seed)

            def epi(x: Tensor, n: int, s: int, la: Laplace = la) -> object:
                return predict(la, x, n, generator=torch.Generator().manual_seed(s))

            if isinstance(net, SSN):

                def tot(x: Tensor, s: int, la: Laplace = la, net: SSN = net) -> tuple:
                    p = predict_lsn(la, net, x, n_se, n_sa, seed=s)
                    return p.total_mean, p.entropy

                out[name] = Model(name, epi, _aleatoric(net, budget), tot, info)
            else:
                out[name] = Model(name, epi, None, sample_total(epi), info)
    return out


def _aleatoric(ssn: SSN, budget: Budget) -> Callable[[Tensor, int], Tensor]:
    def run(x: Tensor, s: int) -> Tensor:
        gen = torch.Generator().manual_seed(s)
        return aleatoric_maps(ssn, x, budget.n_aleatoric, generator=gen)[1]

    return run


# ----------------------------------------------------------------------------------------------
# Units of work (one data set, factor and seed each), run in worker processes


def unit_table1(cache: Cache, dataset: str, factor: int, seed: int) -> dict:
    """Test IoU of the seven models' predictive means at one reweighting factor and seed."""

    def compute() -> dict:
        data = load_data(dataset, cache.budget)
        b = cache.budget
        x, y = data.test_x[: b.n_iou], data.test_y[: b.n_iou]
        out = {}
        for name, model in models(cache, data, (factor, factor), seed).items():
            p = model.epistemic(x, b.n_iou_samples, seed)
            out[name] = {"iou": iou(p.mean > 0.5, y > 0.5), **model.info}
        return out

    return cache.result(f"table1-{dataset}-f{factor}-s{seed}", compute)


def _boxed(data: Data, b: Budget, seed: int) -> tuple[Tensor, ...]:
    """The first ``n_eval`` test images and masks, with a noise box and a black box each.

    The boxes are a function of the seed, so Table 2 and the diagnosis see the same ones.

    Returns:
        ``(x, y, x_noise, box_noise, x_black, box_black)``.
    """
    x, y = data.test_x[: b.n_eval], data.test_y[: b.n_eval]
    gen = torch.Generator().manual_seed(1000 + seed)
    x_noise, box_noise = noise_box(x, generator=gen)
    x_black, box_black = black_box(x, data.black, generator=gen)
    return x, y, x_noise, box_noise, x_black, box_black


def unit_eval(cache: Cache, dataset: str, seed: int) -> dict:
    """Table 2, Fig. 4 and Fig. 5 of one data set and seed (shared predictions)."""

    def compute() -> dict:
        b = cache.budget
        data = load_data(dataset, b)
        x, y, x_noise, box_noise, x_black, box_black = _boxed(data, b, seed)
        inputs = {"id": x, "noise": x_noise, "black": x_black}
        boxes = {"noise": box_noise, "black": box_black}
        out: dict[str, dict] = {}
        for name, model in models(cache, data, EVAL_FACTORS[dataset], seed).items():
            p = {k: model.epistemic(v, b.n_epistemic, seed) for k, v in inputs.items()}
            r: dict = {"iou": iou(p["id"].mean > 0.5, y > 0.5), **model.info}
            for k in ("noise", "black"):
                r[f"pixel_{k}"] = pixel_ratio(p["id"].variance, p[k].variance).tolist()
                r[f"box_{k}"] = box_ratio(p[k].variance, boxes[k]).tolist()
                r[f"box_area_{k}"] = boxes[k].double().flatten(1).mean(1).tolist()
            if model.aleatoric is not None:
                ale = {k: model.aleatoric(v, seed) for k, v in inputs.items()}
                for k in ("noise", "black"):
                    r[f"ap_aleatoric_{k}"] = average_precision(ale[k], boxes[k])
                    r[f"ap_epistemic_{k}"] = average_precision(p[k].variance, boxes[k])
                    r[f"box_aleatoric_{k}"] = box_ratio(ale[k], boxes[k]).mean().item()
                share, pixels = boundary_share(ale["id"], y)
                r["boundary_aleatoric"], r["boundary_pixels"] = share, pixels
                r["boundary_epistemic"] = boundary_share(p["id"].variance, y)[0]
                r["boundary_aleatoric_mean"] = _region_means(ale["id"], y)
            r["boundary_epistemic_mean"] = _region_means(p["id"].variance, y)
            out[name] = r
        return out

    return cache.result(f"eval-{dataset}-s{seed}", compute)


_REGIONS = ("band", "fg", "bg")


def _region_means(v: Tensor, y: Tensor) -> dict[str, float]:
    """Mean of ``v`` within 2 px of the mask boundary, inside and outside the mask."""
    band = boundary_band(y, 2)
    inside, outside = (y > 0.5) & ~band, (y < 0.5) & ~band
    return {k: float(v[m].mean()) for k, m in zip(_REGIONS, (band, inside, outside), strict=True)}


def _regions_cell(means: list[dict[str, float]]) -> str:
    """``band / in / out`` means over seeds of :func:`_region_means` results, for a table."""
    return " / ".join(f"{_mean([m[k] for m in means]):.2g}" for k in _REGIONS)


def shift(x: Tensor, kind: str, strength: float) -> Tensor:
    """A distribution shift of standardised images ``[N, C, H, W]`` (Fig. 7)."""
    if kind == "blur":
        r = max(1, math.ceil(3 * strength))
        t = torch.arange(-r, r + 1, dtype=x.dtype)
        k = torch.exp(-0.5 * (t / strength) ** 2)
        k = k / k.sum()
        c = x.shape[1]
        xp = F.pad(x, (r, r, r, r), mode="reflect")
        xp = F.conv2d(xp, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
        return F.conv2d(xp, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)
    if kind == "contrast":
        mean = x.mean((-1, -2), keepdim=True)
        return mean + strength * (x - mean)
    if kind == "noise":
        gen = torch.Generator().manual_seed(int(strength * 1000))
        return x + strength * torch.randn(x.shape, generator=gen, dtype=x.dtype)
    if kind == "intensity":
        return strength * x
    raise ValueError(f"unknown shift {kind!r}; use one of {sorted(SHIFTS)}")


def unit_fig7(cache: Cache, dataset: str, seed: int) -> dict:
    """Per-image predictive entropy under each shift and strength, and AUROC against clean."""

    def compute() -> dict:
        b = cache.budget
        data = load_data(dataset, b)
        x = data.test_x[: b.n_shift]
        out: dict[str, dict] = {}
        for name, model in models(cache, data, EVAL_FACTORS[dataset], seed).items():
            clean = per_image_entropy(model.total(x, seed)[1])
            r: dict = {"clean": clean.mean().item()}
            for kind, (strengths, _) in SHIFTS.items():
                for s in strengths:
                    h = per_image_entropy(model.total(shift(x, kind, s), seed)[1])
                    r[f"{kind}:{s}"] = {"entropy": h.mean().item(), "auroc": auroc(clean, h)}
            out[name] = r
        return out

    return cache.result(f"fig7-{dataset}-s{seed}", compute)


def unit_diagnose(cache: Cache, dataset: str, seed: int) -> dict:
    """SSN loss variants' aleatoric maps, the prior precision, and the curvature estimator."""

    def compute() -> dict:
        b = cache.budget
        data = load_data(dataset, b)
        x, y, x_noise, box, _, _ = _boxed(data, b, seed)
        out: dict[str, dict] = {"aleatoric": {}, "prior": {}, "estimator": {}}
        f_unet, f_ssn = EVAL_FACTORS[dataset]
        base = cache.net(specs(b)["ssn"], data, f_ssn, seed)
        for label, spec in DIAGNOSE_SPECS.items():
            ssn = base if spec is None else cache.net(spec, data, f_ssn, seed)
            out["aleatoric"][label] = _aleatoric_diagnosis(ssn, x, y, seed, b)
        for name in ("LSN", "U-Net + LA"):
            net = base if name == "LSN" else cache.net(specs(b)["unet0"], data, f_unet, seed)
            factor = f_ssn if name == "LSN" else f_unet
            la, info = fit_posterior(cache, name, net, data, factor, seed)
            out["prior"][name] = _prior_diagnosis(la, info, data, x, y, x_noise, box, seed, b)
        for estimator in ("db", "mc"):
            la, info = fit_posterior(cache, "LSN", base, data, f_ssn, seed, estimator)
            p_id = predict(
                la, x, b.n_diagnose_samples, generator=torch.Generator().manual_seed(seed)
            )
            p = predict(
                la, x_noise, b.n_diagnose_samples, generator=torch.Generator().manual_seed(seed)
            )
            out["estimator"][estimator] = {
                "prior_precision": info["prior_precision"],
                "H": la.H.detach().clone(),
                "iou": iou(p_id.mean > 0.5, y > 0.5),
                "box_noise": box_ratio(p.variance, box).mean().item(),
            }
        h_db, h_mc = (out["estimator"][e].pop("H") for e in ("db", "mc"))
        out["estimator"]["relative_difference"] = float((h_db - h_mc).norm() / h_mc.norm())
        out["estimator"]["sum_ratio_db_over_mc"] = float(h_db.sum() / h_mc.sum())
        return out

    return cache.result(f"diagnose-{dataset}-s{seed}", compute)


@torch.no_grad()
def _aleatoric_diagnosis(ssn: SSN, x: Tensor, y: Tensor, seed: int, b: Budget) -> dict:
    """Where an SSN puts its aleatoric variance: ``Var σ(η)``, ``Var η`` and IoU of ``σ(μ)``."""
    out = ssn.distribution(x)
    logit_var = out.cov_diag + out.cov_factor.pow(2).sum(-1).view_as(out.cov_diag)
    ale = aleatoric_maps(ssn, x, b.n_aleatoric, generator=torch.Generator().manual_seed(seed))[1]
    share, pixels = boundary_share(ale, y)
    return {
        "boundary_share": share,
        "boundary_pixels": pixels,
        "boundary_share_logit_var": boundary_share(logit_var, y)[0],
        "region_means": _region_means(ale, y),
        "logit_sd_region_means": _region_means(logit_var.sqrt(), y),
        "abs_mean_region_means": _region_means(out.mean.abs(), y),
        "iou": iou(out.mean > 0, y > 0.5),
    }


def _prior_diagnosis(la, info, data, x, y, x_noise, box, seed, b) -> dict:
    """Validation NLL, IoU and noise Box Ratio under three choices of the prior precision."""
    out = {"grid": dict(info)}
    choices = {"validation NLL grid (used above)": info["prior_precision"]}
    try:
        for structure in ("scalar", "layerwise"):
            with warnings.catch_warnings():  # its link_approx note is for the grid search
                warnings.filterwarnings("ignore", "By default `link_approx`", UserWarning)
                la.optimize_prior_precision(
                    method="marglik", prior_structure=structure, n_steps=200, lr=0.1
                )
            choices[f"marglik, {structure}"] = la.prior_precision.detach().clone()
    finally:
        la.prior_precision = info["prior_precision"]
    for label, prior in choices.items():
        la.prior_precision = prior
        g = torch.Generator().manual_seed(seed)
        p_val = predict(la, data.val_x, b.n_diagnose_samples, generator=g)
        nll = F.binary_cross_entropy(p_val.mean.clamp(1e-7, 1 - 1e-7), data.val_y).item()
        p_id = predict(la, x, b.n_diagnose_samples, generator=torch.Generator().manual_seed(seed))
        p = predict(
            la, x_noise, b.n_diagnose_samples, generator=torch.Generator().manual_seed(seed)
        )
        prior_t = torch.as_tensor(prior, dtype=la.H.dtype)
        out[label] = {
            "prior_min": float(prior_t.min()),
            "prior_max": float(prior_t.max()),
            "val_nll": nll,
            "iou": iou(p_id.mean > 0.5, y > 0.5),
            "box_noise": box_ratio(p.variance, box).mean().item(),
            "pixel_noise": pixel_ratio(p_id.variance, p.variance).mean().item(),
            "curvature_above_prior": float((_per_param(la, prior_t) < la.H).double().mean()),
        }
    la.prior_precision = info["prior_precision"]
    return out


def _per_param(la: Laplace, prior: Tensor) -> Tensor:
    if prior.numel() in (1, la.n_params):
        return prior
    sizes = [p.numel() for p in la.model.parameters() if p.requires_grad]
    return torch.cat([v.expand(n) for v, n in zip(prior, sizes, strict=True)])


UNITS: dict[str, Callable[..., dict]] = {
    "table1": unit_table1,
    "eval": unit_eval,
    "fig7": unit_fig7,
    "diagnose": unit_diagnose,
}


def _run_unit(args: tuple) -> tuple[tuple, float]:
    root, budget, threads, (unit, *key) = args
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    UNITS[unit](Cache(root, budget), *key)
    return (unit, *key), time.perf_counter() - t0


def plan(
    parts: Iterable[str],
    seeds: list[int],
    datasets: list[str],
    budget: Budget,
    seeds_of: dict[str, list[int]],
) -> list[tuple]:
    """The units behind the selected parts, training-heavy ones first."""
    parts = set(parts)
    units: list[tuple] = []
    if "table1" in parts:
        units += [("table1", "lesions", f, s) for f in budget.factors for s in seeds]
    if parts & {"table2", "fig4", "fig5"}:
        units += [("eval", d, s) for d in datasets for s in seeds_of[d]]
    if "fig7" in parts:
        units += [("fig7", "lesions", s) for s in seeds]
    if "diagnose" in parts:
        units += [("diagnose", "lesions", s) for s in seeds[: budget.diagnose_seeds]]
    return units


# ----------------------------------------------------------------------------------------------
# Report


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _mean(x: list[float]) -> float:
    return sum(x) / len(x)


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
        + _table(["Model"] + [f"factor {f}" for f in cache.budget.factors], rows)
        + f"\n\nTest IoU of the predictive mean (threshold ½) on {cache.budget.n_iou} test images, "
        f"mean ± 95 % CI over {len(seeds)} seeds. The factor weights the foreground term of the "
        "BCE (U-Nets) or of the SSN likelihood (SSN-based models). Laplace models: prior "
        f"precision by validation NLL; the chosen value was at an end of the grid in {edge} of "
        f"{3 * len(res)} fits. Runs that stayed at background (IoU below 0.05): "
        + ("; ".join(collapsed) or "none")
        + f". Fisher's exact test (two-sided) on these counts at factor {f0}: LSN "
        f"{count['LSN']}/{n} against LSN (diag) {count['LSN (diag)']}/{n}, p = "
        f"{_fisher_exact(count['LSN'], n, count['LSN (diag)'], n):.2g}; the rank-"
        f"{cache.budget.rank} SSN models (SSN + Dropout, LSN; separate networks) {low}/{2 * n} "
        f"against the rank-0 ones (SSN (diag) + Dropout, LSN (diag)) {diag}/{2 * n}, p = "
        f"{_fisher_exact(low, 2 * n, diag, 2 * n):.2g}. With {n} seeds per model, only a large "
        "difference in the rate of collapse can reach p < 0.05; the paper's Table 1 (arXiv v1, "
        "values without intervals) has every model but SSN + Dropout and LSN at IoU < 10^-10 at "
        "factors 1 and 2.\n"
    )


def _fisher_exact(a: int, n_a: int, b: int, n_b: int) -> float:
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
            per = [[_mean(res[d, s][name][c]) for s in seeds] for c in cols]
            paper = " / ".join(f"{v:.2f}" for v in PAPER_TABLE2[name])
            rows.append([name, fmt([res[d, s][name]["iou"] for s in seeds])])
            rows[-1] += [fmt(v) for v in per] + [paper]
        area = _mean([_mean(res[d, s]["LSN"]["box_area_noise"]) for s in seeds])
        parts.append(
            f"### {d}\n\n"
            + _table(
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
            _mean(res[d, s]["LSN"][f"box_{k}"]) > _mean(res[d, s]["U-Net + Dropout"][f"box_{k}"])
            for s in seeds
        ]
        best = [max(MODELS, key=lambda n, s=s: _mean(res[d, s][n][f"box_{k}"])) for s in seeds]
        per_seed = [_mean(res[d, s]["LSN"][f"box_{k}"]) for s in seeds]
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
            f"{_mean(within):.3f} from the images and boxes within a seed."
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
            row.append(fmt([_mean(res[d, s][name]["box_area_noise"]) for s in seeds]))
            rows.append(row)
    return (
        "## Fig. 4 as numbers: finding the corrupted pixels, aleatoric against epistemic\n\n"
        + _table(
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
        + _table(
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


def report_fig7(cache: Cache, seeds: list[int], out: Path) -> str:
    res = {s: cache.stored(f"fig7-lesions-s{s}") for s in seeds}
    if any(v is None for v in res.values()):
        return "Fig. 7: not run (select `--parts fig7`)."
    parts = ["## Fig. 7: predictive entropy under distribution shift (lesions)"]
    for kind, (strengths, meaning) in SHIFTS.items():
        rows = []
        for name in MODELS:
            row = [name, f"{_mean([res[s][name]['clean'] for s in seeds]):.3f}"]
            for st in strengths:
                h = [res[s][name][f"{kind}:{st}"]["entropy"] for s in seeds]
                a = [res[s][name][f"{kind}:{st}"]["auroc"] for s in seeds]
                row.append(f"{_mean(h):.3f} ({fmt(a, 2)})")
            rows.append(row)
        parts.append(
            f"### {kind} ({meaning})\n\n"
            + _table(["Model", "entropy, clean"] + [f"strength {s}" for s in strengths], rows)
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
                f"{_mean([v['boundary_pixels'] for v in r]):.3f}",
                _regions_cell([v["region_means"] for v in r]),
                _regions_cell([v["logit_sd_region_means"] for v in r]),
                _regions_cell([v["abs_mean_region_means"] for v in r]),
            ]
        )
    text = [
        f"## Diagnosis (lesions, {len(seeds)} seeds, the factors of Table 2)\n\n"
        "### Where the SSN puts its aleatoric variance\n\n"
        + _table(
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
        + _table(
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
                f"{_geo([v['prior_precision'] for v in r]):.3g}",
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
            if _mean(above) < 0.05
            else "."
        )
    )
    text.append(
        "### The curvature estimator (LSN)\n\n"
        + _table(["GGN diagonal", "prior precision", "IoU", "Box Ratio noise"], rows)
        + f"\n\n‖H_db − H_mc‖ / ‖H_mc‖ = {rel}; Σ H_db / Σ H_mc = {ratio}."
        + note
    )
    return "\n\n".join(text)


def _prior_range(r: list[dict]) -> str:
    lo, hi = _geo([v["prior_min"] for v in r]), _geo([v["prior_max"] for v in r])
    return f"{lo:.3g}" if lo == hi else f"{lo:.3g}–{hi:.3g}"


def _geo(values: list[float]) -> float:
    return math.exp(_mean([math.log(v) for v in values]))


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
        f"Generated by `integration/lsn_paper.py` ({'--quick' if b is QUICK else 'full run'}); "
        f"{len(seeds)} seeds ({', '.join(map(str, seeds))}). " + machine(),
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
        "baselines, are answered in `uncertainty.md` (`integration/uncertainty_benchmark.py`): "
        "Table 2's noise Box Ratio and Fig. 7's shift AUROC at the middle strength.",
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
                    rows.append((d, "table2", name, s, k, _mean(v[k])))
                for k in ("pixel_noise", "pixel_black"):
                    median = torch.tensor(v[k]).median().item()
                    rows.append((d, "table2", name, s, f"{k}_median", median))
            for name in SSN_MODELS if "fig4" in parts else ():
                v = r[name]
                for k in ("noise", "black"):
                    for comp in ("aleatoric", "epistemic"):
                        rows.append((d, "fig4", name, s, f"ap_{comp}_{k}", v[f"ap_{comp}_{k}"]))
                rows.append((d, "fig4", name, s, "box_share_noise", _mean(v["box_area_noise"])))
            for name in SSN_MODELS if "fig5" in parts else ():
                v = r[name]
                for k in ("boundary_aleatoric", "boundary_epistemic", "boundary_pixels"):
                    rows.append((d, "fig5", name, s, k, v[k]))
                for k, label in zip(_REGIONS, ("band", "inside", "outside"), strict=True):
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
                    for k, where in zip(_REGIONS, ("band", "inside", "outside"), strict=True):
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


# ----------------------------------------------------------------------------------------------
# Command line


def _record(cache: Cache, key: tuple, seconds: float) -> None:
    """Print a unit's time and keep it in the cache's ``timings.json`` (computed units only)."""
    print(f"[lsn_paper] {'/'.join(map(str, key))}: {seconds:.0f} s", flush=True)
    path = cache.path("timings", suffix=".json")
    timings = json.loads(path.read_text()) if path.exists() else {}
    if seconds > 5 or "/".join(map(str, key)) not in timings:
        timings["/".join(map(str, key))] = seconds
    path.write_text(json.dumps(timings, indent=0))


def _cost(cache: Cache, units: list[tuple]) -> str:
    """What the units of this report cost when they were computed: the wall-clock time of each
    unit as run (:func:`_record`), not CPU time."""
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
        + _table(
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


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    parser.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,2")
    parser.add_argument("--datasets", default="lesions,nuclei", help="for table2, fig4, fig5")
    parser.add_argument(
        "--nuclei-seeds", default="0-4", help="seeds of the nuclei data set (its own budget)"
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--cache", type=Path, default=RESULTS / ".cache" / "lsn_paper")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--report-only", action="store_true", help="only write the report")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {PARTS}")
    datasets = [d for d in args.datasets.split(",") if d]
    seeds = _seeds(args.seeds)
    budget = QUICK if args.quick else Budget()
    nuclei_seeds = _seeds(args.nuclei_seeds)
    seeds_of = {"lesions": seeds, "nuclei": nuclei_seeds}
    units = [] if args.report_only else plan(parts, seeds, datasets, budget, seeds_of)
    cache = Cache(args.cache, budget)
    work = [(args.cache, budget, 1, u) for u in units]
    if args.workers > 1 and len(work) > 1:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            for key, dt in pool.imap_unordered(_run_unit, work):
                _record(cache, key, dt)
    else:
        for w in work:
            _record(cache, *_run_unit((*w[:2], torch.get_num_threads(), *w[3:])))
    cost = _cost(cache, units if units else plan(parts, seeds, datasets, budget, seeds_of))
    path = write_report(cache, parts, seeds, datasets, args.out, cost, nuclei_seeds)
    print(path.read_text())
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
