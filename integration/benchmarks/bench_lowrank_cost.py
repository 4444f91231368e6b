"""Cost of the low-rank Laplace per rank on the LSN paper's U-Net at 64², on one CPU thread.

Run ``./dev bench lowrank_cost`` (or ``python -m integration.benchmarks.bench_lowrank_cost``;
about 10 CPU-minutes on one thread of a loaded machine); it writes
``integration/results/lowrank_cost.md``. ``--quick`` runs at 16² with ranks 2 and 4 and prints
the report without writing it.

Workload: ``integration.harness.paper_unet()`` (3 → 1 channels, widths 8-16-32-64-128, 491 137
parameters), float32, random initialisation, eval mode; 16 random images of 64² with Bernoulli(½)
masks (``integration.harness.random_batch``) in 2 batches of 8; summed BCE; one torch thread.
Measured, by wall clock:

- a training step (forward, summed BCE, backward) on each batch: the reference unit;
- one GGN-vector product over the 16 images (:class:`lsn_ext.lowrank.GGNOperator`), 5 times,
  and 3 times by its double-backward fallback;
- the GGN diagonal pass of ``diagonal="ggn"`` (:class:`lsn_ext.DiagBackprop`'s ``diag``, Monte
  Carlo, one draw) over the 16 images, 3 times;
- ``LowRankGGNLaplace(..., backend=DiagBackprop, rank=k).fit`` once per rank (default steps
  ``2k + 10``, diagonal remainder included), with its Lanczos residuals.

The machine's load average is read before and after (other jobs share the cores), and every
repeated timing is given as median with its range: the spread is the noise of this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from integration import harness
from integration.harness import machine, paper_unet, random_batch
from lsn_ext import DiagBackprop
from lsn_ext.lowrank import GGNOperator, LowRankGGNLaplace
from lsn_ext.rules.losses import BCEWithLogits

RESULTS = harness.RESULTS / "lowrank_cost.md"


def _load() -> str:
    with open("/proc/loadavg") as f:
        one, five, fifteen = f.read().split()[:3]
    return f"{one} / {five} / {fifteen} (1 / 5 / 15 min) on {os.cpu_count()} logical CPUs"


def _timed(fn, repeats: int) -> tuple[list[float], list[float]]:
    """Wall-clock and process CPU seconds of ``repeats`` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def _spread(ts: list[float]) -> str:
    return f"{statistics.median(ts):.2f} ({min(ts):.2f}–{max(ts):.2f})"


def run(quick: bool) -> str:
    """The report (module documentation); ``quick``: 16², ranks 2 and 4."""
    torch.set_num_threads(1)
    size, ranks = (16, (2, 4)) if quick else (64, (5, 10, 20, 40))
    load_before = _load()
    torch.manual_seed(0)
    model = paper_unet().eval()
    P = sum(p.numel() for p in model.parameters())
    x, y = random_batch(16, size)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    loss = BCEWithLogits()

    def train_epoch() -> None:
        for xb, yb in loader:
            model.zero_grad()
            loss.value(model(xb), yb).backward()
        model.zero_grad(set_to_none=True)

    _timed(train_epoch, 1)  # warm-up
    train_wall, train_cpu = _timed(train_epoch, 3)
    op = GGNOperator(model, loader, loss)
    v = torch.randn(P, generator=torch.Generator().manual_seed(0))
    op.matvec(v)  # warm-up
    product_wall, product_cpu = _timed(lambda: op.matvec(v), 5)
    op.forward_mode = False  # the fallback for operations without forward-mode AD
    double_wall, double_cpu = _timed(lambda: op.matvec(v), 3)
    backend = DiagBackprop(model, "classification", loss="bce")
    diag_wall, diag_cpu = _timed(lambda: [backend.diag(xb, yb) for xb, yb in loader], 3)
    t_train = statistics.median(train_cpu)
    rows = []
    for k in ranks:
        la = LowRankGGNLaplace(
            model, "classification", backend=DiagBackprop, backend_kwargs={"loss": "bce"}, rank=k
        )
        epoch = statistics.median(_timed(train_epoch, 2)[1])  # beside each fit: drift
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (wall,), (cpu,) = _timed(lambda la=la: la.fit(loader), 1)
        result = la.lowrank_result
        lam = result.eigenvalues
        loose = int((result.residuals > 1e-2 * lam[0]).sum())
        basis_mb = result.steps * P * 4 / 2**20
        rows.append(
            f"| {k} | {result.steps} | {cpu:.1f} | {wall:.1f} | {epoch:.2f} | {cpu / epoch:.0f} | "
            f"{cpu / result.steps:.2f} | {basis_mb:.0f} | {float(lam[0]):.3g} | "
            f"{float(lam[-1]):.3g} | {k - loose} of {k} | {len(caught)} |"
        )
    load_after = _load()
    return "\n".join(
        [
            f"# Low-rank Laplace: cost per rank (paper U-Net, {size}², one CPU thread)",
            "",
            f"Written by `./dev bench lowrank_cost{' --quick' if quick else ''}`.",
            machine(),
            f"Load average before: {load_before}; after: {load_after}. The machine was shared "
            "with other jobs throughout, so wall-clock seconds depend on them; the process's "
            "CPU seconds (`time.process_time`, one thread) much less, and the tables give both, "
            "repeated timings as median (range). Ratios are of CPU seconds to a training epoch "
            "over the same 16 images, measured in the same process beside each fit.",
            "",
            f"Workload: `integration.harness.paper_unet()` ({P} parameters), float32, random "
            f"initialisation, eval mode; 16 random images of {size}² in 2 batches of 8; summed "
            "BCE.",
            "",
            "| over the 16 images | CPU s | wall s | CPU / training epoch |",
            "|---|---|---|---|",
            f"| training epoch (forward + backward, 2 batches) | {_spread(train_cpu)} | "
            f"{_spread(train_wall)} | 1 |",
            f"| one GGN-vector product (`GGNOperator.matvec`) | {_spread(product_cpu)} | "
            f"{_spread(product_wall)} | {statistics.median(product_cpu) / t_train:.2f} |",
            f"| the same by double backward (the fallback) | {_spread(double_cpu)} | "
            f"{_spread(double_wall)} | {statistics.median(double_cpu) / t_train:.2f} |",
            f"| GGN diagonal pass (`DiagBackprop.diag`, MC, 1 draw) | {_spread(diag_cpu)} | "
            f"{_spread(diag_wall)} | {statistics.median(diag_cpu) / t_train:.2f} |",
            "",
            "`LowRankGGNLaplace(model, 'classification', backend=DiagBackprop, backend_kwargs="
            "{'loss': 'bce'}, rank=k).fit(loader)`, once per rank (default `steps = 2k + 10` "
            "Lanczos steps, `diagonal='ggn'`: one diagonal pass included):",
            "",
            "| rank k | Lanczos steps | fit CPU s | fit wall s | training epoch beside it, CPU s "
            "| fit / epoch | CPU s per step | Krylov basis (MiB) | λ₁ | λ_k | pairs with "
            "residual ≤ 0.01 λ₁ | warnings |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "Reading: the fit costs `steps` GGN-vector products (each a pass over the data at "
            "the ratio above) plus one diagonal pass, so it grows linearly in the rank; the "
            "Krylov basis holds `steps × P` float32 numbers. λ and the residuals are those of "
            "a randomly initialised network, whose spectrum differs from a trained one's: the "
            "convergence column says nothing about trained networks.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16², ranks 2 and 4; print only")
    args = parser.parse_args(argv)
    text = run(args.quick)
    print(text)
    if not args.quick:
        RESULTS.write_text(text + "\n")
        print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
