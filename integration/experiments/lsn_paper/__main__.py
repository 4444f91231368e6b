"""The LSN paper's experiments at a scale that fits a 2-core CPU.

The command line: ``python -m integration.experiments.lsn_paper --help`` (or ``./dev bench
lsn_paper``); the experiments are described in :mod:`integration.experiments.lsn_paper`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from pathlib import Path

import torch

from integration.experiments.kit import QUICK, Budget, Cache, parse_seeds, record_time
from integration.experiments.lsn_paper.design import PARTS
from integration.experiments.lsn_paper.report import cost_section, write_report
from integration.experiments.lsn_paper.units import plan, run_unit
from integration.harness import RESULTS


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
    seeds = parse_seeds(args.seeds)
    budget = QUICK if args.quick else Budget()
    nuclei_seeds = parse_seeds(args.nuclei_seeds)
    seeds_of = {"lesions": seeds, "nuclei": nuclei_seeds}
    units = [] if args.report_only else plan(parts, seeds, datasets, budget, seeds_of)
    cache = Cache(args.cache, budget)
    work = [(args.cache, budget, 1, u) for u in units]
    if args.workers > 1 and len(work) > 1:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            for key, dt in pool.imap_unordered(run_unit, work):
                record_time(cache, key, dt)
    else:
        for w in work:
            record_time(cache, *run_unit((*w[:2], torch.get_num_threads(), *w[3:])))
    cost = cost_section(cache, units if units else plan(parts, seeds, datasets, budget, seeds_of))
    path = write_report(cache, parts, seeds, datasets, args.out, cost, nuclei_seeds)
    print(path.read_text())
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
