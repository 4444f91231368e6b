"""Command line of lsn_ext: ``lsn-ext demo`` (or ``python -m lsn_ext demo``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Defaults of the demo's sizes; a flag left out gets its default, and --quick then reduces it
# (lsn_ext.demo.quick_settings). A flag given with --quick must agree with what --quick runs.
SIZES = {"epochs": 12, "samples": 50, "logit_samples": 20, "ensemble": 3, "rank": 10}
# The DemoConfig field of each size flag, and what --quick does to it (for the refusal).
QUICK_PHRASES = {
    "epochs": ("epochs", "trains {} epoch"),
    "samples": ("n_epistemic", "runs {} epistemic samples"),
    "logit_samples": ("n_aleatoric", "runs {} aleatoric samples"),
    "ensemble": ("ensemble", "trains {} ensemble members at most"),
    "rank": ("rank", "uses rank {} at most"),
}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the command; returns the exit code."""
    from lsn_ext import __version__

    parser = argparse.ArgumentParser(prog="lsn-ext", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="train an LSN and its baselines on nuclei images; write a figure and Table 2",
        description="Laplacian Segmentation Network and baselines on the shipped nuclei image: "
        "IoU, Pixel Ratio, Box Ratio and entropy AUROC (LSN Table 2), and a figure of the maps.",
    )
    demo.add_argument("--out", type=Path, default=Path("lsn-ext-output"), help="output directory")
    sized = {"default": argparse.SUPPRESS}  # filled from SIZES after parsing
    demo.add_argument(
        "--epochs",
        type=int,
        help=f"training epochs per model (default: {SIZES['epochs']})",
        **sized,
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed of data order and weights")
    demo.add_argument(
        "--samples",
        type=int,
        help=f"epistemic samples, paper: 50 (default: {SIZES['samples']})",
        **sized,
    )
    demo.add_argument(
        "--logit-samples",
        type=int,
        help=f"aleatoric, paper: 20 (default: {SIZES['logit_samples']})",
        **sized,
    )
    demo.add_argument(
        "--ensemble",
        type=int,
        help=f"ensemble members, 0: none (default: {SIZES['ensemble']})",
        **sized,
    )
    demo.add_argument(
        "--estimator",
        choices=("db", "db_calibrated", "mc"),
        default="mc",
        help="GGN-diagonal estimator of the Laplace posteriors (db is the paper's)",
    )
    demo.add_argument("--mc-samples", type=int, default=1, help="Monte-Carlo vectors per image")
    demo.add_argument(
        "--prior",
        choices=("marglik", "nll"),
        default="marglik",
        help="prior precision by marginal likelihood or validation NLL grid search",
    )
    demo.add_argument(
        "--rank",
        type=int,
        help="SSN covariance rank, paper: 10; 0: the '(diag)' models, object-marking aleatoric "
        f"(default: {SIZES['rank']})",
        **sized,
    )
    demo.add_argument(
        "--ssn-loss",
        choices=("logsumexp", "expected"),
        default="expected",
        help="SSN training loss: the per-pixel expected BCE or LSN Eq. 11",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help="tiny run (seconds), for tests: 1 epoch, 3 epistemic and 3 aleatoric samples, "
        "rank and ensemble at most 2",
    )
    demo.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (0: torch's default)"
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from lsn_ext.demo import DemoConfig, quick_settings, run_demo

        given = {name for name in SIZES if hasattr(args, name)}
        for name in SIZES.keys() - given:
            setattr(args, name, SIZES[name])
        if (
            args.epochs < 1
            or args.samples < 2
            or args.logit_samples < 2
            or args.ensemble < 0
            or args.mc_samples < 1
            or args.rank < 0
        ):
            parser.error(
                "need --epochs >= 1, --samples >= 2, --logit-samples >= 2, --ensemble >= 0, "
                "--mc-samples >= 1, --rank >= 0"
            )
        if args.threads < 0:
            parser.error(f"--threads must be 0 (torch's default) or positive, got {args.threads}")
        if args.estimator == "db" and args.mc_samples != 1:
            parser.error(
                f"--mc-samples {args.mc_samples} has no effect with --estimator db (it draws no "
                "vectors); use --estimator mc or db_calibrated, or leave --mc-samples out"
            )
        config = DemoConfig(
            out=args.out,
            epochs=args.epochs,
            seed=args.seed,
            quick=args.quick,
            n_epistemic=args.samples,
            n_aleatoric=args.logit_samples,
            ensemble=args.ensemble,
            progress=not args.no_progress,
            threads=args.threads or None,
            estimator=args.estimator,
            mc_samples=args.mc_samples,
            prior=args.prior,
            rank=args.rank,
            ssn_loss=args.ssn_loss,
        )
        quick = quick_settings(config) if args.quick else {}
        for name in sorted(given):
            field, phrase = QUICK_PHRASES[name]
            if field in quick and quick[field] != getattr(config, field):
                flag = "--" + name.replace("_", "-")
                parser.error(
                    f"--quick {phrase.format(quick[field])}, not {flag} {getattr(args, name)}: "
                    f"leave {flag} out with --quick, or drop --quick for a full run"
                )
        unwritable = _unwritable(args.out)
        if unwritable:
            parser.error(f"cannot write to --out {args.out}: {unwritable}")
        return run_demo(config)
    return 2


def _unwritable(out: Path) -> str | None:
    """Why the demo could not write its results into ``out`` (checked before any training)."""
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        return err.strerror or str(err)
    return None


if __name__ == "__main__":
    sys.exit(main())
