"""A MONAI 3-D segmentation pipeline with a Laplace approximation and voxel-wise uncertainty.

What it shows, in the order a MONAI user writes it:

1. Synthetic CT-like cases (bright ellipsoids in a noisy background with a bias field), written as
   NIfTI files and listed as ``[{"image": path, "label": path}, ...]``.
2. MONAI dictionary transforms (``LoadImaged``, ``EnsureChannelFirstd``, ``ScaleIntensityd``,
   ``RandSpatialCropd``, ``RandFlipd``, ``CastToTyped``), ``monai.data.Dataset`` and
   ``DataLoader``: batches ``{"image": MetaTensor [N, 1, D, H, W], "label": [N, 1, D, H, W]}``
   with integer labels.
3. A ``BasicUNet`` trained on random crops with ``DiceCELoss``.
4. laplace-torch's ``Laplace(..., hessian_structure="diag", backend=lsn_ext.DiagBackprop,
   dict_key_x="image", dict_key_y="label")`` on the network wrapped in ``lsn_ext.SelectInput``,
   fitted on the dictionary loader of the whole training volumes, and the prior precision from
   the marginal likelihood.
5. Uncertainty maps of a test volume larger than the training crops by sliding windows:
   ``lsn_ext.predict(la, volume, n, window=lsn_ext.SlidingWindow(crop))``, saved as NIfTI
   (foreground probability, its epistemic variance, predictive entropy, mutual information), and
   a summary: Dice, and the mean entropy and mutual information inside the structures, outside
   them, and on their boundary (``summary.json`` beside the maps).

Run from the repository root (CPU, float32; about a minute on two cores at the defaults)::

    .venv/bin/python examples/monai_3d.py --out examples_out/monai_3d
    .venv/bin/python examples/monai_3d.py --quick   # seconds: tiny volumes, few steps

Open the maps in any NIfTI viewer (3D Slicer, ITK-SNAP, fsleyes) over ``test_image.nii.gz``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
import torch.nn.functional as F
from laplace import Laplace
from monai.data import DataLoader, Dataset
from monai.losses import DiceCELoss
from monai.networks.nets import BasicUNet
from monai.transforms import (
    CastToTyped,
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    RandFlipd,
    RandSpatialCropd,
    ScaleIntensityd,
)
from monai.utils import set_determinism

import lsn_ext

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


def fill_sizes(args: argparse.Namespace, full: dict, quick: dict) -> argparse.Namespace:
    """The flags left out get ``--quick``'s sizes (with ``--quick``) or the full run's.

    A flag given on the command line is kept: ``--quick`` never overrides it.
    """
    for name, value in (quick if args.quick else full).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


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
    """Save a ``[D, H, W]`` array with 1 mm isotropic voxels."""
    nib.save(nib.Nifti1Image(array, np.eye(4)), path)
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
        "--quick", action="store_true", help="tiny volumes and few steps (for tests)"
    )
    args = fill_sizes(parser.parse_args(argv), FULL, QUICK)
    if args.crop > args.size:
        parser.error(
            f"--crop {args.crop} exceeds --size {args.size}: the training crops are cut from "
            "the training volumes"
        )
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the pipeline; return the summary that is also written to ``summary.json``."""
    args = parse_args(argv)
    torch.set_default_dtype(torch.float32)
    set_determinism(seed=args.seed)
    warnings.filterwarnings("ignore", category=UserWarning)  # laplace-torch's notes
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # 1-2. NIfTI cases, dictionary transforms, MONAI Dataset and DataLoader.
    cases = write_cases(args.out / "data", args.cases, (args.size,) * 3, args.seed)
    train_loader = DataLoader(
        Dataset(cases, transforms(args.crop)), batch_size=args.batch, shuffle=True
    )
    fit_loader = DataLoader(Dataset(cases, transforms(None)), batch_size=1)

    # 3. BasicUNet, DiceCE, Adam on random crops.
    net = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=args.features)
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-2)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    net.train()
    step, losses = 0, []
    while step < args.steps:
        for batch in train_loader:
            optimiser.zero_grad()
            loss = loss_fn(net(batch["image"]), batch["label"])
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
            step += 1
            if step == args.steps:
                break
    t_train = time.perf_counter() - start
    print(f"trained {args.steps} steps on {args.crop}³ crops: DiceCE {losses[0]:.3f}", end="")
    print(f" -> {losses[-1]:.3f}")

    # 4. Laplace over all weights, DiagBackprop curvature, marginal-likelihood prior.
    net.eval()
    la = Laplace(
        lsn_ext.SelectInput(net, "image"),
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
        dict_key_x="image",
        dict_key_y="label",
    )
    la.fit(fit_loader)
    la.optimize_prior_precision(method="marglik", prior_structure="scalar")
    prior = la.prior_precision.item()
    t_laplace = time.perf_counter() - start - t_train
    print(f"Laplace on {la.n_params} weights, marglik prior precision {prior:.4g}")

    # 5. Sliding-window uncertainty maps of a larger test volume.
    test_image, test_label = synthetic_case(tuple(args.test_size), np.random.default_rng(10**6))
    test = transforms(None)(
        {
            "image": str(write_nifti(test_image, args.out / "test_image.nii.gz")),
            "label": str(write_nifti(test_label, args.out / "test_label.nii.gz")),
        }
    )
    window = lsn_ext.SlidingWindow((args.crop,) * 3, overlap=0.25, sw_batch_size=4)
    maps = lsn_ext.predict(
        la,
        test["image"][None],
        args.samples,
        window=window,
        generator=torch.Generator().manual_seed(args.seed),
    )
    t_predict = time.perf_counter() - start - t_train - t_laplace

    label = test["label"][0].as_tensor()
    volumes = {
        "prob_foreground": maps.mean[0, 1],
        "variance_foreground": maps.variance[0, 1],
        "entropy": maps.entropy[0],
        "mutual_information": maps.mutual_information[0],
    }
    files = {
        name: str(write_nifti(v.numpy().astype(np.float32), args.out / f"{name}.nii.gz"))
        for name, v in volumes.items()
    }
    pred = maps.mean[0].argmax(0)
    dice = (2 * (pred * label).sum() / (pred.sum() + label.sum()).clamp_min(1)).item()
    regions = {
        "inside": (label == 1) & ~boundary(label),
        "outside": (label == 0) & ~boundary(label),
        "boundary": boundary(label),
    }
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
        "files": files,
        "seconds": {"train": t_train, "laplace": t_laplace, "predict": t_predict},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))

    print(
        f"test volume {tuple(args.test_size)}, {args.samples} posterior samples, windows "
        f"{args.crop}³: Dice {dice:.3f}"
    )
    for name in ("entropy", "mutual_information"):
        parts = "  ".join(f"{k} {v:.4f}" for k, v in summary[name].items())
        print(f"mean {name:18s} {parts}")
    print(f"time: train {t_train:.1f} s, Laplace {t_laplace:.1f} s, predict {t_predict:.1f} s")
    print(f"maps and summary.json in {args.out}")
    return summary


if __name__ == "__main__":
    main()
