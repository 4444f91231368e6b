"""The sizes of a run: the LSN paper's budget (fixed steps) and the converged one (early
stopping), each with its tiny ``--quick`` twin, and the seed lists of the command lines.

A budget's :meth:`Budget.key` (a hash of its fields, not of its class or module) names every
cache entry, so that runs of different sizes never share networks or results.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


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


# The quick twin (tests): sizes as small as still run every code path of a full run (both
# reweighting factors, an ensemble of two, the diagnosis on one seed).
QUICK = Budget(
    n_train=12,
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
    diagnose_seeds=1,
    n_diagnose_samples=2,
)


@dataclass(frozen=True)
class ConvergedBudget(Budget):
    """Sizes of the converged run (its own cache keys: the hash covers the added fields).

    Inherited fields as :class:`Budget`; ``steps`` is the cap of early stopping.

    Attributes:
        eval_every, patience: Validation Dice every ``eval_every`` steps; stop after
            ``patience`` evaluations without improvement and keep the best weights.
        min_steps: No early stop before this many steps.
        stop_floor: No early stop while the best validation Dice is at or below it (0: a
            network still predicting background runs to the cap).
        n_dropout: MC-dropout passes.
        n_bootstrap: Bootstrap resamples of the test images.
        fg_dilation: Dilation (pixels) of the predicted foreground for the foreground-adjusted
            per-image uncertainty.
        hist_bins: Bins of the per-image entropy histograms behind the bootstrap of the pixel
            AUROC and AUPRC.
    """

    n_train: int = 480
    n_val: int = 64
    n_test: int = 64
    n_eval: int = 64
    n_shift: int = 32
    steps: int = 800
    n_val_samples: int = 8
    widths: tuple[int, ...] = (8, 16, 32, 64)
    ensemble: int = 5
    n_epistemic: int = 16
    n_aleatoric: int = 8
    eval_every: int = 50
    patience: int = 4
    min_steps: int = 300
    stop_floor: float = 0.0
    n_dropout: int = 50
    n_bootstrap: int = 1000
    fg_dilation: int = 3
    hist_bins: int = 1024


# The converged run's quick twin (tests), as small as still runs every code path (an ensemble
# and a mixture of Laplaces of two; the nuclei splits cut by :func:`.data.load_converged`).
CONVERGED_QUICK = ConvergedBudget(
    n_train=12,
    n_val=4,
    n_test=6,
    n_eval=6,
    n_shift=4,
    steps=6,
    batch_size=8,
    widths=(4, 8),
    rank=2,
    ensemble=2,
    n_epistemic=2,
    n_aleatoric=2,
    n_val_samples=2,
    prior_exponents=(-2, 0, 2),
    eval_every=2,
    patience=1,
    min_steps=4,
    n_dropout=3,
    n_bootstrap=50,
    hist_bins=64,
)


# BCE foreground weight of every network: the lesions' 1:8 imbalance makes unweighted U-Nets
# and rank-0 SSNs stay at background (``lsn_paper`` Table 1); one factor for all keeps the
# calibration comparison fair (the weighting shifts every method's probabilities alike).
CONVERGED_FACTORS = {"lesions": 4, "nuclei": 1}


def parse_seeds(text: str) -> list[int]:
    """``"0-4"`` -> ``[0, 1, 2, 3, 4]``; ``"0,2"`` -> ``[0, 2]``."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]
