"""Recompute every seed interval of the committed reports from their per-seed CSVs (issue 42).

The reports under ``integration/results/`` were written by scripts whose ``T_975`` table stopped
at 8 degrees of freedom and printed 1.96 z-intervals from 10 seeds on, and printed a score that
is the same on every seed as ``x ± 0.000``. Their caches (networks, per-image values) are not
committed, so the scripts cannot rewrite them without retraining; their per-seed CSVs are. This
script rewrites, in place, every ``mean ± half`` of a report that is a mean over seeds of a series
in the CSV (or a per-seed difference of two series), with :mod:`..tables`' interval:

1. every series (and every per-seed difference of two series with the same metric and context)
   is a candidate for a cell;
2. a cell matches a candidate when the candidate's mean and *old* half-width
   (``T_975`` with the 1.96 fallback, the formula the report was written with) print as the
   cell's digits, so a match also confirms that the committed cell came from the CSV (or the
   new half-width: an already regenerated cell, which then stays as it is);
3. of the matching candidates, those that the cell's row names (its entity, the pair
   ``a − b``, or ``a`` against the report's reference) and whose metric its column (or line)
   names are kept where there are any; a cell whose candidates still give different new text,
   or one that matches nothing but would change (more than 8 degrees of freedom, or a
   half-width printed as 0), is an error.

Bootstrap intervals ``[lo, hi]``, counts ``(k/n above)`` and every other cell are left as they
are (they do not depend on the t quantile). Run: ``python -m
integration.experiments.regenerate_intervals [--check]`` (``--check``: change nothing, exit 1 if a
report would change). Its note in the reports keeps the script's old path, which marks the reports
it rewrote.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from integration.experiments.tables import mean_ci
from integration.harness import RESULTS

# The quantiles the reports were written with (lsn_paper.T_975 before issue 42; 1.96 beyond).
OLD_T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}
NOTE = (
    "Intervals recomputed from the per-seed CSV by `integration/regenerate_intervals.py` "
    "(issue 42): t quantiles for the number of seeds from `scipy.stats.t` (the run printed 1.96 "
    "z-intervals from 10 seeds on), and a score that is the same on every seed without an "
    "interval; every other cell as the run wrote it."
)
CELL = re.compile(r"(?<![\d.])(?P<mean>[+-]?\d+\.(?P<dec>\d+)) ± (?P<half>\d+\.\d+)(?![\d.])")


@dataclass(frozen=True)
class Spec:
    """How one report's per-seed CSV is laid out.

    Attributes:
        csv: The CSV, relative to ``integration/results``.
        entity: Columns naming the model / configuration / rule (what a paired row subtracts).
        context: Columns that a paired difference keeps fixed besides the metric.
        metric: The metric's column; None for a wide CSV (one column per metric).
        ignore: Columns that vary by seed but are no key (e.g. the chosen prior).
        label: An entity's row label in the report, to tell apart cells that print alike.
        row: Rewrites a row's leading cells into those labels (aliases such as "default").
        reference: The entity a paired row is against when the row names only the other one
            (None: the nearest heading "… against X" names it).
        metric_names: A metric's column header, where the headers do not name the CSV's metric.
    """

    csv: str
    entity: tuple[str, ...]
    context: tuple[str, ...]
    metric: str | None
    ignore: tuple[str, ...] = ()
    label: Callable[[tuple], str] = " ".join
    row: Callable[[str], str] = lambda head: head
    reference: tuple[str, ...] | None = None
    metric_names: dict[str, str] | None = None


def _budget(sub: str) -> Spec:
    return Spec(f"{sub}lsn_budget_per_seed.csv", ("model",), ("step_cap",), "metric")


def _ssn(sub: str) -> Spec:
    return Spec(f"{sub}ssn_objective_per_seed.csv", ("config", "rank", "M", "loss"), (), "metric")


DEMO_DEFAULT = "r10 M20 expected BCE"
PRIOR_DEFAULT = ("marglik (scalar)",)


def _demo_label(entity: tuple) -> str:
    """``demo_ssn_loss``'s configuration name (``Config.name``)."""
    rank, samples, loss = entity
    name = f"r{rank} M{samples}"
    return (
        name if samples == "1" else f"{name} {'Eq. 11' if loss == 'logsumexp' else 'expected BCE'}"
    )


def _demo_row(head: str) -> str:
    """The demo's own rows and pairs are rank 10, M = 20; "default" is its default."""
    cells = [c.strip() for c in head.split("|")]
    first = cells[0].replace("default", DEMO_DEFAULT)
    if first in ("Eq. 11", "expected BCE"):
        first = f"r10 M20 {first}"
    elif first == "expected BCE − Eq. 11":
        first = "r10 M20 expected BCE − r10 M20 Eq. 11"
    return " | ".join([first, *cells[1:]])


REPORTS = {
    "demo_ssn_loss.md": Spec(
        "demo_ssn_loss_per_seed.csv",
        ("rank", "samples", "loss"),
        (),
        "measure",
        label=_demo_label,
        row=_demo_row,
    ),
    "lsn_prior.md": Spec(
        "lsn_prior_per_seed.csv", ("rule",), (), "measure", ("prior",), reference=PRIOR_DEFAULT
    ),
    "lsn_prior_expected.md": Spec(
        "lsn_prior_expected_per_seed.csv",
        ("rule",),
        (),
        "measure",
        ("prior",),
        reference=PRIOR_DEFAULT,
    ),
    "lsn_budget.md": _budget(""),
    **{
        f"lsn_budget_{cap}{kind}/lsn_budget.md": _budget(f"lsn_budget_{cap}{kind}/")
        for cap in (128, 512, 2048)
        for kind in ("", "_expected")
    },
    "ssn_objective.md": _ssn(""),
    "ssn_objective_m5/ssn_objective.md": _ssn("ssn_objective_m5/"),
    "ssn_objective_m100/ssn_objective.md": _ssn("ssn_objective_m100/"),
    "uncertainty.md": Spec(
        "uncertainty_per_seed.csv",
        ("method",),
        ("dataset",),
        None,
        metric_names={
            "clean_auroc": "pixel AUROC",
            "clean_aurc": "AURC",
            "clean_e_aurc": "E-AURC",
            "shifted_auroc": "pixel AUROC, shifted",
            "shifted_aurc": "AURC, shifted",
        },
    ),
    "lsn_paper.md": Spec(
        "lsn_paper_per_seed.csv",
        ("model",),
        ("dataset", "part"),
        "metric",
        row=lambda head: re.sub(r" \((lesions|nuclei)\)", "", head),
    ),
}


def series(spec: Spec) -> dict[tuple, dict[int, float]]:
    """``(entity…, context…, metric) → {seed: value}`` from the CSV."""
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    with open(RESULTS / spec.csv, newline="") as f:
        for row in csv.DictReader(f):
            seed = int(row["seed"])
            head = tuple(row[c] for c in (*spec.entity, *spec.context))
            if spec.metric is not None:
                if row["value"] not in ("", "None", "nan"):
                    out[(*head, row[spec.metric])][seed] = float(row["value"])
                continue
            skip = {"seed", *spec.entity, *spec.context, *spec.ignore}
            for col, v in row.items():
                if col not in skip and v not in ("", "None", "nan"):
                    out[(*head, col)][seed] = float(v)
    return dict(out)


def _old(v: tuple[float, ...]) -> tuple[float, float]:
    """Mean and half-width as the reports computed them (torch float64, ``T_975`` or 1.96)."""
    t = torch.tensor(v, dtype=torch.float64)
    if len(t) < 2:
        return t.mean().item(), 0.0
    half = OLD_T_975.get(len(t) - 1, 1.96) * t.std().item() / math.sqrt(len(t))
    return t.mean().item(), half


@dataclass(frozen=True)
class Candidate:
    """A series over seeds: one entity's metric (``b`` None) or the difference ``a − b``."""

    a: tuple[str, ...]
    b: tuple[str, ...] | None
    metric: str
    values: tuple[float, ...]

    @property
    def label(self) -> str:
        name = " ".join(self.a) + ("" if self.b is None else " − " + " ".join(self.b))
        return f"{name}: {self.metric}"


def candidates(spec: Spec) -> list[Candidate]:
    """Every series and every per-seed difference of two series of one metric and context."""
    data = series(spec)
    n_e = len(spec.entity)
    out = [Candidate(k[:n_e], None, k[-1], tuple(v[s] for s in sorted(v))) for k, v in data.items()]
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for k in data:
        groups[k[n_e:]].append(k)
    for keys in groups.values():
        for a in keys:
            for b in keys:
                if a == b:
                    continue
                seeds = sorted(set(data[a]) & set(data[b]))
                if len(seeds) > 1:
                    diff = tuple(data[a][s] - data[b][s] for s in seeds)
                    out.append(Candidate(a[:n_e], b[:n_e], a[-1], diff))
    return out


def _prints_as(x: float, text: str, digits: int) -> bool:
    """``x`` printed with ``digits`` decimals is ``text`` (a leading ``+`` kept as printed)."""
    return f"{x:{'+' if text.startswith('+') else ''}.{digits}f}" == text


def _named(metric: str, line: str, header: str, spec: Spec) -> bool:
    """Whether the cell's column header (or, without a name map, its line) names ``metric``."""
    if spec.metric_names:
        return spec.metric_names.get(metric) == header.strip()
    norm = lambda t: re.sub(r"[^a-z0-9]+", " ", t.lower()).strip()  # noqa: E731
    return norm(metric) in norm(line + " " + header)


def _heading_reference(lines: list[str], i: int) -> tuple[str, ...] | None:
    """``X`` of the nearest heading above line ``i`` that reads "… against X"."""
    for line in reversed(lines[:i]):
        if line.startswith("#"):
            return (line.split("against ", 1)[1].strip(),) if "against " in line else None
    return None


def _in_row(c: Candidate, head: str, spec: Spec, reference: tuple[str, ...] | None) -> bool:
    """Whether the row's leading cells name the candidate: ``a``, ``a − b``, or ``a`` alone
    for a difference against the report's reference."""
    cells = [x.strip() for x in head.split("|")]
    if c.b is None:
        return spec.label(c.a) in cells
    if f"{spec.label(c.a)} − {spec.label(c.b)}" in cells:
        return True
    return c.b == reference and spec.label(c.a) in cells


def _header_of(lines: list[str], i: int, m: re.Match, line: str) -> str:
    """The header cell of the column of match ``m`` in table line ``i`` ('' if none)."""
    col = line[: m.start()].count("|") - 1
    j = i
    while j > 0 and lines[j - 1].startswith("|"):
        j -= 1
    cells = lines[j].strip().strip("|").split("|")
    return cells[col] if lines[i].startswith("|") and col < len(cells) else ""


def regenerate(report: str, spec: Spec) -> tuple[str, list[str]]:
    """The report's text with every seed interval recomputed; the list of changes."""
    path = RESULTS / report
    lines = path.read_text().split("\n")
    cands = [(c, *_old(c.values)) for c in candidates(spec)]
    z_cells = max(len(c.values) for c, *_ in cands) - 1 > max(OLD_T_975)
    by_mean: dict[int, dict[str, list[tuple[Candidate, float]]]] = {}
    new_half: dict[Candidate, float] = {}

    def near(mean: str, digits: int) -> list[tuple[Candidate, float]]:
        """The candidates (in order) whose mean prints as ``mean`` with ``digits`` decimals,
        with their old half-widths: an index per number of decimals, so that a cell looks up
        its few candidates instead of printing every one's mean (thousands per report)."""
        if digits not in by_mean:
            index = by_mean[digits] = defaultdict(list)
            for c, mu, half in cands:
                index[f"{mu:.{digits}f}"].append((c, half))
        # "+x" prints x ≥ 0 with its sign: the same candidates as "x" (a negative one is "-…")
        return by_mean[digits].get(mean.removeprefix("+"), [])

    def half_of(c: Candidate) -> float:
        """The t-interval half-width (computed once, for the candidates a cell looks at)."""
        if c not in new_half:
            new_half[c] = mean_ci(c.values).half
        return new_half[c]

    changes, problems = [], []
    for i, line in enumerate(lines):

        def repl(m: re.Match, i: int = i, line: str = line) -> str:
            digits, text = len(m["dec"]), m.group(0)
            hits = [
                c
                for c, half in near(m["mean"], digits)
                if _prints_as(half, m["half"], digits) or _prints_as(half_of(c), m["half"], digits)
            ]
            sign = m["mean"].startswith("+")
            if line.startswith("|"):
                head = spec.row(" | ".join(line.strip().strip("|").split("|")[:2]))
            else:  # prose: "- rule: Δ measure m ± h, …"; the rule is named before the cell
                head = line[: m.start()].split(":")[0].lstrip("- ").strip()
            header = _header_of(lines, i, m, line)
            reference = spec.reference or _heading_reference(lines, i)
            for keep in (
                lambda c: _in_row(c, head, spec, reference),
                lambda c: _named(c.metric, line, header, spec),
            ):
                hits = [c for c in hits if keep(c)] or hits  # the row's own series if named
            new = {mean_ci(c.values).fmt(digits, sign) for c in hits}
            if float(m["mean"]) == float(m["half"]) == 0:
                return text  # 0 ± 0 at the printed digits: no interval to regenerate
            if len(new) == 1:
                (out,) = new
                if out != text:
                    changes.append(f"{report}:{i + 1}: {text} → {out}  ({hits[0].label})")
                return out
            if len(new) > 1 and text in new:
                return text  # already one of its candidates' intervals
            if len(new) > 1:
                problems.append(f"{report}:{i + 1}: {text} is ambiguous: {new}")
            elif float(m["half"]) == 0 or z_cells:
                problems.append(f"{report}:{i + 1}: {text} matches no series of {spec.csv}")
            return text

        lines[i] = CELL.sub(repl, line)
    if problems:
        raise SystemExit("cannot regenerate:\n" + "\n".join(problems))
    if changes and NOTE not in lines:
        at = next((k for k, ln in enumerate(lines) if ln.startswith("Generated by")), 0)
        lines[at + 1 : at + 1] = ["", NOTE]
    return "\n".join(lines), changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; 1 if stale")
    parser.add_argument("reports", nargs="*", help=f"default: all of {list(REPORTS)}")
    args = parser.parse_args(argv)
    stale = 0
    for report in args.reports or REPORTS:
        text, changes = regenerate(report, REPORTS[report])
        print(f"{report}: {len(changes)} cells {'to change' if args.check else 'changed'}")
        for c in changes:
            print("  " + c)
        if changes and not args.check:
            (RESULTS / report).write_text(text)
        stale += bool(changes)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
