"""Data-parallel Laplace fits: 1 against 2 processes, the all-reduce's cost, and a 3-D estimate.

Run from the repository root::

    ./dev bench distributed            # about 1 minute on 2 cores
    ./dev bench distributed --quick    # a smoke run

**A. Measured (gloo, CPU, one thread per process).** The LSN paper's U-Net (491k parameters),
160 nuclei patches of 64×64 (``lsn_ext.data.nuclei_patches``), batch 8 per process, BCE,
``Laplace(..., backend=DiagBackprop).fit`` with ``estimator="db"`` and ``"mc"``, in 1 and in 2
spawned processes (each rank a ``DistributedSampler`` shard; 127.0.0.1 only). Reported: the fit's
wall time (the slowest rank), the time per image, the speed-up, and the cost of the backend's
per-batch all-reduce measured on its own (a float32 tensor of the parameter count + 2, median of
20 calls) as a share of a batch's fit time. On this 2-core machine two processes share the cores
with nothing else; the all-reduce goes through loopback TCP.

**B. Extrapolated: 1,000 volumes of 128³ on 8 GPUs.** The paper's U-Net widened to 3-D (3×3×3
convolutions, the same widths, max pooling, nearest upsampling, tanh), one channel in, BCE.
Measured here: the forward FLOPs per voxel (counted from the convolution shapes) and, on this CPU
at 32³, the time of one DB fit step (forward + DB backward) relative to one forward pass.
Assumed, not measured: a sustained 15 TFLOP/s (optimistic) or 2 TFLOP/s (pessimistic: the thin
8–16-channel levels at 128³ are memory-bound) per GPU for these float32 convolutions (an H100's
float32 peak without tensor cores is about 67 TFLOP/s) and an all-reduce bandwidth of 100 GB/s
per GPU (NVLink ring). The result is a planning figure, not a measurement: run
``integration/checks/distributed_fit.py`` under ``torchrun`` on the target machine for a real one.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import lsn_ext
from integration import harness
from integration.harness import report
from lsn_ext.data import nuclei_patches
from lsn_ext.models import UNet

RESULTS = harness.RESULTS / "bench_distributed.md"
# Sustained float32 throughput per GPU: optimistic (compute-bound) and pessimistic (the thin
# 8-16-channel levels at 128³ are memory-bound).
GPU_FLOPS = (15e12, 2e12)
GPU_BANDWIDTH, GPUS, VOLUMES, SIDE = 100e9, 8, 1000, 128


def _fit_worker(rank: int, world: int, port: int, estimator: str, images: int, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    try:
        from laplace import Laplace

        torch.manual_seed(0)
        model = UNet(1, 1).eval()
        splits = nuclei_patches(64, 32, dtype=torch.float32)
        data = Subset(TensorDataset(splits.train_x, splits.train_y), range(images))
        loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))
        la = Laplace(
            model, "classification", subset_of_weights="all", hessian_structure="diag",
            backend=lsn_ext.DiagBackprop,
            backend_kwargs={"loss": "bce", "estimator": estimator},
        )  # fmt: skip
        dist.barrier()
        t0 = time.perf_counter()
        la.fit(loader)
        fit_s = time.perf_counter() - t0
        payload = torch.zeros(sum(p.numel() for p in model.parameters()) + 2)
        comm = []
        for _ in range(21):
            dist.barrier()
            t1 = time.perf_counter()
            dist.all_reduce(payload)
            comm.append(time.perf_counter() - t1)
        slowest = torch.tensor([fit_s])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            out.put(
                {
                    "fit_s": float(slowest),
                    "batches": len(loader),
                    "allreduce_s": statistics.median(comm[1:]) if world > 1 else 0.0,
                    "h_sum": float(la.H.sum()),
                }
            )
    finally:
        dist.destroy_process_group()


def _fit(world: int, estimator: str, images: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(
        _fit_worker, args=(world, port, estimator, images, out), nprocs=world, start_method="spawn"
    )
    return out.get(timeout=10)


def part_a(quick: bool) -> str:
    images = 16 if quick else 160
    rows = [
        "## A. Measured: 1 and 2 processes (gloo, CPU)",
        "",
        f"The paper's U-Net, {images} nuclei patches of 64², batch 8 per process, BCE.",
        "",
        "| estimator | processes | fit (s) | ms per image | speed-up | all-reduce per batch (ms) "
        "| all-reduce share of a batch | Σ H |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for estimator in ("db", "mc"):
        one = _fit(1, estimator, images)
        two = _fit(2, estimator, images)
        for world, r in ((1, one), (2, two)):
            per_batch = r["fit_s"] / r["batches"]
            share = r["allreduce_s"] / per_batch if world > 1 else 0.0
            rows.append(
                f"| {estimator} | {world} | {r['fit_s']:.2f} | {1e3 * r['fit_s'] / images:.1f} | "
                f"{one['fit_s'] / r['fit_s']:.2f}× | {1e3 * r['allreduce_s']:.2f} | "
                f"{100 * share:.1f}% | {r['h_sum']:.6g} |"
            )
    return "\n".join(rows)


def unet3d(widths: tuple[int, ...] = (8, 16, 32, 64, 128)) -> nn.Module:
    """The paper's U-Net with 3-D layers (3×3×3 convolutions, tanh, max pooling, nearest)."""

    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv3d(c_in, c_out, 3, padding=1), nn.Tanh(),
            nn.Conv3d(c_out, c_out, 3, padding=1), nn.Tanh(),
        )  # fmt: skip

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = nn.ModuleList(
                block(1 if i == 0 else widths[i - 1], w) for i, w in enumerate(widths)
            )
            self.up = nn.ModuleList(
                block(widths[i] + widths[i + 1], widths[i]) for i in range(len(widths) - 1)
            )
            self.pool, self.upsample = nn.MaxPool3d(2), nn.Upsample(scale_factor=2)
            self.head = nn.Conv3d(widths[0], 1, 1)

        def forward(self, x):
            skips = []
            for i, b in enumerate(self.down):
                x = b(x if i == 0 else self.pool(x))
                skips.append(x)
            for i in reversed(range(len(self.up))):
                x = self.up[i](torch.cat([skips[i], self.upsample(x)], 1))
            return self.head(x)

    return Net()


def _forward_flops(model: nn.Module, x: torch.Tensor) -> float:
    flops = [0.0]

    def hook(m: nn.Conv3d, _inp, out: torch.Tensor) -> None:
        k = m.kernel_size[0] * m.kernel_size[1] * m.kernel_size[2]
        flops[0] += 2.0 * m.in_channels * k * out.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv3d)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return flops[0]


def part_b(quick: bool) -> str:
    torch.set_num_threads(2)
    side = 16 if quick else 32
    torch.manual_seed(0)
    model = unet3d().eval()
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(1, 1, side, side, side)
    y = (torch.rand(1, 1, side, side, side) > 0.8).float()
    flops_per_voxel = _forward_flops(model, x) / side**3

    def timed(fn, reps: int = 3) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    with torch.no_grad():
        fwd = timed(lambda: model(x))
    db = timed(lambda: lsn_ext.ggn_diagonal(model, x, y, "bce", estimator="db"))
    mc = timed(lambda: lsn_ext.ggn_diagonal(model, x, y, "bce", estimator="mc"))
    voxels = VOLUMES * SIDE**3
    rows = [
        "## B. Extrapolated: 1,000 volumes of 128³ on 8 GPUs",
        "",
        f"Measured on this CPU (one {side}³ volume, float32): the 3-D U-Net has {n_params:,} "
        f"parameters and {flops_per_voxel / 1e3:.1f} kFLOP per voxel in the forward pass; "
        f"forward {1e3 * fwd:.0f} ms, DB fit step {1e3 * db:.0f} ms ({db / fwd:.2f}× forward), "
        f"Monte-Carlo step {1e3 * mc:.0f} ms ({mc / fwd:.2f}× forward). Assumed: "
        f"{' or '.join(f'{f / 1e12:.0f}' for f in GPU_FLOPS)} TFLOP/s sustained per GPU, "
        f"{GPU_BANDWIDTH / 1e9:.0f} GB/s all-reduce bandwidth, one volume per GPU per batch.",
        "",
        "| estimator | FLOP (forward × measured ratio) | TFLOP/s per GPU | GPU-hours in total "
        "| wall time on 8 GPUs | all-reduce per batch | all-reduce in total |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    batches = VOLUMES / GPUS
    message = 4 * (n_params + 2)
    allreduce = 2 * (GPUS - 1) / GPUS * message / GPU_BANDWIDTH
    for name, ratio in (("db", db / fwd), ("mc", mc / fwd)):
        total = voxels * flops_per_voxel * ratio
        for rate in GPU_FLOPS:
            seconds = total / rate
            wall = seconds / GPUS + batches * allreduce
            rows.append(
                f"| {name} | {total:.3g} | {rate / 1e12:.0f} | {seconds / 3600:.3f} | "
                f"{wall / 60:.1f} min | {1e3 * allreduce:.3f} ms | {batches * allreduce:.2f} s |"
            )
    rows += [
        "",
        "The fit is a sum over volumes, so it scales with the GPUs until the all-reduce of the "
        f"{message / 1e6:.1f} MB curvature vector per batch matters, which at these sizes it "
        "does not. Memory, not time, decides the batch: a 128³ volume through this network "
        "keeps about as many activations as a training step (DB's peak is 1.16× a training "
        "step's in `./dev bench db`).",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    args = parser.parse_args(argv)
    report(
        "# Data-parallel Laplace fits",
        lambda: part_a(args.quick) + "\n\n" + part_b(args.quick),
        args.quick,
        RESULTS,
    )


if __name__ == "__main__":
    main()
