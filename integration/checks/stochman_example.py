"""Diagonal backpropagation through a StochMan ``nnj`` U-Net with nested SkipConnections.

Run from the repository root::

    .venv/bin/python -m integration.checks.stochman_example            # 64², float32, a few seconds
    .venv/bin/python -m integration.checks.stochman_example --size 128

Builds the LSN paper's U-Net (5 levels, 8-16-32-64-128, tanh, nearest upsampling) as a plain
``nn.Module``, converts it with ``lsn_ext.stochman_ext.to_nnj`` (nested ``SkipConnection`` s and a
``MeanHead``, the LSN mean network, sharing the weights), and compares
``diag_backprop_nnj`` on the nnj model with the native engine on the plain model (max relative
difference per tensor, and the time of forward + DB, median of 5) for BCE and 3-class
cross-entropy. Then fits ``Laplace(nnj_model, ..., backend=DiagBackprop)`` on a few batches.
"""

from __future__ import annotations

import argparse
import time

import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext import stochman_ext as sx
from lsn_ext.models import UNet


def _median_time(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)

    print(f"| loss | max rel. diff nnj vs engine | nnj driver [s] | engine [s] |  ({args.size}²)")
    print("|---|---|---|---|")
    for name, classes in (("bce", 1), ("ce", 3)):
        unet = UNet(3, classes)
        model = sx.to_nnj(unet)
        if name == "bce":
            y = (torch.rand(args.batch, 1, args.size, args.size) > 0.5).float()
        else:
            y = torch.randint(0, classes, (args.batch, args.size, args.size))
        got = sx.diag_backprop_nnj(model, x, y, name)
        ref = lsn_ext.diag_backprop(unet, x, y, name)
        ref_by_id = {id(p): ref.diagonals[n] for n, p in unet.named_parameters()}
        diff = max(
            (
                (got.diagonals[n] - ref_by_id[id(p)]).abs().max() / ref_by_id[id(p)].abs().max()
            ).item()
            for n, p in model.named_parameters()
        )
        t_nnj = _median_time(lambda: sx.diag_backprop_nnj(model, x, y, name))  # noqa: B023
        t_engine = _median_time(lambda: lsn_ext.diag_backprop(unet, x, y, name))  # noqa: B023
        print(f"| {name} | {diff:.1e} | {t_nnj:.3f} | {t_engine:.3f} |")

    model = sx.to_nnj(UNet(3, 1))
    y = (torch.rand(args.batch, 1, args.size, args.size) > 0.5).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=max(1, args.batch // 2))
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
        backend_kwargs={"loss": "bce", "estimator": "db"},
    )
    la.fit(loader)
    expected = sum(sx.diag_backprop_nnj(model, xb, yb, "bce").vector for xb, yb in loader)
    rel = ((la.H - expected).abs().max() / expected.abs().max()).item()
    print(
        f"\nLaplace(nnj U-Net, backend=DiagBackprop).fit: {la.H.numel()} parameters, "
        f"max rel. diff to diag_backprop_nnj {rel:.1e}"
    )


if __name__ == "__main__":
    main()
