"""Command-line entry point: ``lsn-ext demo`` (also ``python -m lsn_ext demo``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen job."""
    parser = argparse.ArgumentParser(prog="lsn-ext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="diagonal backprop on a U-Net next to the exact diagonal")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from lsn_ext.demo import run_demo

        return run_demo(seed=args.seed)
    return 2


if __name__ == "__main__":
    sys.exit(main())
