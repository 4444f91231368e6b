"""Speed and memory of GGN-diagonal estimators and of Kron fits relative to a training step.

Run from the repository root::

    ./dev bench speed                          # all parts, saved to results/bench_speed.md
    ./dev bench speed --quick                  # tiny sizes and networks, a smoke run (not saved)
    ./dev bench speed --parts time --sizes 64  # only the 64² / 64³ timings
    ./dev bench speed --parts time --cases unet:256:32  # other networks, sizes, batches
    ./dev bench speed --device cuda --out integration/results/bench_speed_cuda.md  # on a GPU
    ./dev bench speed --threads 1              # the committed run (a busy 2-core CPU)
    ./dev bench speed --parts kron-time kron-memory  # only the Kron fits

What each part measures, how, on which networks, and the targets: ``integration/README.md``
(section "bench_speed").
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch
from torch import nn

import lsn_ext
from integration import harness
from integration.harness import (
    MALLOC_ENV,
    error_cell,
    median_range,
    memory_counter,
    paper_unet,
    peak_increase,
    pool_runs,
    random_batch,
    run_header,
    run_worker,
    table_row,
    timed_wall_cpu,
)

RESULTS = harness.RESULTS / "bench_speed.md"
SLOW = 8.0  # warm-up longer than this many training steps: timed in --slow-reps repetitions
LR = 1e-6  # Adam's step size: the weights barely move over the repetitions
QUICK_FEATURES = (4, 4, 8, 8, 16, 4)

METHODS = {
    "train": "training step",
    "db": "lsn_ext DB",
    "mc": "lsn_ext MC(1)",
    "backpack_mc": "BackPACK DiagGGNMC",
    "backpack_exact": "BackPACK DiagGGNExact",
    "curvlinops": "curvlinops hutchinson_diag(GGN, 1)",
}
MEMORY_METHODS = ("train", "db", "mc")
NETWORKS = {
    "unet": "paper U-Net",
    "unet_ce": "paper U-Net, 2 classes (CE)",
    "basicunet2d": "MONAI BasicUNet 2-D",
    "basicunet3d": "MONAI BasicUNet 3-D",
}
# (network, edge length, batch, default repetitions: fewer where one call takes tens of seconds)
TIME_CASES = (
    ("unet", 64, 8, 40),
    ("unet", 128, 8, 10),
    ("basicunet2d", 128, 8, 3),
    ("basicunet3d", 64, 1, 2),
)
QUICK_TIME_CASES = (("unet", 32, 2, 2), ("basicunet2d", 32, 2, 2), ("basicunet3d", 32, 1, 2))
MEMORY_SIZES, QUICK_MEMORY_SIZES = (64, 96, 128), (32,)
TIME_TARGETS = {
    ("unet", 64, "mc"): 1.3,
    ("unet", 128, "mc"): 1.3,
    ("basicunet2d", 128, "mc"): 1.6,
    ("basicunet3d", 64, "mc"): 1.6,
    ("unet", 64, "db"): 1.1,
}
MEMORY_TARGET = 1.25  # DB and MC(1), 3-D BasicUNet at 64³, 96³, 128³

KRON_FRACTIONS = (1 / 8, 1 / 32)  # position_fraction of the sampled KFAC-expand rows
KRON_METHODS = {
    "train": "training step",
    "kron_expand": "lsn_ext Kron, expand",
    **{
        f"kron_expand_{round(1 / f)}": f"lsn_ext Kron, expand, position_fraction=1/{round(1 / f)}"
        for f in KRON_FRACTIONS
    },
    "kron_reduce": "lsn_ext Kron, reduce",
    "curvlinops_kron": "laplace-torch + curvlinops kron (type-2, its default)",
    "curvlinops_kron_mc": "laplace-torch + curvlinops kron (MC, stochastic=True)",
}
# (network, edge length, batch, repetitions, processes)
KRON_CASES = (("unet", 64, 8, 10, 3), ("unet_ce", 64, 8, 10, 3), ("basicunet3d", 64, 1, 3, 1))
QUICK_KRON_CASES = (("unet", 32, 2, 2, 1), ("unet_ce", 32, 2, 2, 1), ("basicunet3d", 32, 1, 2, 1))
KRON_MEMORY_CASES = (("unet", 64, 8), ("unet_ce", 64, 8), ("basicunet3d", 64, 1))
QUICK_KRON_MEMORY_CASES = (("unet_ce", 32, 2),)
KRON_TIME_TARGET = 2.0  # a Kron fit per batch, × a training step (issue 39, item 6)
KRON_MEMORY_TARGET = 1.5  # its peak memory, × a training step's
KRON_SLOW_REPS = 3  # at least this many repetitions of every Kron method


@dataclass(frozen=True)
class Case:
    """One network at one input size; ``quick`` shrinks BasicUNet's features."""

    net: str
    size: int
    batch: int
    quick: bool
    device: str
    part: str = "diag"  # "diag": GGN diagonals (METHODS); "kron": Kron fits (KRON_METHODS)

    @property
    def label(self) -> str:
        dims = 3 if self.net == "basicunet3d" else 2
        return f"{NETWORKS[self.net]} {self.size}{'³' if dims == 3 else '²'}, batch {self.batch}"

    @property
    def loss(self) -> str:
        return "bce" if self.net == "unet" else "ce"

    @property
    def methods(self) -> dict[str, str]:
        """The methods of this case's part: the GGN diagonals or the Kron fits."""
        return KRON_METHODS if self.part == "kron" else METHODS

    def loss_module(self) -> nn.Module:
        if self.loss == "bce":
            return nn.BCEWithLogitsLoss(reduction="sum")
        return nn.CrossEntropyLoss(reduction="sum")

    def build(self) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        """Model (seed 0, eval mode), inputs and targets, on the device, float32."""
        torch.manual_seed(0)
        if self.net in ("unet", "unet_ce"):
            model = paper_unet(1 if self.net == "unet" else 2)
            x, y = random_batch(self.batch, self.size)
            if self.net == "unet_ce":  # class indices [N, H, W]
                y = y[:, 0].long()
        else:
            from monai.networks.nets import BasicUNet

            dims = 3 if self.net == "basicunet3d" else 2
            kw = {"features": QUICK_FEATURES} if self.quick else {}
            model = BasicUNet(spatial_dims=dims, in_channels=1, out_channels=2, **kw)
            g = torch.Generator().manual_seed(0)
            x = torch.randn(self.batch, 1, *[self.size] * dims, generator=g)
            y = torch.randint(0, 2, (self.batch, *[self.size] * dims), generator=g)
        return model.eval().to(self.device), x.to(self.device), y.to(self.device)


# --------------------------------------------------------------------------------------------
# The methods: set-up (model, data, case) → a call to time. Set-up or call may raise.
# --------------------------------------------------------------------------------------------


def _train(model: nn.Module, x, y, case: Case) -> Callable[[], None]:
    loss_fn = case.loss_module()
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def _lsn(estimator: str) -> Callable:
    def setup(model: nn.Module, x, y, case: Case) -> Callable[[], None]:
        return lambda: lsn_ext.ggn_diagonal(model, x, y, case.loss, estimator=estimator)

    return setup


def _backpack(extension: str) -> Callable:
    def setup(model: nn.Module, x, y, case: Case) -> Callable[[], None]:
        import backpack
        from backpack import extensions

        net = backpack.extend(copy.deepcopy(model), use_converter=True)
        loss_fn = backpack.extend(case.loss_module())

        def run() -> None:
            net.zero_grad(set_to_none=True)
            with backpack.backpack(getattr(extensions, extension)()):
                loss_fn(net(x), y).backward()

        return run

    return setup


def _curvlinops(model: nn.Module, x, y, case: Case) -> Callable[[], None]:
    from curvlinops import GGNLinearOperator, hutchinson_diag

    params = [p for p in model.parameters() if p.requires_grad]

    def run() -> None:
        ggn = GGNLinearOperator(
            model,
            case.loss_module(),
            params,
            [(x, y)],
            check_deterministic=False,
            num_data=x.shape[0],
        )
        hutchinson_diag(ggn, num_matvecs=1)

    return run


class NotApplicableError(Exception):
    """A method that does not apply to a case (the reason is the message)."""


def _kron(mode: str, fraction: float = 1.0) -> Callable:
    def setup(model: nn.Module, x, y, case: Case) -> Callable[[], object]:
        backend = lsn_ext.DiagBackprop(
            model,
            "classification",
            loss=case.loss,
            kron_mode=mode,
            kron_position_fraction=fraction,
        )
        return lambda: backend.kron(x, y, N=x.shape[0])

    return setup


def _curvlinops_kron(stochastic: bool) -> Callable:
    def setup(model: nn.Module, x, y, case: Case) -> Callable[[], object]:
        if case.loss != "ce":
            raise NotApplicableError(
                "laplace-torch has no Bernoulli likelihood: its 'classification' backends use "
                "cross-entropy (see the 2-class row)"
            )
        import laplace  # lsn_ext imported it first, with its import warning silenced

        backend = laplace.curvature.CurvlinopsGGN(model, "classification", stochastic=stochastic)
        return lambda: backend.kron(x, y, N=x.shape[0])

    return setup


SETUPS = {
    "train": _train,
    "db": _lsn("db"),
    "mc": _lsn("mc"),
    "backpack_mc": _backpack("DiagGGNMC"),
    "backpack_exact": _backpack("DiagGGNExact"),
    "curvlinops": _curvlinops,
    "kron_expand": _kron("expand"),
    **{f"kron_expand_{round(1 / f)}": _kron("expand", f) for f in KRON_FRACTIONS},
    "kron_reduce": _kron("reduce"),
    "curvlinops_kron": _curvlinops_kron(stochastic=False),
    "curvlinops_kron_mc": _curvlinops_kron(stochastic=True),
}


# --------------------------------------------------------------------------------------------
# Time
# --------------------------------------------------------------------------------------------


TIMES = ("times", "ratios", "cpu_times", "cpu_ratios")


def time_case(case: Case, reps: int, slow_reps: int) -> dict[str, dict]:
    """Per method of the case's part: wall and CPU ``times`` and paired ``ratios`` to the
    training step (:data:`TIMES`), ``{"error": reason}`` or ``{"skip": reason}``."""
    model, x, y = case.build()
    calls, out = {}, {}
    for m in case.methods:
        stage = "set-up"
        try:
            call = SETUPS[m](model, x, y, case)
            stage = "call"
            warm = timed_wall_cpu(call, case.device)[0]
        except NotApplicableError as why:
            out[m] = {"skip": str(why)}
            continue
        except Exception as err:
            if m == "train":
                raise
            out[m] = {"error": f"{stage}: {error_cell(err)}"}
            print(f"  {case.label}: {case.methods[m]} fails: {out[m]['error']}", flush=True)
            continue
        calls[m] = call
        out[m] = {"warmup": warm, **{k: [] for k in TIMES}}
    n_reps = {
        m: min(reps, slow_reps) if out[m]["warmup"] > SLOW * out["train"]["warmup"] else reps
        for m in calls
    }
    for r in range(reps):
        for m, call in calls.items():
            if m == "train" or r >= n_reps[m]:
                continue
            step, step_cpu = timed_wall_cpu(calls["train"], case.device)
            t, cpu = timed_wall_cpu(call, case.device)
            for who, wall, proc, ratio, cpu_ratio in (
                ("train", step, step_cpu, 1.0, 1.0),
                (m, t, cpu, t / step, cpu / step_cpu),
            ):
                for key, value in zip(TIMES, (wall, ratio, proc, cpu_ratio), strict=True):
                    out[who][key].append(value)
    del model, x, y, calls
    gc.collect()
    return out


def _timed_cases(items: list[tuple[Case, int, int, int]]) -> Iterator[tuple[Case, dict]]:
    """``(case, pooled)`` for each ``(case, reps, slow_reps, processes)``, as each finishes.

    :func:`time_case` runs in ``processes`` fresh processes; each method's times and ratios are
    pooled over them, and ``medians`` holds each process's median ratio. A method that fails in
    any process is reported as failing. With ``--quick`` (one process per case) all the cases
    run one after another in one process, which loads the libraries once. Lazy: a case runs
    when its result is asked for.
    """
    shared = all(case.quick and processes == 1 for case, _, _, processes in items)
    for group in [items] if shared and items else [[item] for item in items]:
        shown: set[str] = set()
        runs = [_run_time_worker(group, shown) for _ in range(group[0][3])]
        for i, (case, *_) in enumerate(group):
            yield case, pool_runs([run[i] for run in runs], TIMES)


def _run_time_worker(group: list[tuple[Case, int, int, int]], shown: set[str]) -> list[dict]:
    """One fresh process's :func:`time_case` of each case of ``group``, in order; prints its
    report lines not in ``shown`` yet."""
    spec = [{"case": asdict(c), "reps": reps, "slow_reps": slow} for c, reps, slow, _ in group]
    lines, results = run_worker(__spec__.name, "--_time-worker", spec)
    for line in lines:  # the peers' failures, once
        if line not in shown:
            shown.add(line)
            print(line, flush=True)
    return results


def time_table(timed: Iterable[tuple[Case, dict]], processes: int) -> str:
    rows = []
    for case, res in timed:
        for m, r in res.items():
            target = None if case.quick else TIME_TARGETS.get((case.net, case.size, m))
            if "error" in r:
                cells = [f"fails: {r['error']}", "—", "—", "0"]
                verdict = "FAIL (fails)" if target is not None else "—"
            else:
                ratio = statistics.median(r["ratios"])
                cells = [
                    f"{statistics.median(r['times']) * 1e3:.0f}",
                    f"{ratio:.2f}",
                    f"{min(r['medians']):.2f}–{max(r['medians']):.2f}",
                    str(len(r["times"])),
                ]
                verdict = "—" if target is None else ("PASS" if ratio <= target else "FAIL")
            goal = "—" if target is None else f"≤ {target}"
            rows.append(
                f"| {case.label} | {METHODS[m]} | " + " | ".join(cells) + f" | {goal} | {verdict} |"
            )
            print(rows[-1], flush=True)
    return "\n".join(
        [
            "### Time relative to a training step",
            "",
            "Training step = forward + summed loss + backward + Adam step. time: median over the "
            "repetitions [ms]; ratio: median over the repetitions of (method's time / the time "
            "of the training step run right before it); per process: the range of the "
            f"{processes} processes' own medians (each case runs in {processes} fresh "
            "process(es), and the repetitions of all are pooled); reps: timed repetitions after "
            "one warm-up call per process (fewer for a method slower than "
            f"{SLOW:g} steps at warm-up; the training step's count is of all its paired runs).",
            "",
            "| network | method | time [ms] | ratio to step | per process | reps | target "
            "| result |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def memory_worker(case: Case, method: str) -> dict:
    """Peak memory of one call above the baseline, in this fresh process (see the docstring);
    ``{"skip": reason}`` or ``{"error": reason}`` for a method that does not apply or fails."""
    model, x, y = case.build()
    try:
        call = SETUPS[method](model, x, y, case)
        factors = _kron_bytes(call())  # warm-up at full size: kernels, threads, optimizer state
    except NotApplicableError as why:
        return {"skip": str(why)}
    except Exception as err:
        if method == "train":
            raise
        return {"error": error_cell(err)}
    model.zero_grad(set_to_none=True)
    base, increase = peak_increase(call, case.device)
    return {"baseline": base, "peak_increase": increase, "factors": factors}


def _kron_bytes(out: object) -> int:
    """Bytes of the Kronecker factors in a ``(loss, Kron)`` result (0 for anything else)."""
    kfacs = getattr(out[1], "kfacs", None) if isinstance(out, tuple) and len(out) == 2 else None
    return sum(f.numel() * f.element_size() for entry in kfacs or [] for f in entry)


def _measured_cases(cells: list[tuple[Case, Sequence[str]]]) -> Iterator[tuple[Case, dict]]:
    """``(case, {method: memory_worker's result})`` for each ``(case, methods)``, as each
    finishes: every cell in a fresh process (``--quick``: all cells in one, which loads the
    libraries once), under ``MALLOC_ENV`` (a fixed mmap threshold and trimming make the RSS
    follow live tensors)."""
    flat = [(case, m) for case, methods in cells for m in methods]
    groups = [flat] if flat and all(c.quick for c, _ in flat) else [[cell] for cell in flat]
    results = (r for group in groups for r in _run_memory_worker(group))
    for case, methods in cells:
        yield case, {m: next(results) for m in methods}


def _run_memory_worker(cells: list[tuple[Case, str]]) -> list[dict]:
    spec = [{"case": asdict(case), "method": m} for case, m in cells]
    return run_worker(__spec__.name, "--_memory-worker", spec, MALLOC_ENV)[1]


def memory_table(measured: Iterable[tuple[Case, dict[str, dict]]], device: str) -> str:
    rows = []
    for case, results in measured:
        mib = {}
        for m, result in results.items():
            if "peak_increase" not in result:
                raise RuntimeError(f"{case.label}: {METHODS[m]} failed: {result}")
            mib[m] = result["peak_increase"] / 2**20
        for m in MEMORY_METHODS:
            ratio = mib[m] / mib["train"]
            target = None if case.quick or m == "train" else MEMORY_TARGET
            verdict = "—" if target is None else ("PASS" if ratio <= target else "FAIL")
            goal = "—" if target is None else f"≤ {target}"
            rows.append(
                f"| {case.label} | {METHODS[m]} | {mib[m]:.0f} | {ratio:.2f} | {goal} | {verdict} |"
            )
            print(rows[-1], flush=True)
    counter = memory_counter(device)
    return "\n".join(
        [
            "### Peak memory relative to a training step",
            "",
            f"One call in a fresh process per cell, after a full-size warm-up; peak: {counter}. "
            "The baseline holds the model, the Adam state (training step), the data and the "
            "warm-up's left-overs; gradients are freed before the measured call.",
            "",
            "| network | method | peak above baseline [MiB] | ratio to step | target | result |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )


# --------------------------------------------------------------------------------------------
# Kron fits (issue 39, item 6)
# --------------------------------------------------------------------------------------------


def kron_time_table(timed: Iterable[tuple[Case, dict]]) -> str:
    """Wall and CPU time of the Kron fits of one batch beside a training step of it."""
    rows = []
    for case, res in timed:
        for m, r in res.items():
            ours = m.startswith("kron")
            target = KRON_TIME_TARGET if ours and not case.quick else None
            goal = "—" if target is None else f"≤ {target:g}"
            if "skip" in r or "error" in r:
                text = f"not run: {r['skip']}" if "skip" in r else f"fails: {r['error']}"
                cells = [text, "—", "—", "0"]
                verdict = "—" if target is None else "FAIL (fails)"
            else:
                ratio = statistics.median(r["ratios"])
                cells = [
                    f"{statistics.median(r['times']) * 1e3:.0f}",
                    median_range(r["ratios"]),
                    median_range(r["cpu_ratios"]),
                    str(len(r["times"])),
                ]
                verdict = "—" if target is None else ("PASS" if ratio <= target else "FAIL")
            rows.append(table_row(case.label, KRON_METHODS[m], *cells, goal, verdict))
            print(rows[-1], flush=True)
    return "\n".join(
        [
            "### Kron fit of one batch relative to a training step",
            "",
            "`DiagBackprop(model, 'classification', loss=..., kron_mode=..., "
            "kron_position_fraction=...).kron(x, y, N=batch)`: KFAC factors over all weights "
            "(one Monte-Carlo draw of `G`; KFAC-expand's patch factor `A` from every position or "
            "from a random fraction of them, unbiased), the curvature laplace-torch's "
            "`KronLaplace.fit` adds up per batch; beside it laplace-torch + curvlinops "
            "`CurvlinopsGGN(model, 'classification', stochastic=...).kron(x, y, N=batch)` "
            "(KFAC-expand; type-2: exact `G` from one backward pass per class, its default; MC: "
            "one sampled label). Training step = forward + summed loss + backward + Adam step. "
            "wall: median over the repetitions [ms]; ratios: median (min–max) over the "
            "repetitions of (method's seconds / those of the training step run right before it), "
            "by wall clock and by the process's CPU time (`time.process_time`, all threads); "
            "reps: timed repetitions, pooled over fresh processes (3 for the 2-D cases, 1 for "
            f"the 3-D one), after one warm-up call each; at least {KRON_SLOW_REPS} for a method "
            f"slower than {SLOW:g} steps at warm-up. Target (issue 39): a Kron fit ≤ "
            f"{KRON_TIME_TARGET:g} × a training step, by wall clock.",
            "",
            "| network | method | wall [ms] | ratio to step (wall) | ratio to step (CPU) | reps "
            "| target | result |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def kron_memory_table(measured: Iterable[tuple[Case, dict[str, dict]]], device: str) -> str:
    """Peak memory of one Kron fit of a batch, relative to a training step's."""
    rows = []
    for case, results in measured:
        step = results["train"]["peak_increase"] / 2**20
        for m, r in results.items():
            target = KRON_MEMORY_TARGET if m.startswith("kron") and not case.quick else None
            goal = "—" if target is None else f"≤ {target:g}"
            if "peak_increase" not in r:
                text = f"not run: {r['skip']}" if "skip" in r else f"fails: {r['error']}"
                cells, verdict = [text, "—", "—"], "—" if target is None else "FAIL (fails)"
            else:
                mib = r["peak_increase"] / 2**20
                ratio = mib / step
                cells = [f"{mib:.0f}", f"{ratio:.2f}", f"{r['factors'] / 2**20:.0f}"]
                verdict = "—" if target is None else ("PASS" if ratio <= target else "FAIL")
            rows.append(table_row(case.label, KRON_METHODS[m], *cells, goal, verdict))
            print(rows[-1], flush=True)
    counter = memory_counter(device)
    return "\n".join(
        [
            "### Peak memory of a Kron fit relative to a training step",
            "",
            "As for the GGN diagonals: one call in a fresh process per cell, after a full-size "
            f"warm-up; peak: {counter}. The peak includes the factors the call "
            "returns; their size (float32) in the column *factors*: what laplace-torch's "
            "`KronLaplace` keeps per fit, whoever computes them. Target (issue 39): ≤ "
            f"{KRON_MEMORY_TARGET:g} × a training step's peak.",
            "",
            "| network | method | peak above baseline [MiB] | ratio to step | factors [MiB] "
            "| target | result |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


# --------------------------------------------------------------------------------------------


def _case(text: str) -> tuple[str, int, int, int]:
    """``NET:SIZE:BATCH`` → a time case (5 repetitions)."""
    try:
        net, size, batch = text.split(":")
        case = (net, int(size), int(batch), 5)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NET:SIZE:BATCH") from None
    if net not in NETWORKS:
        raise argparse.ArgumentTypeError(f"unknown network {net!r}; one of {sorted(NETWORKS)}")
    return case


def _header(args: argparse.Namespace, argv: list[str]) -> str:
    quick = (" Smoke run (--quick): the time cases of both parts share one worker process "
             "(where each had one), and the memory cells of both parts another.")  # fmt: skip
    return run_header(args.device, " ".join(["./dev bench speed", *argv])) + quick * args.quick


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and networks")
    parts = ["time", "memory", "kron-time", "kron-memory"]
    parser.add_argument("--parts", nargs="+", choices=parts, default=parts)
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=int,
        help="time only the networks at these edge lengths (default: all)",
    )
    parser.add_argument(
        "--memory-sizes",
        nargs="+",
        type=int,
        help="3-D edge lengths for the memory part (default 64 96 128)",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        type=_case,
        metavar="NET:SIZE:BATCH",
        help=f"time these cases instead of the default ones; NET in {sorted(NETWORKS)} "
        "(e.g. unet:256:32 basicunet3d:128:2 for a GPU's sizes)",
    )
    parser.add_argument("--reps", type=int, help="timed repetitions (default: 10 to 2 by size)")
    parser.add_argument(
        "--slow-reps",
        type=int,
        default=2,
        help=f"repetitions for a method slower than {SLOW:g} steps at warm-up",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"report file (default {RESULTS.name})"
    )
    parser.add_argument(
        "--processes",
        type=int,
        help="fresh processes per time case, repetitions pooled (default 3; 1 with --quick)",
    )
    parser.add_argument("--_memory-worker", help=argparse.SUPPRESS)
    parser.add_argument("--_time-worker", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float32)

    torch.set_num_threads(args.threads)
    if args._time_worker:  # a list of cases, one after another
        specs = json.loads(args._time_worker)
        print(json.dumps([time_case(Case(**s["case"]), s["reps"], s["slow_reps"]) for s in specs]))
        return
    if args._memory_worker:  # a list of cells, one after another
        specs = json.loads(args._memory_worker)
        print(json.dumps([memory_worker(Case(**s["case"]), s["method"]) for s in specs]))
        return

    cases = args.cases or (QUICK_TIME_CASES if args.quick else TIME_CASES)
    time_cases = [
        (Case(net, size, batch, args.quick, args.device), args.reps or reps)
        for net, size, batch, reps in cases
        if args.sizes is None or size in args.sizes
    ]
    memory_sizes = args.memory_sizes or (QUICK_MEMORY_SIZES if args.quick else MEMORY_SIZES)
    memory_cases = [Case("basicunet3d", s, 1, args.quick, args.device) for s in memory_sizes]
    kron_cases = [
        (Case(net, size, batch, args.quick, args.device, "kron"), args.reps or reps, processes)
        for net, size, batch, reps, processes in (QUICK_KRON_CASES if args.quick else KRON_CASES)
    ]
    kron_memory_cases = [
        Case(net, size, batch, args.quick, args.device, "kron")
        for net, size, batch in (QUICK_KRON_MEMORY_CASES if args.quick else KRON_MEMORY_CASES)
    ]

    parts, processes = set(args.parts), args.processes or (1 if args.quick else 3)
    slow = max(args.slow_reps, KRON_SLOW_REPS)
    timed = _timed_cases(  # lazy: each part's cases run when its table is made
        [(c, reps, args.slow_reps, processes) for c, reps in time_cases if "time" in parts]
        + [(c, reps, slow, n) for c, reps, n in kron_cases if "kron-time" in parts]
    )
    measured = _measured_cases(
        [(c, MEMORY_METHODS) for c in memory_cases if "memory" in parts]
        + [(c, tuple(KRON_METHODS)) for c in kron_memory_cases if "kron-memory" in parts]
    )

    t0 = time.perf_counter()
    sections = [
        "## Speed and memory against a training step" + (" (--quick)" if args.quick else ""),
        _header(args, argv),
    ]
    if "time" in parts:
        sections.append(time_table(islice(timed, len(time_cases)), processes))
    if "memory" in parts:
        sections.append(memory_table(islice(measured, len(memory_cases)), args.device))
    if "kron-time" in parts:
        sections.append(kron_time_table(timed))
    if "kron-memory" in parts:
        sections.append(kron_memory_table(measured, args.device))
    load = os.getloadavg()
    sections.append(
        f"Total benchmark time: {time.perf_counter() - t0:.0f} s; load average at the end: "
        f"{load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}."
    )
    text = "\n\n".join(sections) + "\n"
    print("\n" + text)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
