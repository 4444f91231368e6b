"""Benchmark the one-pass linearised predictive variance against the exact one and sampling.

Run from the repository root::

    ./dev bench linearized           # ~1-2 minutes on 2 cores
    ./dev bench linearized --quick   # a smoke run

or ``.venv/bin/python -m integration.benchmarks.bench_linearized [--quick]``.

Model: ``lsn_ext.models.UNet`` (3 levels 8-16-32, 2 × (3×3 conv + tanh) per block, nearest
upsampling, 3 → 1 channels, BCE), float32, 32×32 images from ``lsn_ext.data.synthetic_lesions``;
once at its random initialisation and once after a few Adam steps. The posterior is the diagonal
Laplace approximation ``σ²_θ = 1 / (DB_θ + prior precision)`` with DB (``lsn_ext.diag_backprop``)
summed over the training images. On test images, per output pixel:

- ``linearized_variance``: the forward counterpart of DB, one pass ("D after every layer");
- exact: ``Var f_o = Σ_θ J_oθ² σ²_θ`` from one vectorised VJP per output pixel (``torch.func``);
- MC: the variance of the logits over parameter samples ``θ ~ N(θ_MAP, diag(σ²_θ))`` (the
  sampling predictive, not linearised).

The table is printed and written to ``integration/results/bench_linearized.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from integration import harness
from integration.harness import quick_benchmark_main, timed
from lsn_ext.data import synthetic_lesions
from lsn_ext.engine import diag_backprop
from lsn_ext.forward import linearized_variance
from lsn_ext.models import UNet

THREADS = 2
RESULTS = harness.RESULTS / "bench_linearized.md"


def train(model: nn.Module, x: Tensor, y: Tensor, steps: int, batch: int = 16) -> float:
    """A few Adam steps on the BCE loss; returns the last mean loss."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    loss = torch.tensor(float("nan"))
    model.train()
    for _ in range(steps):
        idx = torch.randperm(x.shape[0], generator=g)[:batch]
        loss = nn.functional.binary_cross_entropy_with_logits(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


def db_diagonal(model: nn.Module, x: Tensor, y: Tensor, chunk: int = 16) -> Tensor:
    """The DB GGN diagonal of the BCE loss summed over all training images, flat."""
    return sum(
        diag_backprop(model, x[i : i + chunk], y[i : i + chunk], "bce").vector
        for i in range(0, x.shape[0], chunk)
    )


def exact_variance(model: nn.Module, x: Tensor, variances: Tensor, chunk: int = 256) -> Tensor:
    """``Σ_θ J_oθ² σ²_θ`` for every output ``o`` and each column of ``variances`` ``[P, k]``.

    Returns ``[k, *output_shape]``.
    """
    params = {n: p.detach() for n, p in model.named_parameters()}

    def f(p: dict[str, Tensor]) -> Tensor:
        return functional_call(model, p, (x,))

    out, vjp_fn = vjp(f, params)
    n_out = out.numel()

    def row(e: Tensor) -> Tensor:
        grads = vjp_fn(e.reshape(out.shape))[0]
        return torch.cat([grads[n].reshape(-1) for n in params])

    result = []
    for start in range(0, n_out, chunk):
        stop = min(start + chunk, n_out)
        basis = torch.zeros(stop - start, n_out, dtype=out.dtype)
        basis[torch.arange(stop - start), torch.arange(start, stop)] = 1
        J = vmap(row)(basis)  # [chunk, P]
        result.append(J.square() @ variances)
    return torch.cat(result).T.reshape(variances.shape[1], *out.shape)


@torch.no_grad()
def mc_variance(model: nn.Module, x: Tensor, variance: Tensor, n: int, seed: int = 0) -> Tensor:
    """Variance of the logits over ``n`` samples ``θ ~ N(θ_MAP, diag(variance))``."""
    names = [k for k, _ in model.named_parameters()]
    mean = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    std = variance.sqrt()
    shapes = [p.shape for p in model.parameters()]
    g = torch.Generator().manual_seed(seed)
    s1 = s2 = None
    for _ in range(n):
        theta = mean + std * torch.randn(mean.shape, generator=g)
        params = dict(zip(names, theta.split([s.numel() for s in shapes]), strict=True))
        params = {k: v.reshape(s) for (k, v), s in zip(params.items(), shapes, strict=True)}
        f = functional_call(model, params, (x,)).double()
        s1 = f if s1 is None else s1 + f
        s2 = f * f if s2 is None else s2 + f * f
    m = s1 / n
    return ((s2 - n * m * m) / (n - 1)).float()


def compare(v: Tensor, ref: Tensor) -> str:
    """``rel. err | Pearson r | mean ratio`` of ``v`` against ``ref`` over all pixels."""
    a, b = v.reshape(-1).double(), ref.reshape(-1).double()
    rel = ((a - b).norm() / b.norm()).item()
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    ratio = (a.mean() / b.mean()).item()
    return f"{rel:.3f} | {corr:.3f} | {ratio:.3f}"


def run(quick: bool) -> str:
    size, n_train, n_test = (16, 16, 1) if quick else (32, 64, 2)
    steps, samples = (5, 50) if quick else (60, 1000)
    priors = (1.0, 100.0)
    g = torch.Generator().manual_seed(0)
    x_train, y_train = synthetic_lesions(n_train, size, generator=g)
    x_test, _ = synthetic_lesions(n_test, size, generator=g)

    torch.manual_seed(0)
    model = UNet(3, 1, widths=(8, 16, 32)).eval()
    n_params = sum(p.numel() for p in model.parameters())
    # Warm-up: the first calls pay one-time costs.
    linearized_variance(model, x_test[:1], torch.full((n_params,), 1e-3))
    exact_variance(model, x_test[:1, :, :8, :8], torch.ones(n_params, 1))

    rows, per_layer = [], []
    for state in ("random init", f"{steps} Adam steps"):
        if state != "random init":
            loss = train(model, x_train, y_train, steps)
            state += f" (BCE {loss:.3f})"
        db, t_db = timed(lambda: db_diagonal(model, x_train, y_train))
        variances = torch.stack([1.0 / (db + prior) for prior in priors], 1)  # [P, k]
        exact_all, t_exact = timed(lambda: exact_variance(model, x_test, variances))  # noqa: B023
        for k, prior in enumerate(priors):
            var = variances[:, k].contiguous()
            (_, lin), t_lin = timed(lambda: linearized_variance(model, x_test, var))  # noqa: B023
            mc, t_mc = timed(lambda: mc_variance(model, x_test, var, samples))  # noqa: B023
            exact = exact_all[k]
            rows += [
                f"| {state} | {prior:g} | forward DB vs exact | {compare(lin, exact)} "
                f"| {t_lin * 1e3:.0f} | {t_exact * 1e3:.0f} |",
                f"| {state} | {prior:g} | forward DB vs MC | {compare(lin, mc)} "
                f"| {t_lin * 1e3:.0f} | {t_mc * 1e3:.0f} |",
                f"| {state} | {prior:g} | exact vs MC | {compare(exact, mc)} "
                f"| {t_exact * 1e3:.0f} | {t_mc * 1e3:.0f} |",
            ]
        per_layer.append((state, layer_ratios(model, x_test, variances[:, 0].contiguous())))
        print(f"  {state} done (DB over the training set: {t_db:.1f} s)", flush=True)

    return "\n".join(
        [
            f"### Linearised predictive variance: UNet 8-16-32 ({n_params:,} parameters, tanh, "
            f"nearest upsampling), {size}×{size}, float32",
            "",
            f"Posterior: diagonal Laplace, σ² = 1/(DB + prior precision), DB of the BCE loss "
            f"summed over {n_train} training images (`synthetic_lesions`). Variances of the "
            f"logits on {n_test} test images, {n_test * size * size} pixels. forward DB = "
            "`lsn_ext.forward.linearized_variance` (one pass, D after every layer); exact = "
            "Σ_θ J_oθ² σ²_θ (one vectorised VJP per pixel); MC = variance of the logits over "
            f"{samples} samples θ ~ N(θ_MAP, diag σ²) (the sampling predictive; its own relative "
            f"standard error per pixel is about √(2/{samples - 1}) = "
            f"{(2 / (samples - 1)) ** 0.5:.3f}). rel. err = ‖v − v_ref‖/‖v_ref‖, Pearson r and "
            "mean ratio = mean v / mean v_ref over all pixels. The exact time covers both prior "
            "precisions (one Jacobian); times are single runs on a shared machine.",
            "",
            "| model | prior prec. | comparison | rel. err | Pearson r | mean ratio "
            "| time [ms] | reference time [ms] |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Per layer, prior precision {priors[0]:g}: only that layer's parameters keep their "
            "variance. share = its part of the exact variance (summed over pixels); ratio = "
            "forward DB / exact for that layer alone. It is 1 where forward DB is exact: for the "
            "head, and for the last decoder conv, which only tanh and the 1×1 head follow (its "
            "output channels have separate parameters, and nothing after it mixes pixels).",
            "",
            "| layer | " + " | ".join(f"{state}: share / ratio" for state, _ in per_layer) + " |",
            "|---|" + "---|" * len(per_layer),
            *(
                f"| {layer} | "
                + " | ".join(f"{r[layer][0]:.3f} / {r[layer][1]:.3f}" for _, r in per_layer)
                + " |"
                for layer in per_layer[0][1]
            ),
        ]
    )


def layer_ratios(model: nn.Module, x: Tensor, variance: Tensor) -> dict[str, tuple[float, float]]:
    """Per layer: its share of the exact variance, and forward DB / exact (means over pixels).

    Only the layer's own parameters keep their variance; the others get zero.
    """
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    modules = [n.rsplit(".", 1)[0] for n in names]
    layers = list(dict.fromkeys(modules))  # in parameter order
    owner = torch.cat(
        [torch.full((k,), layers.index(m)) for m, k in zip(modules, sizes, strict=True)]
    )
    masks = torch.stack([(owner == i).to(variance.dtype) for i in range(len(layers))], 1)
    exact = exact_variance(model, x, variance[:, None] * masks)  # [layers, *out]
    total = exact.sum()
    out = {}
    for i, layer in enumerate(layers):
        _, lin = linearized_variance(model, x, variance * masks[:, i])
        out[layer] = ((exact[i].sum() / total).item(), (lin.sum() / exact[i].sum()).item())
    return out


def main(argv: list[str] | None = None) -> None:
    quick_benchmark_main(
        __doc__, "## Linearised predictive variance benchmark", run, RESULTS, THREADS, argv
    )


if __name__ == "__main__":
    main()
