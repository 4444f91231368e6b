"""Diagonal backpropagation through BackPACK on a U-Net with ``torch.cat`` skips.

Run from the repository root::

    .venv/bin/python -m integration.checks.backpack_example            # 64², float32, a few seconds
    .venv/bin/python -m integration.checks.backpack_example --size 128

Converts the LSN paper's U-Net (5 levels, 8-16-32-64-128, tanh, nearest upsampling) with
``lsn_ext.backpack_ext.convert``, runs ``DiagBackpropExtension`` for BCE and 3-class
cross-entropy (exact first step), and compares the result with the native engine
``lsn_ext.diag_backprop`` on the same weights (max relative difference per tensor) and the time of
one forward + backward pass of each (median of 5).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from backpack import backpack, extend
from torch import nn

import lsn_ext
from lsn_ext.backpack_ext import DiagBackpropExtension, convert, diagonals
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
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    cases = {
        "BCE [N,1,H,W]": (1, nn.BCEWithLogitsLoss(reduction="sum"), None),
        "CE [N,3,H,W]": (3, nn.CrossEntropyLoss(reduction="sum"), 3),
    }
    print(f"U-Net 8-16-32-64-128, input {tuple(x.shape)}, float32")
    for name, (out_channels, loss, classes) in cases.items():
        net = UNet(3, out_channels)
        if classes is None:
            y = (torch.rand(args.batch, 1, args.size, args.size) > 0.5).float()
        else:
            y = torch.randint(0, classes, (args.batch, args.size, args.size))

        converted = convert(net, x)
        lossfunc = extend(loss)

        def run_backpack(converted=converted, lossfunc=lossfunc, y=y) -> None:
            with backpack(DiagBackpropExtension()):
                lossfunc(converted(x), y).backward()

        t_backpack = _median_time(run_backpack)
        got = diagonals(converted)
        t_engine = _median_time(
            lambda net=net, y=y, loss=loss: lsn_ext.diag_backprop(net, x, y, loss)
        )
        expected = lsn_ext.diag_backprop(net, x, y, loss).diagonals

        err = max(
            ((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item()
            for k, v in expected.items()
        )
        print(
            f"{name:15s} BackPACK {t_backpack:6.3f} s   engine {t_engine:6.3f} s   "
            f"max relative difference {err:.1e} over {len(expected)} tensors"
        )


if __name__ == "__main__":
    main()
