"""BackPACK quick start: GGN diagonals of segmentation networks, DB and Monte Carlo.

What it shows, for per-pixel cross-entropy (logits ``[N, C, H, W]``, targets ``[N, H, W]``):

1. A fully convolutional network without skip connections, which BackPACK handles itself:
   ``backpack.extend`` the network and the loss, then one backward pass each
   ``with backpack(DiagGGNExact())``, ``with backpack(DiagGGNMC(mc_samples=S))`` and ``with
   backpack(DiagBackpropExtension())`` (lsn_ext's diagonal backpropagation, savefield
   ``diag_backprop``).
2. A U-Net with ``torch.cat`` skips (``lsn_ext.models.UNet``), where BackPACK's converter stops:
   ``lsn_ext.backpack_ext.convert`` makes an extended copy with ``Cat`` modules, and ``with
   backpack(DiagBackpropExtension())`` gives the DB diagonal, equal to ``lsn_ext.diag_backprop``.
   The unbiased Monte-Carlo diagonal comes from lsn_ext's own engine
   (``lsn_ext.ggn_diagonal(..., estimator="mc")``, BackPACK's ``DiagGGNMC`` estimator), the
   exact one from ``lsn_ext.exact.exact_ggn_diagonal`` (a reference for small images).

Every estimate is compared with the exact diagonal: the relative error over all weights and the
ratio of traces per parameter tensor. DB is exact for the last layer and biased below it; Monte
Carlo is unbiased, with an error that shrinks with the samples. The diagonals are saved as
``diagonals.pt`` and the comparison as ``summary.json``.

Run from the repository root (CPU, float32; about 15 seconds at the defaults)::

    .venv/bin/python examples/backpack_quickstart.py --out examples_out/backpack_quickstart
    .venv/bin/python examples/backpack_quickstart.py --quick   # seconds: 8×8 images
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from backpack import backpack, extend
from backpack.extensions import DiagGGNExact, DiagGGNMC
from torch import nn

import lsn_ext
from lsn_ext.backpack_ext import DiagBackpropExtension, convert, diagonals
from lsn_ext.exact import exact_ggn_diagonal
from lsn_ext.models import UNet

CLASSES = 3
# Sizes of the full run and of --quick; a flag given on the command line overrides either.
FULL = {"size": 24, "mc_samples": 16}
QUICK = {"size": 8, "mc_samples": 4}


def int_at_least(low: int, multiple: int = 1) -> Callable[[str], int]:
    """An argparse type: an int ``>= low`` that is a multiple of ``multiple``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or value % multiple:
            also = f" and a multiple of {multiple}" if multiple > 1 else ""
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{also}, got {value}")
        return value

    return parse


def fill_sizes(args: argparse.Namespace, full: dict, quick: dict) -> argparse.Namespace:
    """The flags left out get ``--quick``'s sizes (with ``--quick``) or the full run's.

    A flag given on the command line is kept: ``--quick`` never overrides it.
    """
    for name, value in (quick if args.quick else full).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def with_backpack(net: nn.Module, x, y, extension, savefield: str) -> dict[str, torch.Tensor]:
    """One backward pass of the summed cross-entropy with ``extension``; ``{name: diagonal}``."""
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    net.zero_grad()
    with backpack(extension):
        lossfunc(net(x), y).backward()
    return {name: getattr(p, savefield).detach().clone() for name, p in net.named_parameters()}


def compare(estimates: dict[str, dict], exact: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Relative error over all weights and the trace ratio per tensor, against ``exact``."""
    flat = torch.cat([v.flatten() for v in exact.values()])
    out = {}
    for name, diag in estimates.items():
        got = torch.cat([diag[k].flatten() for k in exact])
        out[name] = {
            "relative_error": ((got - flat).norm() / flat.norm()).item(),
            "trace_ratio": {k: (diag[k].sum() / exact[k].sum()).item() for k in exact},
        }
    return out


def report(title: str, errors: dict[str, dict]) -> None:
    """Print the relative errors and the per-tensor trace ratios."""
    names = list(errors)
    print(f"\n{title}")
    print(
        "relative error over all weights: "
        + ", ".join(f"{n} {e['relative_error']:.3f}" for n, e in errors.items())
    )
    print(f"{'trace / exact trace':28s}" + "".join(f"{n:>14s}" for n in names))
    for tensor in errors[names[0]]["trace_ratio"]:
        ratios = "".join(f"{errors[n]['trace_ratio'][tensor]:14.3g}" for n in names)
        print(f"  {tensor:26s}{ratios}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before anything runs; ``--quick`` fills only the flags left out."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("examples_out/backpack_quickstart"))
    parser.add_argument(
        "--size",
        type=int_at_least(4, 4),
        default=argparse.SUPPRESS,
        help=f"image edge, a multiple of 4 (default {FULL['size']}; --quick: {QUICK['size']})",
    )
    parser.add_argument("--batch", type=int_at_least(1), default=2)
    parser.add_argument(
        "--mc-samples",
        type=int_at_least(1),
        default=argparse.SUPPRESS,
        help=f"Monte-Carlo vectors (default {FULL['mc_samples']}; --quick: {QUICK['mc_samples']})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8×8 images (for tests)")
    return fill_sizes(parser.parse_args(argv), FULL, QUICK)


def main(argv: list[str] | None = None) -> dict:
    """Run both parts; return the summary that is also written to ``summary.json``."""
    args = parse_args(argv)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(args.seed)
    warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, CLASSES, (args.batch, args.size, args.size))

    # 1. A network BackPACK extends itself: its extensions and DB side by side.
    plain = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(8, CLASSES, 1),
    )
    extended = extend(copy.deepcopy(plain))
    plain_exact = with_backpack(extended, x, y, DiagGGNExact(), "diag_ggn_exact")
    plain_diags = {
        "DB": with_backpack(extended, x, y, DiagBackpropExtension(), "diag_backprop"),
        "BackPACK MC": with_backpack(
            extended, x, y, DiagGGNMC(mc_samples=args.mc_samples), "diag_ggn_mc"
        ),
    }
    plain_errors = compare(plain_diags, plain_exact)
    report(
        f"1. conv-tanh-conv-tanh-conv, input {tuple(x.shape)}: against BackPACK's DiagGGNExact "
        f"(MC: {args.mc_samples} samples)",
        plain_errors,
    )

    # 2. A U-Net with torch.cat skips: convert, then DB through BackPACK.
    unet = UNet(3, CLASSES, widths=(4, 8, 16)).eval()
    converted = convert(unet, x)  # extended copy; unet itself is untouched
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    with backpack(DiagBackpropExtension()):
        lossfunc(converted(x), y).backward()
    unet_db = {k: v.detach().clone() for k, v in diagonals(converted).items()}
    native = lsn_ext.diag_backprop(unet, x, y, "ce").diagonals
    same_as_native = max(
        ((unet_db[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item()
        for k, v in native.items()
    )
    unet_mc = lsn_ext.ggn_diagonal(
        unet,
        x,
        y,
        "ce",
        estimator="mc",
        mc_samples=args.mc_samples,
        generator=torch.Generator().manual_seed(args.seed),
    ).diagonals
    unet_exact = exact_ggn_diagonal(unet, x, y, "ce")
    unet_errors = compare({"DB": unet_db, "lsn_ext MC": unet_mc}, unet_exact)
    report(
        f"2. U-Net 4-8-16 with torch.cat skips, input {tuple(x.shape)}: against "
        f"lsn_ext.exact.exact_ggn_diagonal (MC: {args.mc_samples} samples)",
        unet_errors,
    )
    print(
        f"DB through BackPACK vs lsn_ext.diag_backprop: max relative difference "
        f"{same_as_native:.1e}"
    )

    path = args.out / "diagonals.pt"
    torch.save(
        {
            "plain": {"exact": plain_exact, **plain_diags},
            "unet": {"exact": unet_exact, "DB": unet_db, "lsn_ext MC": unet_mc},
        },
        path,
    )
    seconds = time.perf_counter() - start
    summary = {
        "input_shape": list(x.shape),
        "mc_samples": args.mc_samples,
        "plain": plain_errors,
        "unet": unet_errors,
        "db_backpack_vs_native": same_as_native,
        "files": {"diagonals": str(path)},
        "seconds": seconds,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"time {seconds:.1f} s; diagonals.pt and summary.json in {args.out}")
    return summary


if __name__ == "__main__":
    main()
