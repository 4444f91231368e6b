"""Paired per-seed differences of the uncertainty benchmark, from its committed per-seed CSV.

``uncertainty.md`` pairs every method with the MAP entropy and the ensemble on the whole-image
score (AURC, E-AURC) and the pooled pixel measures, but not on the score the README recommends
for images, the mean entropy within the dilated predicted foreground (``*_fg``), nor per
shift. Its caches are not committed; its per-seed values are (``uncertainty_per_seed.csv``). This
script computes, from that CSV alone and with :mod:`..tables`, the per-seed differences
``method − reference`` (mean ± 95 % t-interval over the seeds, and k/n = better on k of n seeds)
against the MAP entropy, the ensemble and U-Net + LA (``nn``) for those measures, and writes
``integration/results/uncertainty_paired.md``. No interval over test images: the per-image
values are in the uncached results only.

Run: ``python -m integration.experiments.uncertainty_paired`` (or ``./dev bench
uncertainty_paired``).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from integration.experiments.tables import paired
from integration.harness import RESULTS

SOURCE = RESULTS / "uncertainty_per_seed.csv"
# column, header, higher is better
IMAGE = (
    ("clean_aurc_fg", "AURC, fg score", False),
    ("clean_e_aurc_fg", "E-AURC, fg score", False),
    ("clean_spearman_fg", "Spearman (fg score, Dice)", False),
    ("clean_aurc", "AURC, whole-image score (not to use)", False),
)
PIXEL = (
    ("clean_auroc", "pixel AUROC", True),
    ("clean_ece", "ECE", False),
    ("shifted_auroc", "pixel AUROC on shifted", True),
)
SHIFT = {
    "lesions": ("blur", "contrast", "noise", "intensity"),
    "nuclei": ("volume",),
}
REFERENCES = ("MAP entropy", "Ensemble (5)", "U-Net + LA (nn)")
BOX = ("LSN (nn)", ("MC dropout", "Ensemble (5)", "U-Net + LA (nn)"))


def load(path: Path = SOURCE) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """``(dataset, method) → {seed: {column: value}}`` (empty cells left out)."""
    out: dict = defaultdict(dict)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values = {
                k: float(v)
                for k, v in row.items()
                if k not in ("dataset", "seed", "method") and v not in ("", "None")
            }
            out[row["dataset"], row["method"]][int(row["seed"])] = values
    return dict(out)


def cell(data: dict, d: str, method: str, ref: str, column: str, hib: bool) -> str:
    """``+d ± h (k/n)`` of ``method − ref`` over the seeds where both have ``column``."""
    if method == ref:
        return "—"
    a, b = data[d, method], data[d, ref]
    seeds = sorted(s for s in set(a) & set(b) if column in a[s] and column in b[s])
    if len(seeds) < 2:
        return "n/a"
    p = paired([a[s][column] for s in seeds], [b[s][column] for s in seeds], hib)
    return f"{p.diff.fmt(4, sign=True)} ({p.count})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(data: dict) -> str:
    datasets = sorted({d for d, _ in data})
    # the image-statistics scores rank images only (no pixel maps, no foreground score)
    methods = [m for m in dict.fromkeys(m for _, m in data) if not m.startswith("image statistics")]
    parts = [
        "# Uncertainty benchmark: paired differences on the foreground score and per shift",
        "Computed by `integration/experiments/uncertainty_paired.py` from "
        "`uncertainty_per_seed.csv` (the run of `uncertainty.md`; nothing retrained). Each cell: "
        "per-seed difference method − reference, mean ± 95 % t-interval over the seeds "
        "(`integration/experiments/tables.py`), then "
        "(k/n) = better on k of n seeds (lower for AURC, E-AURC, Spearman and ECE; higher for "
        "AUROCs and the Box Ratio). A difference whose interval includes 0 is no measured "
        "difference. The foreground score (mean entropy within the dilated predicted "
        "foreground) is the image score to use; the whole-image mean is shown for comparison "
        "and is the score not to use (it ranks images by object size). Shifts: the lesions' "
        "four are synthetic corruptions of synthetic images; the nuclei's is the synthetic "
        "3-D volume standardised by its own statistics.",
    ]
    for d in datasets:
        for ref in REFERENCES:
            cols = [*IMAGE, *PIXEL]
            cols += [(f"shift_auroc_fg_{k}", f"shift AUROC, fg score: {k}", True) for k in SHIFT[d]]
            rows = [
                [m] + [cell(data, d, m, ref, c, hib) for c, _, hib in cols]
                for m in methods
                if (d, m) in data
            ]
            parts += [
                f"## {d}: against {ref}",
                _table(["Method − " + ref] + [h for _, h, _ in cols], rows),
            ]
    lsn, refs = BOX
    rows = [
        [f"{lsn} − {ref}"] + [cell(data, d, lsn, ref, "box_ratio_noise", True) for d in datasets]
        for ref in refs
    ]
    parts += [
        "## Box Ratio (noise box), the LSN against the others",
        _table(["pair"] + [f"Box Ratio noise ({d})" for d in datasets], rows),
    ]
    return "\n\n".join(parts) + "\n"


def main() -> Path:
    path = RESULTS / "uncertainty_paired.md"
    path.write_text(report(load()))
    print(path.read_text())
    return path


if __name__ == "__main__":
    main()
