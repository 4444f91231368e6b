"""Benchmark the accuracy of the GGN-diagonal estimators on U-Nets over the course of training.

Run from the repository root::

    ./dev bench accuracy           # ~8-10 minutes on 2 cores
    ./dev bench accuracy --quick   # a smoke run (< 1 minute)

or ``.venv/bin/python -m integration.benchmarks.bench_accuracy [--quick]``.

Data: the real nuclei image (``lsn_ext.data.nuclei_patches``), 32×32 patches with stride 16
(16×16 in ``--quick``); training uses random flips. Cases:

- binary: ``UNet(1, 1, widths=(8, 16, 32))`` (tanh, nearest upsampling), BCE on the nuclei mask;
- 3 classes: ``UNet(1, 3, widths=(8, 16, 32))``, cross-entropy on background (0), nucleus
  interior (1) and nucleus boundary (2) = the foreground pixels that a 3×3 erosion of the mask
  removes (a background pixel among the 8 neighbours; the patch border does not count);
- deep binary (not in ``--quick``): the LSN paper's 5-level backbone ``widths=(8, 16, 32, 64,
  128)``, BCE, final checkpoint only.

Each network is trained in float32 with Adam (lr 3e-3, batch 16, mean loss) from a fixed seed.
At each checkpoint (step 0 = the random initialisation) a float64 copy is evaluated on a fixed
batch of training patches (those at evenly spaced quantiles of the foreground fraction) with the
summed loss (``lsn_ext.BCEWithLogits()`` / ``lsn_ext.CrossEntropy()``):

- exact: ``lsn_ext.exact.exact_ggn_diagonal``, one call per image, summed (the GGN is a sum over
  the images and the model does not couple them; one call on the whole batch would push every
  output through the backward pass of every image);
- ``lsn_ext.ggn_diagonal`` with ``estimator="db"`` (deterministic), ``"mc"`` and
  ``"db_calibrated"`` with ``k`` Rademacher vectors (k = 1 and 16); each random estimator is run
  with ``R`` seeds (``torch.Generator().manual_seed(seed)``, the same seeds for MC and DB-cal):
  32 for k = 1 (cheap, and its heavy-tailed traces need many seeds to test the mean), 8 for
  k = 16.

Measures, over all parameters and per parameter tensor (weights and biases separately: the unit
that ``db_calibrated`` rescales): trace ratio Σ estimate / Σ exact, relative error
‖estimate − exact‖ / ‖exact‖, and Spearman's rank correlation with the exact diagonal
(``scipy.stats.spearmanr``); random estimators as mean ± std over the seeds. Time: wall time of
one call on the evaluation batch, the median over ``R`` calls (one per seed) after a warm-up
call; for the exact diagonal, one run over the images. At each case's last checkpoint, the mean
of MC(1)'s tensor traces over 1,000 seeds tests unbiasedness (Table D).

The tables are printed and written to ``integration/results/bench_accuracy.md``.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch import Tensor, nn

from integration import harness
from lsn_ext import BCEWithLogits, CrossEntropy, Loss, ggn_diagonal
from lsn_ext.data import nuclei_patches, random_flips
from lsn_ext.exact import exact_ggn_diagonal
from lsn_ext.models import UNet

# One thread: the machine's two cores are shared with other jobs, and two OpenMP threads that
# wait for a busy core are several times slower than one.
THREADS = 1
RESULTS = harness.RESULTS / "bench_accuracy.md"
LR, BATCH = 3e-3, 16
# Label → (estimator, Monte-Carlo vectors k).
ESTIMATORS = {
    "DB": ("db", 1),
    "MC(1)": ("mc", 1),
    "MC(16)": ("mc", 16),
    "DB-cal(1)": ("db_calibrated", 1),
    "DB-cal(16)": ("db_calibrated", 16),
}
Diagonals = dict[str, Tensor]


MANY_SEEDS = 1000


def n_seeds(k: int, quick: bool) -> int:
    """The seeds of a random estimator with ``k`` vectors; DB uses ``n_seeds(16)`` to time."""
    if quick:
        return 2
    return 32 if k == 1 else 8


@dataclass
class Case:
    """One network, its loss and data, and the training steps at which it is evaluated."""

    name: str
    widths: tuple[int, ...]
    classes: int
    loss: Loss
    train: tuple[Tensor, Tensor]
    val: tuple[Tensor, Tensor]
    evaluation: tuple[Tensor, Tensor]
    checkpoints: tuple[int, ...]
    chunk_size: int


@dataclass
class Measures:
    """One estimate against the exact diagonal, in total and per parameter tensor."""

    trace: float
    rel_err: float
    rho: float
    tensor_trace: dict[str, float]
    tensor_rho: dict[str, float]


@dataclass
class Evaluation:
    """All estimators at one checkpoint: the measures (one per seed) and the time of a call."""

    step: int
    train_loss: float
    val_loss: float
    exact: Diagonals
    exact_time: float
    measures: dict[str, list[Measures]]
    times: dict[str, float]
    many_seeds: Tensor | None = None  # [R, tensors] MC(1) trace ratios, last checkpoint only


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman's rank correlation of two flat tensors; NaN for a single entry."""
    return float(spearmanr(a.numpy(), b.numpy()).statistic) if a.numel() > 1 else math.nan


def compare(estimate: Diagonals, exact: Diagonals) -> Measures:
    """The measures of ``estimate`` against ``exact`` (both ``{name: diagonal}``)."""
    e = torch.cat([estimate[n].reshape(-1) for n in exact])
    x = torch.cat([d.reshape(-1) for d in exact.values()])
    return Measures(
        trace=(e.sum() / x.sum()).item(),
        rel_err=((e - x).norm() / x.norm()).item(),
        rho=spearman(e, x),
        tensor_trace={n: (estimate[n].sum() / d.sum()).item() for n, d in exact.items()},
        tensor_rho={n: spearman(estimate[n].reshape(-1), d.reshape(-1)) for n, d in exact.items()},
    )


def three_classes(mask: Tensor) -> Tensor:
    """Class map ``[N, H, W]`` of a mask ``[N, 1, H, W]``: background 0, interior 1, boundary 2.

    The boundary is the foreground minus its 3×3 erosion (max pooling pads with −∞, so the patch
    border is no boundary).
    """
    eroded = -F.max_pool2d(-mask, 3, 1, 1)
    return (2 * mask - eroded)[:, 0].long()


def evaluation_indices(mask: Tensor, n: int) -> Tensor:
    """The ``n`` patches at the quantiles ``i / (n + 1)`` of the foreground fraction."""
    order = mask.mean((1, 2, 3)).argsort()
    return order[[round(i * (len(order) - 1) / (n + 1)) for i in range(1, n + 1)]]


def timed(fn: Callable[[int], Diagonals], repeats: int) -> tuple[list[Diagonals], float]:
    """``fn(i)`` for ``i < repeats`` after a warm-up call: the results and the median time."""
    fn(0)
    results, times = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        results.append(fn(i))
        times.append(time.perf_counter() - t0)
    return results, statistics.median(times)


@torch.no_grad()
def mean_loss(model: nn.Module, loss: Loss, data: tuple[Tensor, Tensor]) -> float:
    """The loss per pixel of ``model`` on ``data``."""
    x, y = data
    return loss.value(model(x), y).item() / (x.shape[0] * x.shape[-2] * x.shape[-1])


def evaluate(case: Case, model: nn.Module, step: int, quick: bool) -> Evaluation:
    """Every estimator against the exact GGN diagonal, on a float64 copy of ``model``."""
    train_loss, val_loss = (mean_loss(model, case.loss, data) for data in (case.train, case.val))
    model = copy.deepcopy(model).double().eval()
    x, y = case.evaluation
    x, y = x.double(), y.double() if y.is_floating_point() else y
    t0 = time.perf_counter()
    parts = [
        exact_ggn_diagonal(model, x[i : i + 1], y[i : i + 1], case.loss, chunk_size=case.chunk_size)
        for i in range(x.shape[0])
    ]
    exact_time = time.perf_counter() - t0
    exact = {n: sum(p[n] for p in parts) for n in parts[0]}

    def call(seed: int, estimator: str, k: int) -> Diagonals:
        generator = torch.Generator().manual_seed(seed)
        return ggn_diagonal(
            model, x, y, case.loss, estimator=estimator, mc_samples=k, generator=generator
        ).diagonals

    def traces(diagonals: Diagonals) -> Tensor:
        return torch.stack([diagonals[n].sum() for n in exact])

    measures, times = {}, {}
    for label, (estimator, k) in ESTIMATORS.items():
        repeats = n_seeds(16 if label == "DB" else k, quick)
        diagonals, times[label] = timed(functools.partial(call, estimator=estimator, k=k), repeats)
        # DB is deterministic: its repeats only time it.
        measures[label] = [compare(d, exact) for d in diagonals[: 1 if label == "DB" else None]]
    many_seeds = None
    if step == case.checkpoints[-1]:
        seeds = range(n_seeds(1, quick) if quick else MANY_SEEDS)
        many_seeds = torch.stack([traces(call(s, "mc", 1)) for s in seeds]) / traces(exact)
    return Evaluation(step, train_loss, val_loss, exact, exact_time, measures, times, many_seeds)


def train_and_evaluate(case: Case, quick: bool) -> list[Evaluation]:
    """Train the case's network from a fixed seed; evaluate it at every checkpoint."""
    torch.manual_seed(0)
    model = UNet(1, case.classes, widths=case.widths)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(0)
    x, y = case.train
    evaluations, done = [], 0
    for checkpoint in case.checkpoints:
        t0 = time.perf_counter()
        for _ in range(checkpoint - done):
            idx = torch.randint(len(x), (BATCH,), generator=g)
            xb, yb = random_flips(x[idx], y[idx], g)
            loss = case.loss.value(model(xb), yb) / xb[:, 0].numel()
            opt.zero_grad()
            loss.backward()
            opt.step()
        t_train, done = time.perf_counter() - t0, checkpoint
        t0 = time.perf_counter()
        evaluations.append(evaluate(case, model, checkpoint, quick))
        print(
            f"  {case.name}, step {checkpoint}: train loss {evaluations[-1].train_loss:.4f}, "
            f"val loss {evaluations[-1].val_loss:.4f} (training {t_train:.0f} s, "
            f"evaluation {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return evaluations


def fmt(values: list[float]) -> str:
    """One value, or mean ± std of several, to 3 significant digits; "—" for NaN."""
    if any(math.isnan(v) for v in values):
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}"


def bias_table(results: dict[str, list[Evaluation]]) -> list[str]:
    """Table A: totals and the spread of the per-tensor trace ratios, every checkpoint."""
    rows = [
        "| case | step | estimator | trace ratio | rel. error | Spearman ρ "
        "| per-tensor trace ratio min / median / max | time [s] | time / DB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, evaluations in results.items():
        for ev in evaluations:
            db_time = ev.times["DB"]
            rows.append(
                f"| {name} | {ev.step} | exact | 1 | 0 | 1 | 1 / 1 / 1 "
                f"| {ev.exact_time:.2f} | {ev.exact_time / db_time:.0f} |"
            )
            for label, ms in ev.measures.items():
                spread = [
                    [f(list(m.tensor_trace.values())) for m in ms]
                    for f in (min, statistics.median, max)
                ]
                rows.append(
                    f"| {name} | {ev.step} | {label} | {fmt([m.trace for m in ms])} "
                    f"| {fmt([m.rel_err for m in ms])} | {fmt([m.rho for m in ms])} "
                    f"| {' / '.join(fmt(s) for s in spread)} "
                    f"| {ev.times[label]:.3f} | {ev.times[label] / db_time:.1f} |"
                )
    return rows


def layer_table(ev: Evaluation) -> list[str]:
    """Table B: per parameter tensor, trace ratio and Spearman ρ of every estimator."""
    total = sum(d.sum() for d in ev.exact.values())
    rows = [
        "| tensor | params | exact trace share | "
        + " | ".join(f"{label} ratio | {label} ρ" for label in ESTIMATORS)
        + " |",
        "|---|---|---|" + "---|---|" * len(ESTIMATORS),
    ]
    for n, d in ev.exact.items():
        cells = [
            f"{fmt([m.tensor_trace[n] for m in ms])} | {fmt([m.tensor_rho[n] for m in ms])}"
            for ms in ev.measures.values()
        ]
        rows.append(f"| {n} | {d.numel()} | {(d.sum() / total).item():.3g} | {' | '.join(cells)} |")
    return rows


def calibration_table(results: dict[str, list[Evaluation]]) -> list[str]:
    """Table C: the error of DB-cal's per-tensor traces across seeds."""
    rows = [
        "| case | step | estimator | rel. std of a tensor's trace over seeds: median / max "
        "| max over tensors of abs(ratio − 1): mean ± std over seeds | worst seed "
        "| tensors with mean ratio within 3 SE of 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, evaluations in results.items():
        for ev in evaluations:
            for label, ms in ev.measures.items():
                if not label.startswith("DB-cal"):
                    continue
                ratios = [[m.tensor_trace[n] for m in ms] for n in ev.exact]
                rel_std = [statistics.stdev(r) / statistics.mean(r) for r in ratios]
                worst = [max(abs(m.tensor_trace[n] - 1) for n in ev.exact) for m in ms]
                unbiased = sum(
                    abs(statistics.mean(r) - 1) <= 3 * statistics.stdev(r) / math.sqrt(len(r))
                    for r in ratios
                )
                rows.append(
                    f"| {name} | {ev.step} | {label} "
                    f"| {statistics.median(rel_std):.3f} / {max(rel_std):.3f} "
                    f"| {fmt(worst)} | {max(worst):.3f} | {unbiased}/{len(ratios)} |"
                )
    return rows


def unbiasedness_table(results: dict[str, list[Evaluation]]) -> list[str]:
    """Table D: the mean of many one-vector trace estimates at each case's last checkpoint."""
    rows = [
        "| case | step | seeds | total trace ratio: mean ± SE | median | tensors within 3 SE "
        "of 1 | largest abs(z) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, evaluations in results.items():
        ev = evaluations[-1]
        ratios = ev.many_seeds
        weights = torch.stack([d.sum() for d in ev.exact.values()])
        total = ratios @ (weights / weights.sum())
        z = (ratios.mean(0) - 1) / (ratios.std(0) / math.sqrt(len(ratios)))
        rows.append(
            f"| {name} | {ev.step} | {len(ratios)} | {total.mean():.3f} ± "
            f"{total.std() / math.sqrt(len(total)):.3f} | {total.median():.3f} "
            f"| {int((z.abs() <= 3).sum())}/{len(z)} | {z.abs().max():.1f} |"
        )
    return rows


def make_cases(quick: bool) -> list[Case]:
    """The benchmark's cases on the nuclei patches (smaller and fewer in ``--quick``)."""
    size, stride, n_eval = (16, 16, 2) if quick else (32, 16, 4)
    splits = nuclei_patches(size, stride, dtype=torch.float32)
    chosen = evaluation_indices(splits.train_y, n_eval)
    shallow, deep = (8, 16, 32), (8, 16, 32, 64, 128)
    # name, widths, classes, checkpoints, chunk size of the exact diagonal (fastest on one core)
    specs = [
        ("binary", shallow, 1, (0, 20) if quick else (0, 50, 200, 1000, 2000), 64),
        ("3 classes", shallow, 3, (0, 20) if quick else (0, 200, 2000), 64),
    ]
    if not quick:
        specs.append(("binary, 5 levels", deep, 1, (2000,), 16))
    cases = []
    for name, widths, classes, checkpoints, chunk_size in specs:
        if classes == 1:
            loss, train_y, val_y = BCEWithLogits(), splits.train_y, splits.val_y
        else:
            loss, train_y, val_y = (
                CrossEntropy(),
                *map(three_classes, (splits.train_y, splits.val_y)),
            )
        evaluation = splits.train_x[chosen], train_y[chosen]
        cases.append(
            Case(
                name,
                widths,
                classes,
                loss,
                (splits.train_x, train_y),
                (splits.val_x, val_y),
                evaluation,
                checkpoints,
                chunk_size,
            )
        )
    return cases


def run(quick: bool) -> str:
    """Train and evaluate every case; the Markdown tables."""
    cases = make_cases(quick)
    results, header = {}, []
    for case in cases:
        results[case.name] = train_and_evaluate(case, quick)
        n_params = sum(d.numel() for d in results[case.name][0].exact.values())
        header.append(
            f"- {case.name}: `UNet(1, {case.classes}, widths={case.widths})`, {n_params:,} "
            f"parameters, {type(case.loss).__name__}"
        )
    size = cases[0].train[0].shape[-1]
    n_train, n_eval = cases[0].train[0].shape[0], cases[0].evaluation[0].shape[0]
    binary = results[cases[0].name][-1]
    return "\n".join(
        [
            f"### GGN-diagonal estimators against the exact diagonal, nuclei {size}×{size}",
            "",
            *header,
            "",
            f"Training: Adam (lr {LR:g}, batch {BATCH}, mean loss, random flips) on {n_train} "
            f"training patches, float32, seed 0. Evaluation: float64, summed loss, {n_eval} "
            "training patches (at evenly spaced quantiles of the foreground fraction). Random "
            f"estimators: mean ± std over {n_seeds(1, quick)} seeds for k = 1 and "
            f"{n_seeds(16, quick)} for k = 16. Time: one call on the evaluation batch "
            "(median over the seeds); exact: one run, per image, summed.",
            "",
            "#### Checkpoints (loss per pixel, float32, no augmentation)",
            "",
            "| case | step | train loss | validation loss |",
            "|---|---|---|---|",
            *(
                f"| {name} | {ev.step} | {ev.train_loss:.4f} | {ev.val_loss:.4f} |"
                for name, evaluations in results.items()
                for ev in evaluations
            ),
            "",
            "#### A. Bias over training",
            "",
            "Trace ratio = Σ estimate / Σ exact, rel. error = ‖estimate − exact‖ / ‖exact‖ and "
            "Spearman ρ over all parameters; per-tensor trace ratio: the minimum, median and "
            "maximum over the parameter tensors (weights and biases separately).",
            "",
            *bias_table(results),
            "",
            f"#### B. Per parameter tensor: {cases[0].name}, step {binary.step}",
            "",
            "ratio = the tensor's trace ratio, ρ = Spearman's rank correlation within the "
            "tensor (— for a tensor of one entry). With the same seed, DB-cal(k)'s trace of "
            "every tensor is MC(k)'s (the same Rademacher draws), and its ranks within a tensor "
            "are DB's (a positive rescaling).",
            "",
            *layer_table(binary),
            "",
            "#### C. Calibrated per-tensor traces",
            "",
            "Per tensor: the relative standard deviation over the seeds of DB-cal's trace "
            "(median and maximum over the tensors); per seed: the largest deviation of a "
            "tensor's trace ratio from 1 (mean ± std over the seeds, and the worst seed); the "
            "tensors whose trace ratio, averaged over the seeds, lies within 3 standard errors "
            "of 1 (unbiasedness, tensor by tensor). With 8 seeds (k = 16) this test is sound; "
            "with 32 seeds (k = 1) it is not: a one-vector trace is a quadratic form zᵀAz in "
            "Rademacher z with a few dominant directions, skewed like a χ²₁ (the median below "
            "the mean), so 32 draws often miss the rare large ones and understate both the "
            "mean and its standard error. Table D repeats the test with many seeds.",
            "",
            *calibration_table(results),
            "",
            "#### D. Unbiasedness of the one-vector traces, many seeds",
            "",
            "MC(1) at each case's last checkpoint with seeds 0…R−1; with the same seed its "
            "tensor traces are DB-cal(1)'s. z = (mean ratio − 1) / SE per tensor.",
            "",
            *unbiasedness_table(results),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    harness.quick_benchmark_main(
        __doc__, "## Accuracy of the GGN-diagonal estimators", run, RESULTS, THREADS, argv
    )


if __name__ == "__main__":
    main()
