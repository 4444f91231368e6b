"""KFAC-expand against KFAC-reduce on small segmentation networks, against the exact GGN blocks.

Run ``python -m tests.kron.measure_expand_reduce`` (about 1 CPU-minute on one thread); it
writes ``integration/results/kron_expand_reduce.md``. For every weight of a KFAC layer (and every
bias) it compares the Kron block of :func:`lsn_ext.kron.kron_curvature` in expectation
(``mc_samples="exact"``) and with one Monte-Carlo draw (5 seeds) to the exact GGN block
``Σ_n J_nᵀ H_n J_n`` (dense Jacobian by ``torch.func.jacrev``, dense loss Hessian by
``torch.func.hessian``): the relative Frobenius error of the block and of its diagonal. On the
Conv2d-only network it also measures laplace-torch + curvlinops ``kron`` (``CurvlinopsGGN``, its
default ``stochastic=False``: type-2, the pixels of an image share their draws).

Networks (float64, 1 thread):

- ``tiny U-Net, CE``: ``tests.networks.tiny_unet`` (3 levels, bilinear upsampling, concatenating
  skips, Conv2d only), 2 classes, random initialisation, 2 images of 8×8.
- ``U-Net, BCE, trained``: ``lsn_ext.models.UNet(3, 1, widths=(4, 8, 16), upsampling=
  "transposed")`` after 300 Adam steps (lr 1e-2, batch 8) on 64 synthetic lesion images of 16×16
  (``lsn_ext.data.synthetic_lesions``), measured on 2 held-out images.
- ``3-D net, CE``: Conv3d → GroupNorm → tanh → Conv3d (stride 2) → tanh → ConvTranspose3d (k 2,
  stride 2) → tanh → Conv3d 1×1×1, 2 classes, random initialisation, 1 volume of 6³.

It also times one call against a training step on the paper U-Net at 64² (see :func:`cost`).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from lsn_ext._laplace import laplace
from lsn_ext.data.synthetic import synthetic_lesions
from lsn_ext.kron import kron_curvature
from lsn_ext.models import UNet
from lsn_ext.rules.losses import BCEWithLogits, CrossEntropy, Loss
from tests.kron.kfac_reference import dense_entry
from tests.networks import tiny_unet
from tests.reference import loss_hessian_dense

OUT = Path(__file__).resolve().parents[2] / "integration" / "results" / "kron_expand_reduce.md"
SEEDS = 5


def exact_blocks(model: nn.Module, x: Tensor, y: Tensor, loss: Loss) -> dict[str, Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters()}
    f = functional_call(model, params, (x,))
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    H = loss_hessian_dense(lambda logits: loss.value(logits, y), f)
    out = {}
    for n in params:
        J = jac[n].reshape(f.numel(), -1)
        out[n] = J.T @ H @ J
    return out


def errors(block: Tensor, exact: Tensor) -> tuple[float, float]:
    """Relative Frobenius error of the block and of its diagonal."""
    d, e = block.diagonal(), exact.diagonal()
    return float((block - exact).norm() / exact.norm()), float((d - e).norm() / e.norm())


def pooled(
    blocks: dict[str, Tensor], exact: dict[str, Tensor], names: list[str], diag: bool = False
) -> float:
    """``√(Σ ‖K − B‖²) / √(Σ ‖B‖²)`` over the blocks (or their diagonals) of ``names``."""

    def part(t: Tensor) -> Tensor:
        return t.diagonal() if diag else t

    num = sum(float((part(blocks[n]) - part(exact[n])).norm() ** 2) for n in names)
    den = sum(float(part(exact[n]).norm() ** 2) for n in names)
    return math.sqrt(num / den)


def trace_ratio(blocks: dict[str, Tensor], exact: dict[str, Tensor], names: list[str]) -> float:
    """``Σ tr K / Σ tr B`` over ``names``."""
    return sum(float(blocks[n].trace()) for n in names) / sum(
        float(exact[n].trace()) for n in names
    )


def train_unet() -> tuple[nn.Module, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, y = synthetic_lesions(66, size=16, channels=3, generator=gen)
    x, y = x.double(), y.double()
    torch.manual_seed(0)
    net = UNet(3, 1, widths=(4, 8, 16), upsampling="transposed").double()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    loss = nn.BCEWithLogitsLoss()
    for step in range(300):
        idx = torch.randint(0, 64, (8,), generator=gen)
        opt.zero_grad()
        loss(net(x[idx]), y[idx]).backward()
        opt.step()
        if step == 299:
            final = float(loss(net(x[:64]), y[:64]).detach())
    print(f"  trained U-Net: training BCE {final:.3f}", file=sys.stderr)
    return net, x[64:], y[64:]


def net_3d() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 3, 3, padding=1),
        nn.GroupNorm(1, 3),
        nn.Tanh(),
        nn.Conv3d(3, 4, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.ConvTranspose3d(4, 3, 2, stride=2),
        nn.Tanh(),
        nn.Conv3d(3, 2, 1),
    )


def cases():
    torch.manual_seed(1)
    unet = tiny_unet(out_channels=2, up="bilinear")
    x = torch.randn(2, 2, 8, 8)
    yield "tiny U-Net, CE", unet, x, torch.randint(0, 2, (2, 8, 8)), CrossEntropy()
    net, x, y = train_unet()
    yield "U-Net, BCE, trained", net, x, y, BCEWithLogits()
    torch.manual_seed(2)
    yield (
        "3-D net, CE",
        net_3d(),
        torch.randn(1, 1, 6, 6, 6),
        torch.randint(0, 2, (1, 6, 6, 6)),
        CrossEntropy(),
    )


def measure(name, net, x, y, loss) -> tuple[list[str], dict]:
    t0 = time.perf_counter()
    exact = exact_blocks(net, x, y, loss)
    rows, summary = [], {}
    results = {
        m: kron_curvature(net, x, y, loss, mode=m, mc_samples="exact", bias_block="kfac")
        for m in MODES
    }
    exact_bias = kron_curvature(net, x, y, loss, mc_samples="exact")
    kfac = [n for n in results["expand"].names if results["expand"].blocks[n] == "kfac"]
    biases = [n for n in results["expand"].names if results["expand"].blocks[n] == "kfac bias"]
    dense = {m: {n: dense_entry(r.factors(n)) for n in r.names} for m, r in results.items()}
    draws: dict[str, list[float]] = {m: [] for m in MODES}
    for m in MODES:
        for seed in range(SEEDS):
            gen = torch.Generator().manual_seed(seed)
            one = kron_curvature(net, x, y, loss, mode=m, mc_samples=1, generator=gen)
            blocks = {n: dense_entry(one.factors(n)) for n in kfac}
            draws[m].append(pooled(blocks, exact, kfac))
    for n in kfac + biases:
        shape = "×".join(map(str, dict(net.named_parameters())[n].shape))
        cells = []
        for m in MODES:
            block, diag = errors(dense[m][n], exact[n])
            cells += [f"{block:.3f}", f"{diag:.3f}"]
        rows.append(f"| {name} | `{n}` [{shape}] | " + " | ".join(cells) + " |")
    diagonal = {n: torch.diag(exact[n].diagonal()) for n in kfac}
    summary["exact diagonal"] = pooled(diagonal, exact, kfac)
    bias_blocks = {n: dense_entry(exact_bias.factors(n)) for n in biases}
    summary["exact bias"] = pooled(bias_blocks, exact, biases)
    for m in MODES:
        summary[m] = (
            pooled(dense[m], exact, kfac),
            pooled(dense[m], exact, kfac, diag=True),
            trace_ratio(dense[m], exact, kfac),
            pooled(dense[m], exact, biases),
            statistics.mean(draws[m]),
            statistics.stdev(draws[m]),
        )
    if name.startswith("tiny U-Net"):
        summary["curvlinops"] = curvlinops_errors(net, x, y, exact, kfac, biases)
    print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rows, summary


def curvlinops_errors(net, x, y, exact, kfac, biases) -> dict[str, tuple[float, float]]:
    out = {}
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    for m in MODES:
        _, K = laplace.curvature.CurvlinopsGGN(net, "classification").kron(
            x, y, N=x.shape[0], kfac_approx=m
        )
        blocks = {n: dense_entry(e) for n, e in zip(names, K.kfacs, strict=True)}
        out[m] = (
            pooled(blocks, exact, kfac),
            pooled(blocks, exact, kfac, diag=True),
            trace_ratio(blocks, exact, kfac),
            pooled(blocks, exact, biases),
        )
    return out


MODES = ("expand", "reduce")
STEP = "training step (forward + backward)"


def cost(repeats: int = 5) -> dict[str, list[float]]:
    """Seconds of a training step and of one ``kron`` call, alternated, float32, sorted.

    The paper U-Net (``UNet(3, 2)``, 8-16-32-64-128, nearest upsampling: Conv2d only, so
    laplace-torch + curvlinops apply), cross-entropy, batch 8 of 64², one draw.
    """
    torch.manual_seed(0)
    net = UNet(3, 2).float()
    x = torch.randn(8, 3, 64, 64)
    y = torch.randint(0, 2, (8, 64, 64))
    ce = nn.CrossEntropyLoss(reduction="sum")
    backend = laplace.curvature.CurvlinopsGGN(net, "classification")

    def step() -> None:
        net.zero_grad()
        ce(net(x), y).backward()

    runs = {
        STEP: step,
        "kron_curvature, expand": lambda: kron_curvature(net, x, y, mode="expand"),
        "kron_curvature, reduce": lambda: kron_curvature(net, x, y, mode="reduce"),
        "laplace-torch + curvlinops kron (expand, type-2)": lambda: backend.kron(x, y, N=8),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats + 1):  # the first round warms up
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return {k: sorted(v[1:]) for k, v in times.items()}


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    all_rows, summaries = [], {}
    for name, net, x, y, loss in cases():
        rows, summary = measure(name, net, x, y, loss)
        all_rows += rows
        summaries[name] = summary
    torch.set_default_dtype(torch.float32)
    seconds = cost()
    torch.set_default_dtype(torch.float64)
    minutes = (time.perf_counter() - t0) / 60
    lines = [
        "# KFAC-expand vs KFAC-reduce against the exact GGN blocks",
        "",
        "Written by `python -m tests.kron.measure_expand_reduce` (networks and method in its "
        f"docstring; float64, one CPU thread, {minutes:.1f} minutes). Error of a block `K` "
        "against the exact GGN block `B = Σ_n J_nᵀ H_n J_n`: `‖K − B‖_F / ‖B‖_F`; of its "
        "diagonal: `‖diag K − diag B‖ / ‖diag B‖`. *Expectation*: `mc_samples='exact'` (the "
        "factors' expectation over the draws, no noise). *One draw*: `mc_samples=1`, mean ± "
        f"standard deviation over {SEEDS} seeds. *Pooled*: `√(Σ ‖K − B‖²) / √(Σ ‖B‖²)` over all "
        "weights of KFAC layers (or all their biases). The reference row keeps only the exact "
        "diagonal of each block (the error of dropping the off-diagonal entries): a block "
        "whose error exceeds it is farther from the exact block than the diagonal alone.",
        "",
        "## Pooled over the network",
        "",
        "Weights of KFAC layers: the blocks and their diagonals in expectation, the trace ratio "
        "`Σ tr K / Σ tr B`, and the blocks with one draw. Biases: the weight's output-gradient "
        "factor `G` (`bias_block='kfac'`, laplace-torch + curvlinops' convention); the default "
        "`bias_block='exact'` is the per-sample moment, exact in expectation (pooled error "
        + ", ".join(f"{s['exact bias']:.1e}" for s in summaries.values())
        + " on the three networks, rounding).",
        "",
        "| network | mode | weights | weights: diagonal | trace ratio | biases: `G` "
        "| weights, one draw |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, summary in summaries.items():
        for m in MODES:
            w, d, tr, b, mean, std = summary[m]
            lines.append(
                f"| {name} | {m} | {w:.3f} | {d:.3f} | {tr:.3f} | {b:.3f} | "
                f"{mean:.3f} ± {std:.3f} |"
            )
        lines.append(
            f"| {name} | reference: the exact diagonal alone | {summary['exact diagonal']:.3f} "
            "| 0 | 1 | | |"
        )
        if "curvlinops" in summary:
            for m in MODES:
                w, d, tr, b = summary["curvlinops"][m]
                lines.append(
                    f"| {name} | laplace-torch + curvlinops `kron` ({m}, type-2) | {w:.3f} | "
                    f"{d:.3f} | {tr:.3f} | {b:.3f} | (deterministic) |"
                )
    lines += [
        "",
        "## Cost",
        "",
        "5 alternated repetitions (after one warm-up round), float32, one CPU thread, on a "
        "machine shared with other jobs: the paper U-Net (`UNet(3, 2)`, 8-16-32-64-128, nearest "
        "upsampling), cross-entropy, batch 8 of 64², one draw. The ratio is of the medians.",
        "",
        "| run | median s | min–max s | × training step |",
        "|---|---|---|---|",
        *(
            f"| {k} | {statistics.median(v):.3f} | {v[0]:.3f}–{v[-1]:.3f} | "
            f"{statistics.median(v) / statistics.median(seconds[STEP]):.1f} |"
            for k, v in seconds.items()
        ),
        "",
        "## Per tensor (expectation)",
        "",
        "| network | parameter | expand: block | expand: diagonal | reduce: block "
        "| reduce: diagonal |",
        "|---|---|---|---|---|---|",
        *all_rows,
        "",
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
