"""Cost of ``lsn_ext.predict``: time and peak memory against ``n_samples``, sampling and GLM.

Each measurement runs in a fresh subprocess (``spawn``) that fits a diagonal Laplace (BCE,
``DiagBackprop``) and then calls ``predict`` once; the peak resident memory of the subprocess
(``ru_maxrss``) after the fit and after the call gives the memory ``predict`` added. Two
networks: a small CNN of 1,657 parameters (where the draws ``[n, P]`` used to dominate: +90 MB at
n = 20,000 before the draws were chunked) and the LSN paper's U-Net (widths 8-16-32-64-128,
471,409 parameters) on 16 images of 64×64, one thread.

Run: ``./dev bench predict [--quick]``; writes ``integration/results/bench_predict.md``.
"""

from __future__ import annotations

import multiprocessing
import time

import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from integration import harness
from integration.harness import maxrss_bytes, quick_benchmark_main
from lsn_ext.models import UNet

RESULTS = harness.RESULTS / "bench_predict.md"


def _network(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "small CNN":
        net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.Tanh(), nn.Conv2d(16, 8, 3, padding=1),
            nn.Tanh(), nn.Conv2d(8, 1, 3, padding=1),
        )  # fmt: skip
        return net.eval(), torch.randn(16, 3, 32, 32)
    return UNet(3, 1, widths=(8, 16, 32, 64, 128)).eval(), torch.randn(16, 3, 64, 64)


def _measure(args: tuple[str, str, int]) -> dict:
    name, pred_type, n = args
    torch.set_num_threads(1)
    net, x = _network(name)
    y = (torch.rand(x.shape[0], 1, *x.shape[2:]) > 0.8).to(x.dtype)
    la = Laplace(
        net,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
        backend_kwargs={"loss": "bce"},
    )
    la.fit(DataLoader(TensorDataset(x, y), batch_size=16))
    before = maxrss_bytes() / 2**20
    t0 = time.perf_counter()
    lsn_ext.predict(la, x, n, pred_type=pred_type, generator=torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - t0
    after = maxrss_bytes() / 2**20
    return {"params": la.n_params, "seconds": seconds, "added_mb": after - before}


def run(quick: bool) -> str:
    plan = {"small CNN": (100, 2_000, 20_000), "paper U-Net": (16, 64, 256)}
    if quick:  # one row per pred_type: each row is a fresh process (~6 CPU-s, most imports)
        plan = {"small CNN": (4,)}
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for name, counts in plan.items():
        for pred_type in ("nn", "glm"):
            for n in counts:
                with ctx.Pool(1) as pool:
                    r = pool.apply(_measure, ((name, pred_type, n),))
                rows.append(
                    f"| {name} ({r['params']:,} params) | {pred_type} | {n:,} | "
                    f"{r['seconds']:.2f} | {1000 * r['seconds'] / n:.1f} | {r['added_mb']:.0f} |"
                )
    header = (
        "| network | pred_type | n_samples | seconds | ms per sample | peak memory added, MB |\n"
        "|---|---|---:|---:|---:|---:|"
    )
    return (
        "Peak resident memory that one `predict` call adds to a process that has fitted the "
        "posterior (ru_maxrss, fresh process per row), and its time, one thread; 16 images.\n\n"
        + header
        + "\n"
        + "\n".join(rows)
    )


def main(argv: list[str] | None = None) -> None:
    quick_benchmark_main(__doc__, "# predict: time and memory", run, RESULTS, 1, argv)


if __name__ == "__main__":
    main()
