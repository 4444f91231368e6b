"""The Laplace posteriors of the experiments and their prior precisions.

- :func:`laplace_posterior`, :func:`fit_posterior`: a diagonal Laplace posterior (Monte-Carlo or
  DB GGN diagonal) on a U-Net, or the LSN on an SSN's mean network, its prior by validation NLL
  on a grid; cached as laplace-torch's state dict;
- :func:`marglik_prior`, :func:`tune_priors`: laplace-torch's marginal likelihood, and the
  priors of the uncertainty benchmark's Laplace methods;
- :func:`la_predict`: the predictive with Monte-Carlo link approximation.
"""

from __future__ import annotations

import warnings

import torch
from laplace import Laplace
from torch import Tensor, nn

from integration.experiments.kit.budget import ConvergedBudget
from integration.experiments.kit.cache import Cache
from integration.experiments.kit.data import Data, loader
from lsn_ext import BCEWithLogits, DiagBackprop, gridsearch_prior_precision, predict
from lsn_ext.lsn import MeanNetwork, fit_lsn
from lsn_ext.models import SSN


def laplace_posterior(net: nn.Module, factor: float, estimator: str, seed: int) -> Laplace:
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
        la = laplace_posterior(net, factor, estimator, seed)
        state = torch.load(path, weights_only=False)
        la.load_state_dict(state["la"])
        return la, state["info"]
    train = loader(data.train_x, data.train_y, 64)
    if isinstance(net, SSN):
        la = fit_lsn(net, train, pos_weight=factor, estimator=estimator, seed=seed)
    else:
        la = laplace_posterior(net, factor, estimator, seed)
        la.fit(train)
    grid = [10.0**k for k in budget.prior_exponents]
    search = gridsearch_prior_precision(
        la,
        loader(data.val_x, data.val_y),
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


def marglik_prior(la: Laplace, structure: str = "scalar") -> Tensor:
    """Set the prior precision by laplace-torch's marginal likelihood and return a copy of it:
    200 Adam steps of 0.1 on its logarithm from 1, one value (``"scalar"``) or one per layer
    (``"layerwise"``)."""
    with warnings.catch_warnings():  # laplace-torch's link_approx note is for its grid search
        warnings.filterwarnings("ignore", "By default `link_approx`", UserWarning)
        la.prior_precision = 1.0
        la.optimize_prior_precision(
            method="marglik", prior_structure=structure, n_steps=200, lr=0.1
        )
    return la.prior_precision.detach().clone()


def tune_priors(la: object, info: dict, data: Data, b: ConvergedBudget, seed: int) -> dict:
    """The prior precisions of the Laplace methods: the validation-NLL grid of the ``nn``
    predictive (``info``, from :func:`fit_posterior`), the same grid scored with the
    ``glm`` predictive, and laplace-torch's scalar marginal likelihood (one value, used with
    either predictive: ``nn-marglik`` and ``glm-marglik``)."""
    grid = [10.0**k for k in b.prior_exponents]
    search = gridsearch_prior_precision(
        la, loader(data.val_x, data.val_y), grid=grid, n_samples=b.n_val_samples,
        pred_type="glm", seed=seed,
    )  # fmt: skip
    marglik = float(marglik_prior(la))
    la.prior_precision = info["prior_precision"]
    best = grid.index(search.prior_precision)
    return {
        "nn-grid": info["prior_precision"],
        "glm-grid": search.prior_precision,
        "glm-marglik": marglik,
        "nn-marglik": marglik,
        "glm_at_edge": best in (0, len(grid) - 1),
    }


def la_predict(la: object, x: Tensor, n: int, pred_type: str, seed: int) -> object:
    """:func:`lsn_ext.predict` with ``n`` samples, ``pred_type`` and ``link_approx="mc"``."""
    gen = torch.Generator().manual_seed(seed)
    return predict(la, x, n, pred_type=pred_type, link_approx="mc", generator=gen)
