"""Benchmark diagonal backpropagation (DB) on U-Nets: cost against a training step, accuracy
against the exact GGN diagonal.

Run from the repository root::

    ./dev bench db            # all parts, ~6-8 minutes on 2 cores
    ./dev bench db --quick    # tiny sizes, a smoke run
    ./dev bench db --part a   # only the cost tables

or ``.venv/bin/python -m integration.benchmarks.bench_db [...]``.

Part (a): the LSN paper's U-Net (5 levels, 8-16-32-64-128, two 3×3 conv + tanh per block,
3 → 1 channels, batch 8, BCE, float32) at 64², 128², 256²: median wall time and peak memory of a
training step (forward + loss + backward) and of forward + DB, and the scaling exponent of the
time in the number of pixels.

Part (b): a 3-level U-Net (8-16-32, tanh, float64, random init, batch 2) at 16² and 32², BCE and
2-class cross-entropy: DB and a one-sample Monte-Carlo GGN diagonal against the exact diagonal.

Part (c): the same U-Net at 64² and 128²: time and peak memory of the Monte-Carlo and calibrated
estimators (:func:`lsn_ext.ggn_diagonal`) beside DB, relative to a training step. Their accuracy
on trained networks is measured by ``integration/benchmarks/bench_accuracy.py``.

The tables are printed and written to ``integration/results/bench_db.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import subprocess
import time

import torch
from torch import nn

from integration import harness
from integration.harness import (
    MALLOC_ENV,
    hwm_bytes,
    machine,
    maxrss_bytes,
    paper_unet,
    random_batch,
    reset_peak,
    rss_bytes,
    script_command,
    script_env,
    timed,
)
from lsn_ext.engine import diag_backprop
from lsn_ext.estimators import ggn_diagonal
from lsn_ext.exact import exact_ggn_diagonal, flatten_diagonals, mc_ggn_diagonal
from lsn_ext.models import UNet

THREADS = 2
RESULTS = harness.RESULTS / "bench_db.md"
WARMUP_SIZE = 16  # the memory worker's warm-up runs at this size, far below the measured peak


# --------------------------------------------------------------------------------------------
# Part (a): cost
# --------------------------------------------------------------------------------------------


def _train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss = nn.functional.binary_cross_entropy_with_logits(model(x), y, reduction="sum")
    loss.backward()


def _db_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    diag_backprop(model, x, y, loss="bce")


def _mc_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    ggn_diagonal(model, x, y, "bce", estimator="mc")


def _calibrated_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    ggn_diagonal(model, x, y, "bce", estimator="db_calibrated")


METHODS = {"train": _train_step, "db": _db_step, "mc": _mc_step, "db_calibrated": _calibrated_step}


def memory_worker(method: str, size: int, batch: int) -> dict:
    """Peak memory of one op, in a fresh process (run as ``--_memory-worker``).

    ``getrusage(RUSAGE_SELF).ru_maxrss`` is the maximum of this address space's peak RSS
    (``VmHWM``) and the peak carried over from the image before ``exec`` — i.e. the *parent's*
    RSS, since the worker is forked from the benchmark process — and it includes any warm-up.
    So the worker warms up at full size (kernels, thread pools, allocator state initialised),
    resets ``VmHWM`` to the current RSS through ``/proc/self/clear_refs``, takes the current RSS
    (model, data, warm-up left-overs) as the baseline, runs the op exactly once and reports
    ``VmHWM_after − RSS_baseline``. Without ``/proc`` it falls back to ``ru_maxrss`` with a
    warm-up at a tiny size, so that the warm-up does not set the peak (valid only when the op's
    peak exceeds the inherited one: flagged otherwise).
    """
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = paper_unet()
    fn = METHODS[method]
    x, y = random_batch(batch, size)
    can_reset = reset_peak()
    if can_reset:
        fn(model, x, y)
    else:
        fn(model, *random_batch(1, WARMUP_SIZE))
    model.zero_grad(set_to_none=True)
    gc.collect()
    peak = hwm_bytes if can_reset and reset_peak() else maxrss_bytes
    base, max_before = rss_bytes(), peak()
    fn(model, x, y)
    max_after = peak()
    return {
        "counter": "VmHWM after clear_refs" if peak is hwm_bytes else "ru_maxrss",
        "baseline": base,
        "max_before": max_before,
        "max_after": max_after,
        "ru_maxrss_after": maxrss_bytes(),
        "peak_increase": max_after - base,
        "valid": max_after > max_before,
    }


def _measure_memory(method: str, size: int, batch: int) -> dict:
    cmd = script_command(__spec__.name, "--_memory-worker", method, str(size), str(batch))
    # MALLOC_ENV: the RSS follows the live allocations (harness.MALLOC_ENV says why)
    out = subprocess.run(
        cmd, capture_output=True, text=True, check=True, env=script_env(**MALLOC_ENV)
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _time(model, x, y, reps: int, methods: tuple[str, ...] = ("train", "db")) -> dict[str, float]:
    """Median and minimum seconds per op, and the median of the per-pair ratios op/train.

    The methods alternate, so that load from other processes on a shared machine hits them
    alike; the paired ratios and the minima are the figures least affected by it. ``ratio`` is
    DB's, ``ratio_<method>`` every method's.
    """
    for m in methods:  # warm-up
        METHODS[m](model, x, y)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(reps):
        for m in methods:
            t0 = time.perf_counter()
            METHODS[m](model, x, y)
            times[m].append(time.perf_counter() - t0)
    out = {m: statistics.median(t) for m, t in times.items()}
    out |= {f"{m}_min": min(t) for m, t in times.items()}
    for m in methods:
        out[f"ratio_{m}"] = statistics.median(
            d / t for d, t in zip(times[m], times["train"], strict=True)
        )
    out["ratio"] = out["ratio_db"]
    return out


def part_a(sizes: list[int], batch: int, reps: dict[int, int]) -> str:
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model = paper_unet()
    n_params = sum(p.numel() for p in model.parameters())
    rows, times, mems = [], {}, {}
    for size in sizes:
        x, y = random_batch(batch, size)
        t = _time(model, x, y, reps[size])
        mem = {m: _measure_memory(m, size, batch) for m in ("train", "db")}
        reset = all(v["counter"] != "ru_maxrss" for v in mem.values())
        times[size] = t
        mems[size] = {m: v["peak_increase"] for m, v in mem.items()}
        mib = {m: v["peak_increase"] / 2**20 for m, v in mem.items()}
        flag = "" if all(v["valid"] for v in mem.values()) else " ⚠"
        rows.append(
            f"| {size}² | {reps[size]} | {t['train'] * 1e3:.0f} ({t['train_min'] * 1e3:.0f}) | "
            f"{t['db'] * 1e3:.0f} ({t['db_min'] * 1e3:.0f}) | {t['ratio']:.2f} | "
            f"{t['db_min'] / t['train_min']:.2f} | {mib['train']:.1f} | {mib['db']:.1f} | "
            f"{mib['db'] / mib['train']:.2f}{flag} |"
        )
        print(f"  (a) {size}²: {rows[-1]}", flush=True)

    lines = [
        f"### (a) Cost: the LSN paper's U-Net ({n_params:,} parameters; 5 levels 8-16-32-64-128, "
        f"2 × (3×3 conv + tanh) per block, nearest upsampling; 3 → 1 channels, batch {batch}, "
        "BCE (sum), float32)",
        "",
        "Training step = forward + loss + backward; DB = `diag_backprop` (forward + loss "
        "Hessian + one DB backward). Times: median over the repetitions, the two methods "
        "alternating, after one warm-up each. Peak memory: increase of the peak RSS over the "
        "RSS just before the op (model, data and warm-up left-overs are baseline), one op in a "
        "fresh process per cell; "
        + (
            "after a full-size warm-up the kernel's peak counter (VmHWM, what `ru_maxrss` "
            "reports for the process's own address space) is reset via "
            "`/proc/self/clear_refs`, so the peak is that of the single measured op. "
            "(`ru_maxrss` itself cannot be used as is: it includes the warm-up and the "
            "high-water mark the worker inherits from the forking parent across `exec`.) "
            "The workers run with a fixed glibc mmap threshold and heap trimming, so that "
            "memory freed by the warm-up is returned and the RSS follows live allocations."
            if reset
            else f"`ru_maxrss` with the warm-up at {WARMUP_SIZE}² so that it does not set the peak."
        ),
        "",
        "| image | reps | train step [ms] median (min) | forward+DB [ms] median (min) "
        "| time ratio DB/train (median of pairs) | ratio of minima "
        "| train peak [MiB] | DB peak [MiB] | memory ratio DB/train |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    if len(sizes) >= 2:
        lo, hi = sizes[0], sizes[-1]
        k = math.log((hi / lo) ** 2)

        def slope(m):
            return math.log(times[hi][m] / times[lo][m]) / k

        def mem_slope(m):
            return math.log(mems[hi][m] / mems[lo][m]) / k

        lines += [
            "",
            f"Scaling exponent in the number of pixels, {lo}² → {hi}² (log-log slope; 1 = "
            f"linear): time of the training step {slope('train'):.2f} (minima: "
            f"{slope('train_min'):.2f}), of forward+DB {slope('db'):.2f} (minima: "
            f"{slope('db_min'):.2f}); peak memory of the training step {mem_slope('train'):.2f}, "
            f"of forward+DB {mem_slope('db'):.2f}.",
        ]
    if any("⚠" in r for r in rows):
        lines.append(
            "⚠: the op did not raise the peak counter above its prior value; peak unreliable."
        )
    return "\n".join(lines)


def part_c(sizes: list[int], batch: int, reps: dict[int, int]) -> str:
    """Cost of the Monte-Carlo and calibrated estimators beside DB and a training step."""
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model = paper_unet()
    estimators = ("db", "mc", "db_calibrated")
    rows = []
    for size in sizes:
        x, y = random_batch(batch, size)
        t = _time(model, x, y, reps[size], ("train", *estimators))
        mem = {m: _measure_memory(m, size, batch) for m in ("train", *estimators)}
        mib = {m: v["peak_increase"] / 2**20 for m, v in mem.items()}
        cells = [
            f"{t[m] * 1e3:.0f} ms, {t[f'ratio_{m}']:.2f}×, {mib[m] / mib['train']:.2f}×"
            for m in estimators
        ]
        flag = "" if all(v["valid"] for v in mem.values()) else " ⚠"
        rows.append(f"| {size}² | {t['train'] * 1e3:.0f} ms | " + " | ".join(cells) + f"{flag} |")
        print(f"  (c) {size}²: {rows[-1]}", flush=True)
    return "\n".join(
        [
            f"### (c) Cost of the estimators (`lsn_ext.ggn_diagonal`), the same U-Net, batch "
            f"{batch}, BCE, float32",
            "",
            "Per estimator: median time, median of the paired time ratios to the training step, "
            "peak-memory ratio to the training step (measured as in (a)). `mc`: one Rademacher "
            "vector per image; `db_calibrated`: DB plus that Monte-Carlo pass.",
            "",
            "| image | train step | db | mc (k=1) | db_calibrated (k=1) |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )


# --------------------------------------------------------------------------------------------
# Part (b): accuracy
# --------------------------------------------------------------------------------------------


def _metrics(model: nn.Module, d: dict, exact: dict) -> list[float]:
    """Total rel. err, Pearson r, trace ratio; per tensor: median / max rel. err, min / max
    trace ratio."""
    v, e = flatten_diagonals(model, d), flatten_diagonals(model, exact)
    rel = ((v - e).norm() / e.norm()).item()
    corr = torch.corrcoef(torch.stack([v, e]))[0, 1].item()
    trace = (v.sum() / e.sum()).item()
    t_rel = [((d[k] - exact[k]).norm() / exact[k].norm()).item() for k in exact]
    t_tr = [(d[k].sum() / exact[k].sum()).item() for k in exact]
    return [rel, corr, trace, statistics.median(t_rel), max(t_rel), min(t_tr), max(t_tr)]


def _format(m: list[float], std: list[float] | None = None) -> str:
    """Table cells from :func:`_metrics` (± std for the first three when given)."""
    head = [
        f"{a:.3f}" if std is None else f"{a:.3f} ± {b:.3f}"
        for a, b in zip(m[:3], std or [0.0] * 3, strict=True)
    ]
    return " | ".join([*head, f"{m[3]:.2f} / {m[4]:.2f}", f"{m[5]:.2f} / {m[6]:.2f}"])


def part_b(sizes: list[int], mc_draws: int) -> str:
    torch.set_default_dtype(torch.float64)
    configs = [
        ("BCE", 1, "bce", None),
        ("CE, 2 classes", 2, "ce", "exact"),
        ("CE, 2 classes", 2, "ce", "diag"),
    ]
    for loss, classes in (("bce", 1), ("ce", 2)):  # warm-up: first calls pay one-time costs
        model = UNet(3, classes, widths=(8, 16, 32)).eval()
        x = torch.randn(1, 3, 4, 4)
        y = torch.zeros(1, 1, 4, 4) if loss == "bce" else torch.zeros(1, 4, 4, dtype=torch.long)
        exact_ggn_diagonal(model, x, y, loss)
        diag_backprop(model, x, y, loss)
        mc_ggn_diagonal(model, x, y, loss)
    rows, cache = [], {}
    for size in sizes:
        for label, classes, loss, first in configs:
            torch.manual_seed(0)
            model = UNet(3, classes, widths=(8, 16, 32), activation=nn.Tanh).eval()
            g = torch.Generator().manual_seed(1)
            x = torch.randn(2, 3, size, size, generator=g)
            if loss == "bce":
                y = (torch.rand(2, 1, size, size, generator=g) > 0.5).double()
            else:
                y = torch.randint(0, classes, (2, size, size), generator=g)
            if (size, loss) not in cache:  # the CE variants share model, data and exact diagonal
                cache[size, loss] = timed(lambda: exact_ggn_diagonal(model, x, y, loss))  # noqa: B023
            exact, t_exact = cache[size, loss]
            kw = {} if first is None else {"ce_first_step": first}
            runs = [
                timed(lambda: diag_backprop(model, x, y, loss, **kw).diagonals)  # noqa: B023
                for _ in range(5)
            ]
            db, t_db = runs[0][0], min(t for _, t in runs)
            db_m = _metrics(model, db, exact)
            name = label + ("" if first is None else f", first step `{first}`")
            rows.append(
                f"| {name} | {size}² | DB | {_format(db_m)} | {t_db * 1e3:.1f} "
                f"| {t_exact * 1e3:.0f} |"
            )
            if first == "diag":  # MC does not depend on the DB option: shown once per loss
                continue
            mc_m, mc_t = [], []
            for seed in range(mc_draws):
                gen = torch.Generator().manual_seed(100 + seed)
                mc, t_mc = timed(
                    lambda gen=gen: mc_ggn_diagonal(model, x, y, loss, generator=gen)  # noqa: B023
                )
                mc_m.append(_metrics(model, mc, exact))
                mc_t.append(t_mc)
            cols = list(zip(*mc_m, strict=True))
            mean = [statistics.mean(c) for c in cols]
            std = [statistics.stdev(c) for c in cols[:3]] if mc_draws > 1 else None
            rows.append(
                f"| {label} | {size}² | MC(1) | {_format(mean, std)} "
                f"| {statistics.median(mc_t) * 1e3:.1f} | — |"
            )
            print(f"  (b) {size}² {name} done", flush=True)

    return "\n".join(
        [
            "### (b) Accuracy against the exact GGN diagonal: 3-level U-Net (8-16-32, 2 × "
            "(3×3 conv + tanh) per block, nearest upsampling), 3 input channels, batch 2, "
            "float64, random init (seed 0), random inputs and targets",
            "",
            "Exact = `exact_ggn_diagonal` (one VJP per output entry). MC(1) = one-sample "
            "Monte-Carlo GGN diagonal, the estimator of BackPACK's `DiagGGNMC(mc_samples=1)` "
            "(targets sampled from the model's predictive, per-sample squared gradients). "
            "BackPACK itself cannot extend a U-Net whose skips are `torch.cat` in `forward`, so "
            "the same estimator is computed with `torch.func` (`lsn_ext.exact.mc_ggn_diagonal`, "
            "checked against BackPACK's `DiagGGNMC` on small Sequential CNNs in "
            f"`tests/test_exact.py`); MC rows: mean ± std over {mc_draws} independent "
            "one-sample draws. Times: DB best of 5, MC(1) median per draw, exact one run "
            "(the machine is shared: single timings can be inflated). "
            "rel. err = ‖d − d_exact‖/‖d_exact‖ and trace ratio = Σd / Σd_exact over all "
            "parameters; the per-tensor columns give the same per parameter tensor (median / "
            "max of the rel. err, min / max of the trace ratio; for MC the means over draws). "
            "The totals are dominated by the last layers, where DB is exact (for BCE the head "
            "and the last conv hold most of the trace); the per-tensor columns show the "
            "deeper layers.",
            "",
            "| loss | image | estimator | rel. err | Pearson r | trace ratio "
            "| tensor rel. err median / max | tensor trace ratio min / max "
            "| time [ms] | exact time [ms] |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument("--_memory-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._memory_worker:
        method, size, batch = args._memory_worker
        print(json.dumps(memory_worker(method, int(size), int(batch))))
        return

    torch.set_num_threads(THREADS)
    sections = ["## Diagonal backpropagation benchmark" + (" (--quick)" if args.quick else "")]
    sections.append(machine())
    t0 = time.perf_counter()
    if args.part in ("a", "all"):
        if args.quick:
            sections.append(part_a([32, 64], batch=2, reps={32: 2, 64: 2}))
        else:
            sections.append(part_a([64, 128, 256], batch=8, reps={64: 20, 128: 10, 256: 5}))
    if args.part in ("c", "all"):
        if args.quick:
            sections.append(part_c([32], batch=2, reps={32: 2}))
        else:
            sections.append(part_c([64, 128], batch=8, reps={64: 10, 128: 5}))
    if args.part in ("b", "all"):
        sections.append(part_b([8] if args.quick else [16, 32], mc_draws=3 if args.quick else 10))
    sections.append(f"Total benchmark time: {time.perf_counter() - t0:.0f} s.")
    text = "\n\n".join(sections) + "\n"
    print("\n" + text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
