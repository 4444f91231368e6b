"""KFAC-expand against KFAC-reduce on small segmentation networks, against the exact GGN blocks;
and the error that KFAC-expand's ``position_fraction`` adds, on a trained paper U-Net.

Run ``./dev bench kron_expand_reduce`` (or ``python -m
integration.benchmarks.bench_kron_expand_reduce``; a few CPU-minutes on one thread); it writes
``integration/results/kron_expand_reduce.md``.
``--quick`` runs tiny versions (2 seeds; the U-Net trained for 20 steps and measured on one
held-out image, the 3-D net on a 4³ volume; position sampling at 16² after 20 steps) and prints
the report without writing it. For every weight of a
KFAC layer (and every bias) it compares the Kron block of :func:`lsn_ext.kron.kron_curvature` in
expectation (``mc_samples="exact"``) and with one Monte-Carlo draw (5 seeds) to the exact GGN
block ``Σ_n J_nᵀ H_n J_n`` (dense Jacobian by ``torch.func.jacrev``, dense loss Hessian by
``torch.func.hessian``): the relative Frobenius error of the block and of its diagonal. On the
Conv2d-only network it also measures laplace-torch + curvlinops ``kron`` (``CurvlinopsGGN``, its
default ``stochastic=False``: type-2, the pixels of an image share their draws).

Networks (float64, 1 thread):

- ``tiny U-Net, CE``: :class:`TinyUNet` (3 levels, bilinear upsampling, concatenating skips,
  Conv2d only; the network of ``tests.networks.tiny_unet``), 2 classes, random initialisation,
  2 images of 8×8.
- ``U-Net, BCE, trained``: ``lsn_ext.models.UNet(3, 1, widths=(4, 8, 16), upsampling=
  "transposed")`` after 300 Adam steps (lr 1e-2, batch 8) on 64 synthetic lesion images of 16×16
  (``lsn_ext.data.synthetic_lesions``), measured on 2 held-out images.
- ``3-D net, CE``: Conv3d → GroupNorm → tanh → Conv3d (stride 2) → tanh → ConvTranspose3d (k 2,
  stride 2) → tanh → Conv3d 1×1×1, 2 classes, random initialisation, 1 volume of 6³.

**Position sampling** (:func:`positions`, float32): the paper U-Net
(``integration.harness.paper_unet``) trained for 300 Adam steps (lr 3e-3, batch 8, mean BCE) on
128 synthetic lesion images of 64², measured on a held-out batch of 8: the patch factor ``A``
(``F_1`` of every KFAC weight) with ``position_fraction`` f against ``A`` with every position,
for 5 seeds of the positions (the draws of ``z`` are the same for all, so ``G`` is too: the
relative error of each Kron block ``G ⊗ A`` is that of its ``A``).

The cost of a Kron fit beside a training step is measured by ``./dev bench speed``
(``integration/results/bench_speed.md``).
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev
from torch.nn import functional as F

from integration import harness
from integration.harness import paper_unet
from lsn_ext.data.synthetic import synthetic_lesions
from lsn_ext.kron import kron_curvature
from lsn_ext.models import UNet
from lsn_ext.rules.losses import BCEWithLogits, CrossEntropy, Loss

RESULTS = harness.RESULTS / "kron_expand_reduce.md"
SEEDS = 5
FRACTIONS = (1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32)
MODES = ("expand", "reduce")


class TinyUNet(nn.Module):
    """Three levels, nested concatenating skips, conv/tanh/max-pool/bilinear upsampling, 1×1
    head: ``tests.networks.tiny_unet(out_channels, up="bilinear")`` as a plain module (the same
    layers, created in the same order, so the same weights for the same seed)."""

    def __init__(self, out_channels: int = 2):
        super().__init__()
        w = (3, 4, 5)
        self.layers = nn.ModuleDict(
            {
                "e1": nn.Conv2d(2, w[0], 3, padding=1), "a1": nn.Tanh(), "p1": nn.MaxPool2d(2),
                "e2": nn.Conv2d(w[0], w[1], 3, padding=1), "a2": nn.Tanh(), "p2": nn.MaxPool2d(2),
                "b": nn.Conv2d(w[1], w[2], 3, padding=1), "ab": nn.Tanh(),
                "d2": nn.Conv2d(w[1] + w[2], w[1], 3, padding=1), "ad2": nn.Tanh(),
                "d1": nn.Conv2d(w[0] + w[1], w[0], 3, padding=1), "ad1": nn.Tanh(),
                "head": nn.Conv2d(w[0], out_channels, 1),
                "u2": nn.Upsample(scale_factor=2, mode="bilinear"),
                "u1": nn.Upsample(scale_factor=2, mode="bilinear"),
            }
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        L = self.layers
        s1 = L["a1"](L["e1"](x))
        s2 = L["a2"](L["e2"](L["p1"](s1)))
        sb = L["ab"](L["b"](L["p2"](s2)))
        t2 = L["ad2"](L["d2"](torch.cat([s2, L["u2"](sb)], 1)))
        t1 = L["ad1"](L["d1"](torch.cat([s1, L["u1"](t2)], 1)))
        return L["head"](t1)


def dense_entry(entry: list[Tensor]) -> Tensor:
    """The dense block of one ``Kron`` entry (``kron(F0, F1)`` or ``B``)."""
    return entry[0] if len(entry) == 1 else torch.kron(entry[0], entry[1])


def exact_blocks(model: nn.Module, x: Tensor, y: Tensor, loss: Loss) -> dict[str, Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters()}
    f = functional_call(model, params, (x,))
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    H = hessian(lambda logits: loss.value(logits, y))(f.detach()).reshape(f.numel(), f.numel())
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


def train_bce(
    net: nn.Module, x: Tensor, y: Tensor, steps: int, lr: float, gen: torch.Generator
) -> None:
    """``steps`` Adam steps of the mean BCE on batches of 8 drawn from ``x``, ``y`` with ``gen``."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (8,), generator=gen)
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(net(x[idx]), y[idx]).backward()
        opt.step()


def train_unet(steps: int) -> tuple[nn.Module, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, y = synthetic_lesions(66, size=16, channels=3, generator=gen)
    x, y = x.double(), y.double()
    torch.manual_seed(0)
    net = UNet(3, 1, widths=(4, 8, 16), upsampling="transposed").double()
    train_bce(net, x[:64], y[:64], steps, 1e-2, gen)
    with torch.no_grad():
        final = float(F.binary_cross_entropy_with_logits(net(x[:64]), y[:64]))
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


def cases(quick: bool):
    torch.manual_seed(1)
    unet = TinyUNet(out_channels=2)
    x = torch.randn(2, 2, 8, 8)
    yield "tiny U-Net, CE", unet, x, torch.randint(0, 2, (2, 8, 8)), CrossEntropy()
    net, x, y = train_unet(20 if quick else 300)
    n, size = (1, 4) if quick else (2, 6)  # held-out images, the volume's edge
    yield "U-Net, BCE, trained", net, x[:n], y[:n], BCEWithLogits()
    torch.manual_seed(2)
    yield (
        "3-D net, CE",
        net_3d(),
        torch.randn(1, 1, size, size, size),
        torch.randint(0, 2, (1, size, size, size)),
        CrossEntropy(),
    )


def measure(name, net, x, y, loss, seeds: int) -> tuple[list[str], dict]:
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
        for seed in range(seeds):
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
    from laplace.curvature import CurvlinopsGGN  # after lsn_ext, which silences its warning

    out = {}
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    for m in MODES:
        _, K = CurvlinopsGGN(net, "classification").kron(x, y, N=x.shape[0], kfac_approx=m)
        blocks = {n: dense_entry(e) for n, e in zip(names, K.kfacs, strict=True)}
        out[m] = (
            pooled(blocks, exact, kfac),
            pooled(blocks, exact, kfac, diag=True),
            trace_ratio(blocks, exact, kfac),
            pooled(blocks, exact, biases),
        )
    return out


def train_paper_unet(size: int, steps: int) -> tuple[nn.Module, Tensor, Tensor]:
    """The paper U-Net trained on synthetic lesions; a held-out batch of 8 (float32)."""
    gen = torch.Generator().manual_seed(0)
    x, y = synthetic_lesions(136, size=size, channels=3, generator=gen)
    torch.manual_seed(0)
    net = paper_unet()
    train_bce(net, x[:128], y[:128], steps, 3e-3, gen)
    with torch.no_grad():
        final = float(F.binary_cross_entropy_with_logits(net(x[128:]), y[128:]))
    print(f"  paper U-Net: held-out BCE {final:.3f} after {steps} steps", file=sys.stderr)
    return net.eval(), x[128:], y[128:]


def positions(quick: bool) -> str:
    """The error of ``position_fraction`` against every position (module documentation)."""
    size, steps, seeds = (16, 20, 2) if quick else (64, 300, SEEDS)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        net, x, y = train_paper_unet(size, steps)

        def fit(fraction: float, seed: int):
            gen = torch.Generator().manual_seed(seed)
            return kron_curvature(net, x, y, "bce", position_fraction=fraction, generator=gen)

        full = fit(1.0, 0)
        kfac = [n for n in full.names if full.blocks[n] == "kfac"]
        A = {n: full.factors(n)[1].double() for n in kfac}
        other = kron_curvature(net, x[:4], y[:4], "bce")  # half the batch (its mean): a data scale
        half = {n: other.factors(n)[1].double() for n in kfac}
        rows = []
        for f in FRACTIONS:
            pooled_errors, worst = [], []
            for seed in range(seeds):
                part = fit(f, seed)
                errs = {n: part.factors(n)[1].double() - A[n] for n in kfac}
                num = sum(float(e.norm() ** 2) for e in errs.values())
                pooled_errors.append(math.sqrt(num / sum(float(a.norm() ** 2) for a in A.values())))
                rel = {n: float(errs[n].norm() / A[n].norm()) for n in kfac}
                worst.append(max(rel.items(), key=lambda kv: kv[1]))
            name, value = max(worst, key=lambda kv: kv[1])
            mean, sd = statistics.mean(pooled_errors), statistics.stdev(pooled_errors)
            rows.append(f"| 1/{round(1 / f)} | {mean:.3f} ± {sd:.3f} | {value:.3f} (`{name}`) |")
        num = sum(float((half[n] - A[n]).norm() ** 2) for n in kfac)
        scale = math.sqrt(num / sum(float(a.norm() ** 2) for a in A.values()))
    finally:
        torch.set_default_dtype(previous)
    return "\n".join(
        [
            "## Position sampling: KFAC-expand's patch factor from a fraction of the positions",
            "",
            f"The paper U-Net (`integration.harness.paper_unet`, {len(kfac)} KFAC weights) after "
            f"{steps} Adam steps on synthetic lesions of {size}², a held-out batch of 8, float32, "
            f"one Monte-Carlo draw: the patch factor `A` of `kron_curvature(..., "
            "position_fraction=f)` against `A` with every position, same `G` (so each block "
            "`G ⊗ A` has the relative error of its `A`). Pooled: `√(Σ ‖Â − A‖²) / √(Σ ‖A‖²)` "
            f"over the KFAC weights, mean ± standard deviation over {seeds} seeds of the "
            "positions; worst weight: the largest `‖Â − A‖ / ‖A‖` of any weight and seed (the "
            "deepest layers have the fewest positions per image). For scale: `A` from the "
            f"batch's first 4 images alone differs from the batch's by {scale:.3f} (pooled, the "
            "same normalisation); a fit sums the factors of all batches, whose sampling errors "
            "are independent.",
            "",
            "| position_fraction | pooled relative error of `A` | worst weight |",
            "|---|---|---|",
            *rows,
        ]
    )


def run(quick: bool) -> str:
    """The report's text; float64 as the default dtype while it measures, restored after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return report_text(quick)
    finally:
        torch.set_default_dtype(previous)


def report_text(quick: bool) -> str:
    """The report: pooled and per-tensor errors of the three networks, then position sampling."""
    seeds = 2 if quick else SEEDS
    all_rows, summaries = [], {}
    for name, net, x, y, loss in cases(quick):
        rows, summary = measure(name, net, x, y, loss, seeds)
        all_rows += rows
        summaries[name] = summary
    sampling = positions(quick)
    lines = [
        "Written by `./dev bench kron_expand_reduce` (networks and method in "
        "`integration/benchmarks/bench_kron_expand_reduce.py`'s docstring; float64, one CPU "
        "thread). Error of a block `K` "
        "against the exact GGN block `B = Σ_n J_nᵀ H_n J_n`: `‖K − B‖_F / ‖B‖_F`; of its "
        "diagonal: `‖diag K − diag B‖ / ‖diag B‖`. *Expectation*: `mc_samples='exact'` (the "
        "factors' expectation over the draws, no noise). *One draw*: `mc_samples=1`, mean ± "
        f"standard deviation over {seeds} seeds. *Pooled*: `√(Σ ‖K − B‖²) / √(Σ ‖B‖²)` over all "
        "weights of KFAC layers (or all their biases). The reference row keeps only the exact "
        "diagonal of each block (the error of dropping the off-diagonal entries): a block "
        "whose error exceeds it is farther from the exact block than the diagonal alone. The "
        "cost of a fit: `integration/results/bench_speed.md`.",
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
        sampling,
        "",
        "## Per tensor (expectation)",
        "",
        "| network | parameter | expand: block | expand: diagonal | reduce: block "
        "| reduce: diagonal |",
        "|---|---|---|---|---|---|",
        *all_rows,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    harness.quick_benchmark_main(
        __doc__,
        "# KFAC-expand vs KFAC-reduce against the exact GGN blocks",
        run,
        RESULTS,
        threads=1,
        argv=argv,
    )


if __name__ == "__main__":
    main()
