"""The report's parts on the rows beyond the diagonal (:mod:`.more`): what they are, the
issue's question in one table (each against the MAP's entropy and the ensemble), their priors,
and the cost of every method."""

from __future__ import annotations

from integration.experiments.tables import fmt, table
from integration.experiments.uncertainty_benchmark.design import (
    ENSEMBLE,
    LSN_DEMO,
    MIXTURE,
    MORE_LAPLACE,
    TTA,
)
from integration.experiments.uncertainty_benchmark.more import LSN_DEMO_ALEATORIC

QUESTION = (
    ("shifted_auroc", "pixel AUROC, shifted"),
    ("aurc_fg", "AURC, fg score (clean)"),
    ("shifted_aurc", "AURC, shifted"),
)


def costed(ensemble: int) -> dict[str, tuple[tuple[str, ...], str | None, str | None]]:
    """method → (networks trained for it, the clock entry of its fit, of its prior choice),
    with ``ensemble`` members (the budget's; 5 in a full run)."""
    members = tuple(f"unet{k}" for k in range(ensemble))
    return {
        "MAP entropy": (("unet0",), None, None),
        TTA: (("unet0",), None, None),
        "MC dropout": (("unet_do",), None, None),
        ENSEMBLE: (members, None, None),
        "U-Net + LA (glm)": (("unet0",), "U-Net + LA (glm)", "U-Net + LA (glm)"),
        **{m: (("unet0",), MORE_LAPLACE[m][0], m) for m in MORE_LAPLACE},
        LSN_DEMO: (("ssn_expected",), LSN_DEMO, LSN_DEMO),
        MIXTURE: (members, MIXTURE, MIXTURE),
    }


def description(rep: object) -> str:
    """The rows beyond the diagonal, for the report's introduction."""
    b = rep.b
    return (
        "**Rows beyond the diagonal** (`more.py`, same networks and test images): "
        f"`{TTA}`: the MAP U-Net averaged over the identity and the horizontal, vertical and "
        "double flips of the image (variance and mutual information over the four); "
        '`U-Net + LA (kron, …)`: `lsn_ext.Laplace(unet, "classification", "all", '
        '"kron")`, KFAC over all weights (KFAC-expand, G from the BCE\'s exact Hessian '
        "square root), the prior by the validation NLL of the `nn` or `glm` predictive or by "
        "laplace-torch's scalar marglik; `U-Net + LA (last layer, glm)`: the 1×1 head's full "
        'GGN (`"last_layer", "full"`), the per-pixel logit variance in closed form, sampled '
        "for the link; `U-Net + LA (low rank, glm)`: a rank-"
        f"{b.rank} Lanczos eigenbasis of the GGN plus its Monte-Carlo diagonal outside it "
        '(`"all", "lowrank"`); '
        f"`{LSN_DEMO}`: the demo's recommendation — an SSN (rank {b.rank}) trained with the "
        "per-pixel expected BCE instead of Eq. 11 (`ssn_loss` objective `expected`, early "
        "stopping as the others), the diagonal LSN posterior with laplace-torch's scalar "
        f"marglik prior, `nn` predictive with {LSN_DEMO_ALEATORIC} logit samples per posterior "
        f"sample; `{MIXTURE}`: one diagonal Laplace per ensemble member, each built as "
        "`U-Net + LA (glm)` (its own prior by validation NLL), the predictive the average of "
        f"the five `glm` predictives ({b.n_epistemic} samples each; `Var p` by the law of total "
        "variance, mutual information against the members' and samples' mean entropy)."
    )


def section_question(rep: object, d: str) -> str:
    """Each posterior beyond the diagonal, the diagonal one, TTA and the mixture against the
    MAP's entropy and the ensemble, on the issue's measures."""
    methods = ["U-Net + LA (glm)", *MORE_LAPLACE, LSN_DEMO, TTA, MIXTURE]
    rows = []
    for m in methods:
        row = [m]
        for ref in ("MAP entropy", ENSEMBLE):
            row += [rep.paired(d, m, ref, k) for k, _ in QUESTION]
        rows.append(row)
    header = ["Method"] + [f"{h} − {ref}" for ref in ("MAP", "ensemble") for _, h in QUESTION]
    return f"### {d}\n\n" + table(header, rows)


def section_priors(rep: object) -> str:
    """The prior precisions the rows beyond the diagonal chose."""
    rows = []
    for d in rep.datasets:
        priors = [rep.res[d, s]["more"]["priors"] for s in rep.seeds]
        members = [f"{MIXTURE} member {k}" for k in range(rep.b.ensemble)]
        names = [*MORE_LAPLACE, LSN_DEMO, *members]
        for name in names:
            values = [p[name]["prior_precision"] for p in priors]
            edge = sum(p[name]["at_edge"] for p in priors)
            rows.append(
                [f"{d}: {name}", f"{min(values):.1e} … {max(values):.1e}", f"{edge}/{len(values)}"]
            )
    return table(["posterior", "prior precision (range over seeds)", "at grid edge"], rows)


def section_cost(rep: object) -> str:
    """CPU minutes per method: training, posterior fit, prior choice, predicting."""
    rows = []
    for d in rep.datasets:
        for m, (nets, fit, prior) in costed(rep.b.ensemble).items():
            per_seed = {"train": [], "fit": [], "prior": [], "predict": []}
            for s in rep.seeds:
                more = rep.res[d, s]["more"]
                records = rep.res[d, s]["nets"] | more["nets"]
                cost = more["cost_cpu_s"]
                per_seed["train"].append(sum(records[k]["seconds"] for k in nets) / 60)
                per_seed["fit"].append(cost[fit]["fit"] / 60 if fit else 0.0)
                per_seed["prior"].append(cost[prior]["prior"] / 60 if prior else 0.0)
                per_seed["predict"].append(cost[m]["predict"])
            total = [
                t + f + p + q / 60
                for t, f, p, q in zip(*(per_seed[k] for k in per_seed), strict=True)
            ]
            rows.append(
                [f"{d}: {m}"]
                + [fmt(per_seed[k], 2) for k in ("train", "fit", "prior")]
                + [fmt(per_seed["predict"], 1), fmt(total, 2)]
            )
    header = [
        "method",
        "training, min",
        "posterior fit, CPU min",
        "prior choice, CPU min",
        "predict clean test images, CPU s",
        "total, min",
    ]
    return (
        table(header, rows)
        + "\n\nMean ± 95 % t-interval over seeds. Training: the wall-clock minutes recorded when "
        "each network was trained (one torch thread per unit, two units side by side on the 2 "
        "cores: close to CPU minutes), summed over the networks a method needs. Fit, prior and "
        "predict: CPU time (`time.process_time`) of the unit's process with one torch thread. "
        "The kron rows share one fit (each its own prior); `U-Net + LA (glm)` is timed on the "
        "mixture's first member, which is built the same way; the mixture's fit and prior are "
        "the sum over its five members. The shared 2-core machine ran other jobs throughout: "
        "CPU time is less affected by them than wall time, not unaffected.\n"
    )
