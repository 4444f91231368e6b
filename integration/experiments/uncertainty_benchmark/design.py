"""The uncertainty benchmark's methods: their names, the Laplace arms (posterior, predictive,
prior rule), the posteriors' networks, and the eight networks of a seed."""

from __future__ import annotations

from integration.experiments.kit import ConvergedBudget, NetSpec

ENSEMBLE = "Ensemble (5)"

METHODS = (
    "MAP entropy",
    "MC dropout",
    ENSEMBLE,
    "U-Net + LA (nn)",
    "U-Net + LA (nn, marglik)",
    "U-Net + LA (glm)",
    "U-Net + LA (glm, marglik)",
    "LSN (nn)",
    "LSN (glm)",
    "LSN (glm, marglik)",
    "LSN (diag) (nn)",
    "LSN (diag) (glm)",
)

# Laplace methods: (posterior, predictive, prior). "grid": validation NLL of *that* predictive
# over the prior grid (gridsearch_prior_precision with pred_type); "marglik": laplace-torch's
# marginal likelihood, one scalar (independent of the predictive).
LAPLACE = {
    "U-Net + LA (nn)": ("U-Net + LA", "nn", "grid"),
    "U-Net + LA (nn, marglik)": ("U-Net + LA", "nn", "marglik"),
    "U-Net + LA (glm)": ("U-Net + LA", "glm", "grid"),
    "U-Net + LA (glm, marglik)": ("U-Net + LA", "glm", "marglik"),
    "LSN (nn)": ("LSN", "nn", "grid"),
    "LSN (glm)": ("LSN", "glm", "grid"),
    "LSN (glm, marglik)": ("LSN", "glm", "marglik"),
    "LSN (diag) (nn)": ("LSN (diag)", "nn", "grid"),
    "LSN (diag) (glm)": ("LSN (diag)", "glm", "grid"),
}

# Rows beyond the diagonal (issue 39): computed by :mod:`.more` in a unit of their own, cached
# apart from the rows above (their networks are the same, loaded from the cache).
TTA = "TTA (flips)"
MIXTURE = "Mixture of LA (5)"
LSN_DEMO = "LSN (demo setting)"

MORE_METHODS = (
    TTA,
    "U-Net + LA (kron, nn)",
    "U-Net + LA (kron, glm)",
    "U-Net + LA (kron, glm, marglik)",
    "U-Net + LA (last layer, glm)",
    "U-Net + LA (low rank, glm)",
    LSN_DEMO,
    MIXTURE,
)

# The U-Net posteriors beyond the diagonal: (lsn_ext.Laplace's subset_of_weights,
# hessian_structure), and each method's (posterior, predictive, prior).
STRUCTURES = {
    "kron": ("all", "kron"),
    "last layer": ("last_layer", "full"),
    "low rank": ("all", "lowrank"),
}
MORE_LAPLACE = {
    "U-Net + LA (kron, nn)": ("kron", "nn", "grid"),
    "U-Net + LA (kron, glm)": ("kron", "glm", "grid"),
    "U-Net + LA (kron, glm, marglik)": ("kron", "glm", "marglik"),
    "U-Net + LA (last layer, glm)": ("last layer", "glm", "grid"),
    "U-Net + LA (low rank, glm)": ("low rank", "glm", "grid"),
}

ALL_METHODS = METHODS + MORE_METHODS

POSTERIOR_NETS = {"U-Net + LA": "unet0", "LSN": "ssn", "LSN (diag)": "ssn_diag"}

IMAGE_STATS = "image statistics"

# The same score on the nuclei volume kept on the 2-D training image's intensity scale (the
# volume the models see is standardised by its own statistics, which removes a global intensity
# shift by construction; the lesions' corruptions are applied on the one fixed input scale).
IMAGE_STATS_RAW = "image statistics (training intensity scale)"


def specs(b: ConvergedBudget) -> dict[str, NetSpec]:
    """The networks of a seed: the ensemble's U-Nets (five in a full run, eight networks in
    all), a dropout U-Net, rank-r and rank-0 SSNs."""
    nets = {f"unet{k}": NetSpec("unet", member=k) for k in range(b.ensemble)}
    nets["unet_do"] = NetSpec("unet", dropout=b.dropout)
    nets["ssn"] = NetSpec("ssn", rank=b.rank)
    nets["ssn_diag"] = NetSpec("ssn", rank=0)
    return nets


def more_specs(b: ConvergedBudget) -> dict[str, NetSpec]:
    """The networks of the rows beyond the diagonal: the ensemble's U-Nets, the dropout U-Net,
    and the SSN of the demo's setting (rank ``b.rank``, the per-pixel expected BCE)."""
    nets = {k: v for k, v in specs(b).items() if k.startswith("unet")}
    nets["ssn_expected"] = NetSpec("ssn", rank=b.rank, objective="expected")
    return nets
