"""MONAI and nnU-Net networks: what runs, and how accurate diagonal backprop is on them.

Run from the repository root::

    ./dev bench real_networks            # ~5-10 minutes on 2 cores
    ./dev bench real_networks --quick    # a smoke run: fewer networks and steps

Networks: the case table of ``tests/real_networks.py`` (library defaults for normalisation,
activations and upsampling, sizes shrunk; random initialisation). Two tables:

**A. Networks it has been run on.** For each network, float64, the case's input size: DB
(``lsn_ext.diag_backprop``), MC (``ggn_diagonal(estimator="mc")``), the laplace-torch workflow
(``Laplace(..., backend=DiagBackprop)``: fit with the default Monte-Carlo curvature on 4 images,
``optimize_prior_precision(method="marglik")``) and ``lsn_ext.predict``. Each cell is ``ok``
with the wall time of one call, or the error. A network whose library does not import is listed
with the reason.

**B. DB's accuracy at initialisation and after training.** Each 2-D network is trained in
float32 (Adam, lr 3e-3, batch 16, mean loss, random flips) on 32×32 nuclei patches
(``lsn_ext.data.nuclei_patches``; 1 class: BCE on the mask; 2 classes: cross-entropy on
background/nucleus). At step 0 and after ``STEPS`` steps a float64 copy is evaluated on 2
training patches against the exact GGN diagonal (``lsn_ext.exact.exact_ggn_diagonal``, one call
per image, summed): DB's total trace ratio (Σ DB / Σ exact), relative error ‖DB − exact‖ /
‖exact‖, and the per-tensor trace ratios (min, median, max over the weight and bias tensors with
non-zero exact trace), and MC(1)'s total trace ratio and relative error (mean over 8 seeds). The
3-D network is measured at initialisation only (no 3-D data ships with the package).

The tables are printed and written to ``integration/results/bench_real_networks.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from integration import harness
from integration.harness import report
from lsn_ext.data import nuclei_patches, random_flips
from lsn_ext.exact import exact_ggn_diagonal
from tests.real_networks import REAL_NETWORKS, RealNetwork

THREADS = 1
RESULTS = harness.RESULTS / "bench_real_networks.md"
STEPS, LR, BATCH, MC_SEEDS = 300, 3e-3, 16, 8
QUICK = ("monai-dynunet-2d", "nnunet-plainconvunet-2d", "monai-unet-3d")


def _timed(fn) -> str:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as err:
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        return f"**fails**: {last[:160]}"
    return f"ok ({time.perf_counter() - t0:.2f} s)"


def status_row(name: str, case: RealNetwork) -> str:
    reason = case.available()
    if reason is not None:
        return f"| {name} | – | skipped: {reason[:90]} | | | |"
    torch.manual_seed(0)
    model = case.build().double()
    n_params = f"{sum(p.numel() for p in model.parameters()):,}"
    x, y = case.batch(4, seed=1)
    x, y = x.double(), y.double() if case.classes == 1 else y
    db = _timed(lambda: lsn_ext.diag_backprop(model, x, y, case.loss))
    mc = _timed(lambda: lsn_ext.ggn_diagonal(model, x, y, case.loss, estimator="mc"))
    state: dict = {}

    def laplace() -> None:
        from laplace import Laplace

        la = Laplace(
            model,
            "classification",
            subset_of_weights="all",
            hessian_structure="diag",
            backend=lsn_ext.DiagBackprop,
            backend_kwargs={"loss": case.loss, "seed": 0},
        )
        la.fit(DataLoader(TensorDataset(x, y), batch_size=2))
        la.optimize_prior_precision(method="marglik", n_steps=20)
        state["la"] = la

    fit = _timed(laplace)
    pred = _timed(lambda: lsn_ext.predict(state["la"], x, n_samples=10)) if "la" in state else "–"
    shape = "×".join(map(str, case.in_shape[1:]))
    return f"| {name} | {n_params} | {shape} | {db} | {mc} | {fit} | {pred} |"


def _targets(mask: Tensor, classes: int) -> Tensor:
    """A {0, 1} mask ``[N, 1, H, W]`` as BCE targets, or as class indices ``[N, H, W]``."""
    return mask if classes == 1 else mask[:, 0].long()


def _train(model: nn.Module, case: RealNetwork, x: Tensor, y: Tensor, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (BATCH,), generator=gen)
        xb, yb = random_flips(x[idx], y[idx], generator=gen)
        yb = _targets(yb, case.classes)
        out = model(xb)
        if case.classes == 1:
            loss = F.binary_cross_entropy_with_logits(out, yb)
        else:
            loss = F.cross_entropy(out, yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _ratios(
    estimate: dict[str, Tensor], exact: dict[str, Tensor]
) -> tuple[float, float, list[float], int]:
    """Total trace ratio, relative error, per-tensor trace ratios and the vanishing tensors.

    Per-tensor ratios cover the tensors whose exact trace is at least 1e-6 of the largest; the
    others ("vanishing": e.g. a convolution's bias right before an instance norm, which removes
    it) are counted where the estimate gives them at least 1e-3 of the largest exact trace.
    """
    num = sum(float(d.sum()) for d in estimate.values())
    den = sum(float(d.sum()) for d in exact.values())
    err = sum(float((estimate[k] - e).square().sum()) for k, e in exact.items()) ** 0.5
    norm = sum(float(e.square().sum()) for e in exact.values()) ** 0.5
    top = max(float(e.sum()) for e in exact.values())
    per = [float(estimate[k].sum() / e.sum()) for k, e in exact.items() if e.sum() >= 1e-6 * top]
    vanishing = sum(
        1 for k, e in exact.items() if e.sum() < 1e-6 * top and estimate[k].sum() >= 1e-3 * top
    )
    return num / den, err / norm, per, vanishing


def accuracy_rows(name: str, case: RealNetwork, steps: int) -> list[str]:
    if case.available() is not None:
        return []
    torch.manual_seed(0)
    model = case.build()
    spatial = len(case.in_shape) - 1
    if spatial == 2:
        splits = nuclei_patches(32, 16, dtype=torch.float32)
        x_all, y_all = splits.train_x, splits.train_y
        checkpoints = [0, steps]
    else:
        x_all, y_all = case.batch(2)
        checkpoints = [0]
    rows = []
    done = 0
    for step in checkpoints:
        _train(model, case, x_all, y_all, step - done)
        done = step
        m64 = _double_copy(model)
        if spatial == 2:
            x, y = x_all[:2].double(), _targets(y_all[:2].double(), case.classes)
        else:
            x, y = x_all.double(), y_all
        exact: dict[str, Tensor] = {}
        for i in range(x.shape[0]):
            part = exact_ggn_diagonal(m64, x[i : i + 1], y[i : i + 1], case.loss)
            exact = {k: exact.get(k, 0) + v for k, v in part.items()}
        try:
            db = lsn_ext.diag_backprop(m64, x, y, case.loss).diagonals
            tr, err, per, vanishing = _ratios(db, exact)
            db_cells = (
                f"{tr:.3g} | {err:.2f} | {min(per):.2g} / {statistics.median(per):.2g} / "
                f"{max(per):.2g} | {vanishing}"
            )
        except Exception as e:
            db_cells = f"fails: {type(e).__name__} | | |"
        mc = [
            _ratios(
                lsn_ext.ggn_diagonal(
                    m64, x, y, case.loss, estimator="mc",
                    generator=torch.Generator().manual_seed(s),
                ).diagonals,
                exact,
            )[:2]
            for s in range(MC_SEEDS)
        ]  # fmt: skip
        mc_tr = statistics.mean(t for t, _ in mc)
        mc_err = statistics.mean(e for _, e in mc)
        rows.append(f"| {name} | {step} | {db_cells} | {mc_tr:.2f} | {mc_err:.2f} |")
    return rows


def _double_copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).double().eval()


def run(quick: bool) -> str:
    names = [n for n in REAL_NETWORKS if not quick or n in QUICK]
    steps = 20 if quick else STEPS
    status = [
        "## A. Networks it has been run on",
        "",
        "Random initialisation, eval mode, float64, 4 images of the given size. Times: one call.",
        "",
        "| network | parameters | input | DB | MC | Laplace fit + marglik | predict (10 samples) |",
        "|---|---:|---|---|---|---|---|",
    ]
    status += [status_row(n, REAL_NETWORKS[n]) for n in names]
    accuracy = [
        "## B. DB's accuracy against the exact GGN diagonal, at init and after training",
        "",
        f"2-D: 32×32 nuclei patches, {steps} Adam steps; evaluated on 2 patches. 3-D: 8³ "
        "random input, initialisation only. Per tensor: min / median / max of the trace "
        "ratios over the tensors whose exact trace is at least 1e-6 of the largest. "
        "Vanishing tensors: exact trace below that (a convolution bias right before an "
        "instance norm, which removes it) but DB's at least 1e-3 of the largest exact trace. "
        f"MC(1): mean over {MC_SEEDS} seeds.",
        "",
        "| network | step | DB trace / exact | DB rel. error | DB per-tensor trace ratio | "
        "DB on vanishing tensors | MC(1) trace / exact | MC(1) rel. error |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for n in names:
        accuracy += accuracy_rows(n, REAL_NETWORKS[n], steps)
    return "\n".join(status) + "\n\n" + "\n".join(accuracy)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three networks, 20 steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    report("# Real networks (MONAI, nnU-Net)", lambda: run(args.quick), args.quick, RESULTS)


if __name__ == "__main__":
    main()
