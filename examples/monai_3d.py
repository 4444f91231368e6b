"""A MONAI 3-D segmentation pipeline with a Laplace approximation and voxel-wise uncertainty
==========================================================================================

What it shows, in the order a MONAI user writes it:

1. Synthetic CT-like cases (bright ellipsoids in a noisy background with a bias field) on an
   anisotropic voxel grid (0.8 × 0.8 × 1.5 mm, two axes flipped, an origin away from 0), written
   as NIfTI files and listed as `[{"image": path, "label": path}, ...]`.
2. MONAI dictionary transforms (`LoadImaged`, `EnsureChannelFirstd`, `ScaleIntensityd`,
   `RandSpatialCropd`, `RandFlipd`, `CastToTyped`), `monai.data.Dataset` and `DataLoader`:
   batches `{"image": MetaTensor [N, 1, D, H, W], "label": [N, 1, D, H, W]}` with integer
   labels.
3. A `BasicUNet` trained on random crops with `DiceCELoss`.
4. laplace-torch's `Laplace(..., hessian_structure="diag", backend=DiagBackprop,
   dict_key_x="image", dict_key_y="label")` on the network wrapped in `lsn_ext.SelectInput`,
   fitted on the dictionary loader of the whole training volumes, and the prior precision from
   the marginal likelihood.
5. Uncertainty maps of a test volume larger than the training crops by sliding windows:
   `lsn_ext.predict(la, volume, n, window=lsn_ext.SlidingWindow(crop))`. MONAI's `SaveImage`
   writes them as NIfTI (foreground probability, its epistemic variance, predictive entropy,
   mutual information) with the test image's `MetaTensor` affine, so they overlay the scan in
   any viewer; MONAI's `DiceMetric` scores the prediction. A figure shows the middle slice of
   each map with a colorbar, and a summary gives the Dice and the mean entropy and mutual
   information inside the structures, outside them and on their boundary (`summary.json`).

Each step prints what it runs and how long it took; training, fit, prior and prediction (over
the posterior draws and the windows of each) show tqdm progress bars on stderr
(`--no-progress` hides them). Needs `pip install "lsn-ext[monai]"` (MONAI and nibabel). Run from
the repository root:

```bash
.venv/bin/python examples/monai_3d.py --out examples_out/monai_3d
.venv/bin/python examples/monai_3d.py --quick   # seconds: tiny volumes, few steps
LSN_EXT_QUICK=1 .venv/bin/python examples/monai_3d.py   # the same as --quick
```

The flags are checked before torch is imported, so `--help` and a mistyped flag answer at once.
`LSN_EXT_QUICK=1` selects the quick sizes without arguments (for a documentation build that runs
the examples). Open the maps in any NIfTI viewer (3D Slicer, ITK-SNAP, fsleyes) over
`test_image.nii.gz`.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

KEYS = ("image", "label")
# Sizes of the full run and of --quick; a flag given on the command line overrides either.
FULL = {
    "cases": 6,
    "size": 40,
    "crop": 32,
    "test_size": (64, 48, 48),
    "features": (8, 8, 16, 16, 32, 8),
    "steps": 50,
    "samples": 10,
}
QUICK = {
    "cases": 2,
    "size": 36,
    "crop": 32,
    "test_size": (32, 32, 48),
    "features": (4, 4, 4, 8, 8, 4),
    "steps": 4,
    "samples": 4,
}
QUICK_ENV = "LSN_EXT_QUICK"  # "1": --quick's sizes without arguments (documentation builds)


def int_at_least(low: int, multiple: int = 1) -> Callable[[str], int]:
    """An argparse type: an int ``>= low`` that is a multiple of ``multiple``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or value % multiple:
            also = f" and a multiple of {multiple}" if multiple > 1 else ""
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{also}, got {value}")
        return value

    return parse


def quick_from_environment(parser: argparse.ArgumentParser) -> bool:
    """Whether ``LSN_EXT_QUICK`` asks for the quick sizes (``1``); unset, empty or ``0``: no."""
    value = os.environ.get(QUICK_ENV, "")
    if value not in ("", "0", "1"):
        parser.error(f"{QUICK_ENV} must be 0 or 1 (or unset), got {value!r}")
    return value == "1"


def fill_sizes(args: argparse.Namespace, full: dict, quick: dict) -> argparse.Namespace:
    """The flags left out get ``--quick``'s sizes (with ``--quick``) or the full run's.

    A flag given on the command line is kept: ``--quick`` never overrides it.
    """
    for name, value in (quick if args.quick else full).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before anything runs; ``--quick`` fills only the flags left out."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def sized(flag: str, kind: Callable[[str], int], what: str, **kwargs) -> None:
        """A flag whose default is FULL's or QUICK's entry, filled in by fill_sizes."""
        name = flag[2:].replace("-", "_")
        full, quick = (
            " ".join(map(str, v)) if isinstance(v, tuple) else v for v in (FULL[name], QUICK[name])
        )
        parser.add_argument(
            flag,
            type=kind,
            default=argparse.SUPPRESS,
            help=f"{what} (default {full}; --quick: {quick})",
            **kwargs,
        )

    parser.add_argument("--out", type=Path, default=Path("examples_out/monai_3d"))
    sized("--cases", int_at_least(1), "training volumes")
    sized("--size", int_at_least(1), "edge of the training volumes")
    sized("--crop", int_at_least(1), "training crop = sliding window, at most --size")
    sized("--test-size", int_at_least(1), "test volume D H W", nargs=3)
    sized("--features", int_at_least(1), "BasicUNet features", nargs=6)
    sized("--steps", int_at_least(1), "training steps")
    parser.add_argument("--batch", type=int_at_least(1), default=2)
    sized("--samples", int_at_least(2), "posterior samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"tiny volumes and few steps (for tests; also {QUICK_ENV}=1)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.quick = getattr(args, "quick", False) or quick_from_environment(parser)
    args = fill_sizes(args, FULL, QUICK)
    if args.crop > args.size:
        parser.error(
            f"--crop {args.crop} exceeds --size {args.size}: the training crops are cut from "
            "the training volumes"
        )
    return args


class Steps:
    """Prints each step when it starts (``[k/n] what``) and its wall-clock seconds when it ends."""

    def __init__(self, total: int):
        self.total = total
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str, what: str) -> Iterator[None]:
        """One step, timed as ``seconds[name]``."""
        number = len(self.seconds) + 1
        print(f"[{number}/{self.total}] {what}", flush=True)
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        print(f"[{number}/{self.total}] done in {self.seconds[name]:.1f} s", flush=True)


if __name__ == "__main__":
    ARGS = parse_args()  # before the imports below: --help and bad flags answer without torch

import itertools
import json
import warnings

import matplotlib.pyplot as plt
import nibabel as nib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.colors import ListedColormap
from monai.data import DataLoader, Dataset, MetaTensor
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import BasicUNet
from monai.networks.utils import one_hot
from monai.transforms import (
    CastToTyped,
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    RandFlipd,
    RandSpatialCropd,
    SaveImage,
    ScaleIntensityd,
)
from monai.utils import set_determinism
from tqdm.auto import tqdm

# lsn_ext before laplace-torch: importing an lsn_ext name that needs laplace-torch (DiagBackprop)
# imports laplace-torch through lsn_ext, which explains a torchvision that does not match torch
# and silences only asdl's `torch.jit.script` deprecation warning. (`import lsn_ext` alone is
# lazy and imports nothing yet.)
from lsn_ext import DiagBackprop, SelectInput, SlidingWindow, predict

# isort: split
from laplace import Laplace

# Voxel-to-world transform (mm) of the synthetic scans: 0.8 × 0.8 × 1.5 mm voxels, the first two
# axes flipped and the origin away from 0, as a CT series may be stored. LoadImaged keeps it in
# each MetaTensor's `affine`, and SaveImage writes the maps with the test image's.
AFFINE = np.array(
    [
        [-0.8, 0.0, 0.0, 60.0],
        [0.0, -0.8, 0.0, 40.0],
        [0.0, 0.0, 1.5, -90.0],
        [0.0, 0.0, 0.0, 1.0],
    ]
)
LABEL_COLOURS = ListedColormap(["black", "tab:orange"])


def synthetic_case(shape: tuple[int, int, int], rng: np.random.Generator):
    """One case: an image and its binary label map, both ``[D, H, W]``.

    One to three axis-aligned ellipsoids (label 1) brighter than the background, a linear bias
    field across the volume and Gaussian noise.
    """
    grid = np.stack(np.meshgrid(*(np.arange(s) for s in shape), indexing="ij"))
    label = np.zeros(shape, dtype=np.uint8)
    for _ in range(rng.integers(1, 4)):
        radii = rng.uniform(0.12, 0.25, size=3) * np.array(shape)
        centre = rng.uniform(radii, np.array(shape) - radii)
        inside = (((grid - centre[:, None, None, None]) / radii[:, None, None, None]) ** 2).sum(0)
        label[inside <= 1.0] = 1
    bias = 1.0 + 0.3 * np.tensordot(
        rng.uniform(-1, 1, size=3), grid / np.array(shape)[:, None, None, None], 1
    )
    image = bias * (0.3 + 0.5 * label) + rng.normal(0.0, 0.2, size=shape)
    return image.astype(np.float32), label


def write_nifti(array: np.ndarray, path: Path) -> Path:
    """Save a ``[D, H, W]`` array on the voxel grid of :data:`AFFINE`."""
    nib.save(nib.Nifti1Image(array, AFFINE), path)
    return path


def write_cases(folder: Path, n: int, shape: tuple[int, int, int], seed: int) -> list[dict]:
    """Write ``n`` cases as NIfTI files; MONAI's list of ``{"image": path, "label": path}``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        image, label = synthetic_case(shape, rng)
        cases.append(
            {
                "image": str(write_nifti(image, folder / f"case{i:03d}_image.nii.gz")),
                "label": str(write_nifti(label, folder / f"case{i:03d}_label.nii.gz")),
            }
        )
    return cases


def transforms(crop: int | None) -> Compose:
    """Training transforms (random crops of ``crop`` voxels and flips), or whole volumes."""
    steps = [
        LoadImaged(keys=KEYS),
        EnsureChannelFirstd(keys=KEYS, channel_dim="no_channel"),
        ScaleIntensityd(keys="image"),
    ]
    if crop is not None:
        steps += [
            RandSpatialCropd(keys=KEYS, roi_size=(crop,) * 3, random_size=False),
            RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
            RandFlipd(keys=KEYS, prob=0.5, spatial_axis=1),
        ]
    steps.append(CastToTyped(keys="label", dtype=torch.long))  # cross-entropy needs integers
    return Compose(steps)


def boundary(label: torch.Tensor) -> torch.Tensor:
    """Voxels of ``label [D, H, W]`` with a voxel of the other class in their 3×3×3 block."""
    x = label[None, None].float()
    dilated = F.max_pool3d(x, 3, stride=1, padding=1)
    eroded = -F.max_pool3d(-x, 3, stride=1, padding=1)
    return (dilated != eroded)[0, 0]


def figure(panels: dict[str, tuple[torch.Tensor, dict]], affine, title: str) -> plt.Figure:
    """The middle slice across the last axis of each ``[D, H, W]`` volume, with its colorbar.

    ``panels``: title → (volume, ``imshow`` options). The pixels have the voxels' aspect ratio
    (the spacings of the first two axes, from ``affine``).
    """
    spacing = np.linalg.norm(np.asarray(affine)[:3, :3], axis=0)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(2.4 * len(panels), 3.3), layout="constrained", squeeze=False
    )
    for ax, (name, (volume, style)) in zip(axes[0], panels.items(), strict=True):
        middle = volume[..., volume.shape[-1] // 2].numpy()
        shown = ax.imshow(middle, aspect=spacing[0] / spacing[1], interpolation="nearest", **style)
        ax.set_title(name, fontsize=9)
        ax.set_axis_off()
        bar = fig.colorbar(shown, ax=ax, orientation="horizontal", shrink=0.9)
        bar.ax.tick_params(labelsize=7)
        if style.get("cmap") is LABEL_COLOURS:
            bar.set_ticks([0, 1], labels=["background", "foreground"])
    fig.suptitle(title, fontsize=9)
    return fig


def main(args: argparse.Namespace) -> dict:
    """Run the pipeline; return the summary that is also written to ``summary.json``."""
    torch.set_default_dtype(torch.float32)
    set_determinism(seed=args.seed)
    plt.switch_backend("Agg")  # files only, no display needed
    args.out.mkdir(parents=True, exist_ok=True)
    steps, progress = Steps(6), not args.no_progress

    # 1-2. NIfTI cases, dictionary transforms, MONAI Dataset and DataLoader.
    shape = f"{args.size}³"
    with steps("data", f"data: {args.cases} training cases of {shape} voxels as NIfTI"):
        cases = write_cases(args.out / "data", args.cases, (args.size,) * 3, args.seed)
        train_loader = DataLoader(
            Dataset(cases, transforms(args.crop)), batch_size=args.batch, shuffle=True
        )
        fit_loader = DataLoader(Dataset(cases, transforms(None)), batch_size=1)

    # 3. BasicUNet, DiceCE, Adam on random crops.
    with steps("train", f"train: BasicUNet, {args.steps} steps on {args.crop}³ crops, DiceCE"):
        net = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=args.features)
        optimiser = torch.optim.Adam(net.parameters(), lr=1e-2)
        loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
        net.train()
        batches = (batch for _ in itertools.count() for batch in train_loader)
        losses = []
        bar = tqdm(range(args.steps), desc="train", unit="step", disable=not progress)
        for _ in bar:
            batch = next(batches)
            optimiser.zero_grad()
            loss = loss_fn(net(batch["image"]), batch["label"])
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        print(f"trained {args.steps} steps on {args.crop}³ crops: DiceCE {losses[0]:.3f}", end="")
        print(f" -> {losses[-1]:.3f}")

    # 4. Laplace over all weights, DiagBackprop curvature, marginal-likelihood prior.
    with steps("laplace", "Laplace: GGN diagonal (DiagBackprop), marglik prior precision"):
        net.eval()
        la = Laplace(
            SelectInput(net, "image"),
            "classification",
            subset_of_weights="all",
            hessian_structure="diag",
            backend=DiagBackprop,
            dict_key_x="image",
            dict_key_y="label",
        )
        la.fit(fit_loader, progress_bar=progress)
        with warnings.catch_warnings():
            # laplace-torch reminds that its own `la(x)` defaults to link_approx="probit"; this
            # example predicts with lsn_ext's predict, which takes the link approximation itself.
            warnings.filterwarnings(
                "ignore",
                message=r"By default `link_approx` is `probit`",
                category=UserWarning,
                module=r"laplace\.baselaplace",
            )
            la.optimize_prior_precision(
                method="marglik", prior_structure="scalar", progress_bar=progress
            )
        prior = la.prior_precision.item()
        print(f"Laplace on {la.n_params} weights, marglik prior precision {prior:.4g}")

    # 5. Sliding-window uncertainty maps of a larger test volume.
    test_shape = "×".join(map(str, args.test_size))
    what = f"test volume {test_shape}, {args.samples} samples, {args.crop}³ windows"
    with steps("predict", f"predict: {what}"):
        test_image, test_label = synthetic_case(tuple(args.test_size), np.random.default_rng(10**6))
        test = transforms(None)(
            {
                "image": str(write_nifti(test_image, args.out / "test_image.nii.gz")),
                "label": str(write_nifti(test_label, args.out / "test_label.nii.gz")),
            }
        )
        window = SlidingWindow((args.crop,) * 3, overlap=0.25, sw_batch_size=4)
        maps = predict(
            la,
            test["image"][None],
            args.samples,
            window=window,
            generator=torch.Generator().manual_seed(args.seed),
            progress_bar=progress,
        )

    label = test["label"][0].as_tensor()
    pred = maps.mean[0].argmax(0)
    with steps("score", "score: MONAI's DiceMetric (foreground), entropy and MI by region"):
        dice_metric = DiceMetric(include_background=False, reduction="mean")
        dice_metric(y_pred=one_hot(pred[None, None], 2), y=one_hot(label[None, None], 2))
        dice = dice_metric.aggregate().item()
        regions = {
            "inside": (label == 1) & ~boundary(label),
            "outside": (label == 0) & ~boundary(label),
            "boundary": boundary(label),
        }

    volumes = {
        "prob_foreground": maps.mean[0, 1],
        "variance_foreground": maps.variance[0, 1],
        "entropy": maps.entropy[0],
        "mutual_information": maps.mutual_information[0],
    }
    png = args.out / "uncertainty.png"
    with steps("write", f"write: the maps with SaveImage (test image's affine), {png.name}"):
        files = {}
        for name, volume in volumes.items():
            # The test image's metadata (affine, source file) travels with each map.
            saver = SaveImage(
                output_dir=args.out,
                output_postfix=name,
                output_dtype=np.float32,
                resample=False,
                separate_folder=False,
                print_log=False,
                savepath_in_metadict=True,
            )
            saved = saver(MetaTensor(volume[None], meta=test["image"].meta))
            files[name] = saved.meta["saved_to"]
        binary = {"cmap": LABEL_COLOURS, "vmin": -0.5, "vmax": 1.5}
        panels = {
            "image": (test["image"][0].as_tensor(), {"cmap": "gray"}),
            "ground truth": (label, binary),
            "prediction": (pred, binary),
            "P(foreground)": (volumes["prob_foreground"], {"vmin": 0, "vmax": 1}),
            "predictive entropy (nats)": (volumes["entropy"], {"vmin": 0, "vmax": np.log(2)}),
            "mutual information (nats)": (volumes["mutual_information"], {"vmin": 0}),
        }
        title = f"test volume {test_shape}, middle slice across the last axis; Dice {dice:.3f}"
        fig = figure(panels, test["image"].affine, title)
        fig.savefig(png, dpi=80)
        plt.close(fig)

    summary = {
        "test_shape": list(args.test_size),
        "dice": dice,
        "prior_precision": prior,
        "n_params": la.n_params,
        "train_loss": [losses[0], losses[-1]],
        "entropy": {k: maps.entropy[0][m].mean().item() for k, m in regions.items()},
        "mutual_information": {
            k: maps.mutual_information[0][m].mean().item() for k, m in regions.items()
        },
        "voxels": {k: int(m.sum()) for k, m in regions.items()},
        "files": {"maps": files, "figure": str(png)},
        "seconds": steps.seconds,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))

    print(
        f"test volume {tuple(args.test_size)}, {args.samples} posterior samples, windows "
        f"{args.crop}³: Dice {dice:.3f}"
    )
    for name in ("entropy", "mutual_information"):
        parts = "  ".join(f"{k} {v:.4f}" for k, v in summary[name].items())
        print(f"mean {name:18s} {parts}")
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in steps.seconds.items()))
    print(f"figure {png}; maps and summary.json in {args.out}")
    return summary


if __name__ == "__main__":
    main(ARGS)
