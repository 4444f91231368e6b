"""A data-parallel LSN fit on nuclei patches: two CPU processes (gloo) agree with one process.

Run from the repository root::

    .venv/bin/python -m integration.checks.distributed_fit                 # spawns 2 gloo processes
    .venv/bin/python -m integration.checks.distributed_fit --estimator mc
    torchrun --nproc-per-node 2 -m integration.checks.distributed_fit      # the same under torchrun

Each rank builds the same SSN (``SSN.with_unet``, seeded; untrained: this shows the mechanics,
not a calibrated posterior), loads the 32×32 nuclei training patches, and fits
:func:`lsn_ext.lsn.fit_lsn` on its ``DistributedSampler`` shard. The backend all-reduces every
batch's curvature and loss, so both ranks hold the posterior of the whole training set. The
script gathers ``H`` from both ranks and prints that they agree, tunes the prior by marginal
likelihood on every rank (the same value), and on rank 0 compares with a single-process fit
over all patches (``distributed=False`` on the full loader): equal to round-off for
``--estimator db``, equal in expectation for ``mc`` (the ranks draw independent vectors).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from lsn_ext.data.nuclei import nuclei_patches
from lsn_ext.lsn import fit_lsn
from lsn_ext.models import SSN


def _setup(n_images: int) -> tuple[SSN, TensorDataset]:
    torch.manual_seed(0)
    ssn = SSN.with_unet(1, num_classes=1, widths=(8, 16, 32), rank=2).eval()
    splits = nuclei_patches(size=32, stride=32)
    data = TensorDataset(splits.train_x, splits.train_y)
    return ssn, Subset(data, range(min(n_images, len(data))))


def _run(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ssn, data = _setup(args.images)
    n = len(data) - len(data) % world  # a DistributedSampler must not pad or drop
    data = Subset(data, range(n))
    loader = DataLoader(
        data, batch_size=args.batch_size, sampler=DistributedSampler(data, shuffle=False)
    )
    t0 = time.perf_counter()
    la = fit_lsn(ssn, loader, estimator=args.estimator, seed=0)
    fit_s = time.perf_counter() - t0
    la.optimize_prior_precision(method="marglik", n_steps=100)

    H = [torch.empty_like(la.H) for _ in range(world)]
    dist.all_gather(H, la.H)
    prior = [torch.empty_like(la.prior_precision) for _ in range(world)]
    dist.all_gather(prior, la.prior_precision)
    print(
        f"rank {rank}: {len(loader.sampler)} of {n} images, n_data={la.n_data}, "
        f"loss={float(la.loss):.6f}, sum H={la.H.sum():.6e}, "
        f"prior={la.prior_precision.item():.6g}, fit {fit_s:.2f} s",
        flush=True,
    )
    dist.barrier()
    if rank != 0:
        return
    agree = all(torch.equal(h, H[0]) for h in H) and all(torch.equal(p, prior[0]) for p in prior)
    print(f"all {world} ranks hold identical H and prior precision: {agree}")
    full = DataLoader(data, batch_size=args.batch_size)
    single = fit_lsn(ssn, full, estimator=args.estimator, distributed=False)
    rel = ((la.H - single.H).norm() / single.H.norm()).item()
    what = "round-off" if args.estimator == "db" else "Monte-Carlo noise (independent vectors)"
    print(
        f"single process over all {n} images: n_data={single.n_data}, "
        f"loss={float(single.loss):.6f}; relative difference of H: {rel:.2e} (expected: {what})"
    )
    if not agree or (args.estimator == "db" and rel > 1e-5):
        raise SystemExit("the distributed fit does not match")


def _spawned(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world,
        timeout=timedelta(seconds=120),
    )
    try:
        _run(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--estimator", choices=["db", "mc", "db_calibrated"], default="db")
    parser.add_argument("--images", type=int, default=32, help="training patches used")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--world", type=int, default=2, help="processes to spawn")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun: env:// rendezvous
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        try:
            _run(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
