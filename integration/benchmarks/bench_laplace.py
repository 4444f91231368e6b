"""Benchmark: ``Laplace(...).fit`` with the DiagBackprop backend against one training epoch.

On the LSN paper's U-Net (5 levels, 8-16-32-64-128, two 3×3 conv + tanh per block), binary
segmentation (BCE) of 1,000 synthetic 64×64 images: the wall time of one training epoch
(forward, backward, Adam step per batch) and of ``la.fit`` with ``backend=DiagBackprop`` on the
same loader. Then laplace-torch's built-in backends with ``hessian_structure="diag"`` on the same
model and a few images, each in a subprocess with a time limit, recording how each ends.

Run: ``./dev bench laplace`` (``--quick`` for a smoke run). Prints Markdown tables and writes them
to ``integration/results/bench_laplace.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch
import torch.nn.functional as F
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from integration import harness
from integration.harness import script_command, script_env
from lsn_ext import DiagBackprop
from lsn_ext.data import synthetic_lesions
from lsn_ext.models import UNet

RESULTS = harness.RESULTS


def _data(n: int, size: int) -> TensorDataset:
    x, m = synthetic_lesions(n, size, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, m)


def fit_vs_epoch(n_images: int, size: int, batch: int) -> str:
    torch.manual_seed(0)
    loader = DataLoader(_data(n_images, size), batch_size=batch)
    model = UNet(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def epoch() -> None:
        model.train()
        for x, y in loader:
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(model(x), y).backward()
            opt.step()

    def fit() -> None:
        la = Laplace(
            model,
            "classification",
            subset_of_weights="all",
            hessian_structure="diag",
            backend=DiagBackprop,
            backend_kwargs={"loss": "bce", "estimator": "db"},
        )
        la.fit(loader)

    rows = []
    for name, fn in (("training epoch", epoch), ("Laplace.fit (DiagBackprop)", fit)):
        fn()  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        rows.append((name, sorted(times)[1]))
    ratio = rows[1][1] / rows[0][1]
    n_params = sum(p.numel() for p in model.parameters())
    lines = [
        f"**Laplace.fit vs one training epoch**: paper U-Net ({n_params:,} parameters), "
        f"{n_images} images of {size}², batch {batch}, BCE, float32; median of 3",
        "",
        "| run | time [s] |",
        "|---|---:|",
        *[f"| {name} | {t:.2f} |" for name, t in rows],
        f"| **ratio fit / epoch** | **{ratio:.2f}** |",
    ]
    return "\n".join(lines)


BUILTIN = ("CurvlinopsGGN", "BackPackGGN", "AsdlGGN", "CurvlinopsEF", "AsdlEF")


def builtin_worker(backend_name: str, n_images: int, size: int) -> None:
    """Fit laplace-torch's built-in backend on the segmentation model; print one result line."""
    import laplace.curvature as curvature

    torch.manual_seed(0)
    x, m = _data(n_images, size).tensors
    loader = DataLoader(TensorDataset(x, m[:, 0].long()), batch_size=n_images)
    la = Laplace(
        UNet(3, 2),
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=getattr(curvature, backend_name),
    )
    start = time.perf_counter()
    try:
        la.fit(loader)
    except Exception as err:  # recorded, not hidden: this is what the table reports
        message = " ".join(str(err).split())[:160]
        elapsed = time.perf_counter() - start
        print(f"RESULT|fails after {elapsed:.1f} s: {type(err).__name__}: {message}")
        return
    print(f"RESULT|fits in {time.perf_counter() - start:.1f} s (H sum {la.H.sum().item():.3g})")


def builtin_backends(n_images: int, size: int, limit: int) -> str:
    lines = [
        f"**laplace-torch's built-in backends** on the same U-Net with 2-class logits "
        f"[N, 2, {size}, {size}], targets [N, {size}, {size}], {n_images} images, "
        f"hessian_structure='diag', limit {limit} s each",
        "",
        "| backend | outcome |",
        "|---|---|",
    ]
    for name in BUILTIN:
        cmd = script_command(
            __spec__.name, "--worker", name, "--images", str(n_images), "--size", str(size)
        )
        try:
            out = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=limit,
                env=script_env(PYTHONWARNINGS="ignore"),
            )
            result = next(
                (
                    line.split("|", 1)[1]
                    for line in out.stdout.splitlines()
                    if line.startswith("RESULT|")
                ),
                "killed (exit -9: out of memory on this 24 GiB machine)"
                if out.returncode == -9
                else f"crashed (exit {out.returncode}): {' '.join(out.stderr.split()[-25:])}",
            )
            if name.endswith("EF") and result.startswith("fits"):
                result += "; the empirical Fisher (squared gradients), not the GGN"
        except subprocess.TimeoutExpired:
            result = f"did not finish within {limit} s"
        lines.append(f"| {name} | {result} |")
    lines.append(
        "\nFor comparison, DiagBackprop on the same images takes a fraction of a second "
        "(first table)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.worker:
        builtin_worker(args.worker, args.images, args.size)
        return
    n_images, limit = (64, 60) if args.quick else (1000, 180)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    tables = [fit_vs_epoch(n_images, 64, 16)]
    print(tables[-1] + "\n", flush=True)
    tables.append(builtin_backends(4, 64, limit))
    print(tables[-1])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_laplace.md").write_text("\n\n".join(tables) + "\n")
    print(f"\nwritten to {RESULTS / 'bench_laplace.md'}")


if __name__ == "__main__":
    main()
