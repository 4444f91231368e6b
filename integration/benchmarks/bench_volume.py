"""A whole Laplace workflow on 3-D volumes: fit, marglik and predictive maps, timed and measured.

Usage::

    ./dev bench volume                 # 20 volumes of 96³, MONAI BasicUNet, ~10 min on 2 cores
    ./dev bench volume --quick         # 3 volumes of 32³, small network (the test)
    ./dev bench volume --device cuda   # on a GPU: writes bench_volume_cuda.md

MONAI's ``BasicUNet`` (3-D, its default features, random init, eval mode) on synthetic volumes
(a noisy ellipsoid each, two classes, batch 1, float32):

1. one training step (forward + cross-entropy + backward + Adam step), after a warm-up step;
2. ``Laplace(..., hessian_structure="diag", backend=lsn_ext.DiagBackprop)``, ``fit`` over all
   volumes (the default Monte-Carlo GGN diagonal);
3. ``optimize_prior_precision(method="marglik")`` (scalar prior);
4. ``lsn_ext.predict(la, x, pred_type="glm")`` on the first volumes: mean, variance, entropy and
   mutual-information maps.

Each stage's wall time and its peak memory above the memory held before it (peak RSS, ``VmHWM``
reset through ``/proc/self/clear_refs``, ``integration.harness``; glibc's mmap threshold fixed so
that freed blocks return to the system; on CUDA ``torch.cuda.max_memory_allocated`` above the
allocated memory before it), and that peak relative to the training step's. Writes
``integration/results/bench_volume.md`` (``bench_volume_cuda.md`` on CUDA; ``--out``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from integration import harness
from integration.harness import (
    MALLOC_ENV,
    hwm_bytes,
    machine,
    reset_peak,
    rss_bytes,
    script_command,
    script_env,
)

RESULTS = harness.RESULTS
QUICK_FEATURES = (4, 4, 8, 8, 16, 4)


def volumes(n: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy ellipsoids: images ``[n, 1, S, S, S]`` and labels ``[n, S, S, S]`` (0/1)."""
    g = torch.Generator().manual_seed(seed)
    axis = torch.linspace(-1, 1, size)
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"))  # [3, S, S, S]
    centre = 0.4 * (torch.rand(n, 3, generator=g) - 0.5)
    radii = 0.25 + 0.35 * torch.rand(n, 3, generator=g)
    inside = (
        ((grid[None] - centre[..., None, None, None]) / radii[..., None, None, None]) ** 2
    ).sum(1)
    labels = (inside <= 1).long()
    images = 0.3 + 0.5 * labels.float() + 0.2 * torch.randn(n, size, size, size, generator=g)
    return images[:, None], labels


def measured(fn: Callable[[], object], device: str = "cpu") -> tuple[object, float, int]:
    """``fn()``, its wall time in seconds and its peak memory above that before it, in bytes.

    CPU: peak RSS; CUDA: the allocator's peak (``max_memory_allocated``).
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return out, seconds, torch.cuda.max_memory_allocated() - base
    if not reset_peak():
        raise RuntimeError("peak memory needs /proc/self/clear_refs (Linux ≥ 4.0)")
    base = rss_bytes()
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    return out, seconds, hwm_bytes() - base


def run(args: argparse.Namespace) -> str:
    from laplace import Laplace
    from monai.networks.nets import BasicUNet

    import lsn_ext

    torch.manual_seed(0)
    kw = {"features": QUICK_FEATURES} if args.quick else {}
    model = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, **kw).eval()
    model.to(args.device)
    x, y = (t.to(args.device) for t in volumes(args.volumes, args.size))
    loader = DataLoader(TensorDataset(x, y), batch_size=1)
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[:1]), y[:1]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    rows = []
    _, t, peak = measured(step, args.device)
    rows.append(("training step (1 volume)", t, peak))
    model.load_state_dict(state)  # the Laplace approximation of the untrained network
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
    )
    _, t, peak = measured(lambda: la.fit(loader, progress_bar=False), args.device)
    rows.append((f"Laplace.fit ({args.volumes} volumes, Monte Carlo)", t, peak))
    _, t, peak = measured(
        lambda: la.optimize_prior_precision(method="marglik", n_steps=args.marglik_steps),
        args.device,
    )
    rows.append((f"marglik ({args.marglik_steps} steps)", t, peak))
    maps, t, peak = measured(
        lambda: [
            lsn_ext.predict(la, x[i : i + 1], n_samples=args.samples, pred_type="glm")
            for i in range(args.predict)
        ],
        args.device,
    )
    rows.append((f"predict, glm, {args.samples} samples ({args.predict} volumes)", t, peak))
    finite = all(bool(m.variance.isfinite().all() and (m.variance >= 0).all()) for m in maps)
    if not finite:
        raise RuntimeError("predict returned a negative or non-finite variance map")
    prior = float(la.prior_precision.detach().reshape(-1)[0])
    return _report(args, rows, prior, sum(p.numel() for p in model.parameters()))


def _report(args: argparse.Namespace, rows: list, prior: float, n_params: int) -> str:
    step_peak = rows[0][2]
    cuda = args.device.startswith("cuda")
    device = f"cuda ({torch.cuda.get_device_name(args.device)})" if cuda else "cpu"
    memory = (
        "Peak memory: `torch.cuda.max_memory_allocated()` during the stage minus "
        "`memory_allocated()` at its start."
        if cuda
        else "Peak memory: peak RSS (`VmHWM`, reset through `/proc/self/clear_refs` before each "
        "stage) minus the RSS at the stage's start, with glibc's mmap threshold fixed (freed "
        "blocks go back to the system)."
    )
    lines = [
        "# A Laplace workflow on 3-D volumes",
        "",
        f"Generated by `integration/benchmarks/bench_volume.py{' --quick' if args.quick else ''}`. "
        f"{machine()} Device: {device}. MONAI BasicUNet 3-D ({n_params:,} parameters, random "
        f"init), {args.volumes} synthetic volumes of {args.size}³, batch 1, float32; prior "
        f"precision chosen by marglik: {prior:.3g}.",
        "",
        "| stage | wall time [s] | peak memory above the stage's start [MiB] "
        "| peak ÷ training step's |",
        "|---|---:|---:|---:|",
    ]
    for name, seconds, peak in rows:
        lines.append(f"| {name} | {seconds:.3g} | {peak / 2**20:.0f} | {peak / step_peak:.2f} |")
    lines += [
        "",
        f"{memory} Times are one run each, on a machine that may be shared; read them as orders "
        "of magnitude.",
        "",
    ]
    return "\n".join(lines)


def _name(device: str) -> str:
    return "bench_volume_cuda.md" if device.startswith("cuda") else "bench_volume.md"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 volumes of 32³, small network")
    parser.add_argument("--volumes", type=int, default=None, help="(default 20; quick 3)")
    parser.add_argument("--size", type=int, default=None, help="edge length (default 96; quick 32)")
    parser.add_argument("--predict", type=int, default=2, help="volumes to predict (default 2)")
    parser.add_argument("--samples", type=int, default=8, help="predictive samples (default 8)")
    parser.add_argument("--marglik-steps", type=int, default=50, help="(default 50)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the report's folder")
    args = parser.parse_args(argv)
    args.volumes = args.volumes or (3 if args.quick else 20)
    args.size = args.size or (32 if args.quick else 96)
    args.predict = min(args.predict, args.volumes)
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        # glibc reads its malloc settings at start-up: run again with them
        subprocess.run(
            script_command(__spec__.name, *(argv if argv is not None else sys.argv[1:])),
            env=script_env(**MALLOC_ENV),
            check=True,
        )
        return args.out / _name(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / _name(args.device)
    path.write_text(text)
    print(text)
    return path


if __name__ == "__main__":
    main()
