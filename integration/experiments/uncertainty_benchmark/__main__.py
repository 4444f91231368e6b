"""Failure detection and calibration of segmentation uncertainty, with converged networks.

The command line: ``python -m integration.experiments.uncertainty_benchmark --help`` (or
``./dev bench uncertainty_benchmark``); the benchmark is described in
:mod:`integration.experiments.uncertainty_benchmark`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import torch

from integration.experiments.kit import (
    CONVERGED_QUICK,
    ConvergedBudget,
    ConvergedCache,
    parse_seeds,
    record_time,
)
from integration.experiments.uncertainty_benchmark.more import UNIT_KINDS, run_any
from integration.experiments.uncertainty_benchmark.report import write_report
from integration.harness import RESULTS


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default=None, help="e.g. 0-4 or 0,2 (default 0-4; quick 0,1)")
    parser.add_argument("--datasets", default="lesions,nuclei")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--cache", type=Path, default=None, help="default results/.cache/...")
    parser.add_argument("--out", type=Path, default=None, help="default integration/results")
    parser.add_argument("--quick", action="store_true", help="tiny sizes into a temporary dir")
    parser.add_argument("--report-only", action="store_true", help="only write the report")
    parser.add_argument(
        "--rows",
        default="base,more",
        help="which units to run: base (the diagonal Laplace, LSN, dropout, ensemble rows) "
        "and/or more (TTA, Kron, last layer, low rank, the demo's LSN, mixture of Laplaces)",
    )
    args = parser.parse_args(argv)
    budget = CONVERGED_QUICK if args.quick else ConvergedBudget()
    seeds = parse_seeds(args.seeds or ("0,1" if args.quick else "0-4"))
    datasets = [d for d in args.datasets.split(",") if d]
    unknown = sorted(set(datasets) - {"lesions", "nuclei"})
    if unknown:
        parser.error(f"unknown data sets {unknown}; use lesions and/or nuclei")
    rows = [r for r in args.rows.split(",") if r]
    if not rows or set(rows) - set(UNIT_KINDS):
        parser.error(f"--rows takes base and/or more, got {args.rows!r}")
    tmp = Path(tempfile.mkdtemp(prefix="uncertainty-")) if args.quick else None
    out = args.out or (tmp if tmp else RESULTS)
    root = args.cache or ((tmp / "cache") if tmp else RESULTS / ".cache" / "uncertainty")
    cache = ConvergedCache(root, budget)
    units = [] if args.report_only else [(d, s) for d in datasets for s in seeds]
    work = [(kind, root, budget, 1, u) for kind in rows for u in units]
    t0 = time.perf_counter()
    if args.workers > 1 and len(work) > 1:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            for key, dt in pool.imap_unordered(run_any, work):
                record_time(cache, key, dt)
    else:
        for w in work:
            record_time(cache, *run_any((*w[:3], torch.get_num_threads(), w[4])))
    if units:
        print(f"[uncertainty] all units: {time.perf_counter() - t0:.0f} s wall", flush=True)
    path = write_report(cache, datasets, seeds, out, args.quick)
    print(path.read_text())
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
