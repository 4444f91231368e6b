"""The LSN paper's seven models (arXiv:2303.13123v1): their names, the networks behind them,
the reweighting factors, and each model's three predictives (:func:`models`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from laplace import Laplace
from torch import Tensor, nn

from integration.experiments.kit import (
    Budget,
    Cache,
    Data,
    NetSpec,
    entropy_binary,
    fit_posterior,
)
from lsn_ext import predict
from lsn_ext.lsn import aleatoric_maps, ensemble_predict, mc_dropout_predict, predict_lsn
from lsn_ext.models import SSN

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


@torch.no_grad()
def dropout_total(ssn: SSN, x: Tensor, n_e: int, n_a: int, seed: int) -> tuple[Tensor, Tensor]:
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
    return total, entropy_binary(total)


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
                ale = aleatoric(net, budget)
                tot = lambda x, s, net=net: dropout_total(net, x, n_se, n_sa, s)  # noqa: E731
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

                out[name] = Model(name, epi, aleatoric(net, budget), tot, info)
            else:
                out[name] = Model(name, epi, None, sample_total(epi), info)
    return out


def aleatoric(ssn: SSN, budget: Budget) -> Callable[[Tensor, int], Tensor]:
    def run(x: Tensor, s: int) -> Tensor:
        gen = torch.Generator().manual_seed(s)
        return aleatoric_maps(ssn, x, budget.n_aleatoric, generator=gen)[1]

    return run
