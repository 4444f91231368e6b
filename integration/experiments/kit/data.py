"""The data of the experiments: the ``lesions`` and ``nuclei`` splits, loaders, the boxes and
shifts that corrupt test images, and the model-free image-statistics score.

- :class:`Data`, :func:`load_data` (the LSN paper's budget), :func:`load_converged` (the
  converged budget: also the number of in-distribution test images), :func:`loader`;
- :data:`SHIFTS`, :func:`shift`: the synthetic distribution shifts (LSN Fig. 7);
- :func:`boxed`: noise and black boxes of the LSN's Table 2, per seed;
- :data:`REGIONS`, :func:`region_means`: means within the mask's boundary band, inside, outside;
- :func:`volume_on_training_scale`, :func:`image_statistics`: the nuclei volume on the training
  image's intensity scale and the Mahalanobis score of (intensity mean, sd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from integration.experiments.kit.budget import QUICK, Budget, ConvergedBudget
from lsn_ext.data import (
    lesion_dataset,
    load_nuclei_3d,
    nuclei_patches,
    nuclei_volume_slices,
)
from lsn_ext.metrics import black_box, boundary_band, noise_box

SHIFTS = {  # name: (strengths, what a strength means)
    "blur": ((0.75, 1.5, 3.0), "Gaussian blur, σ in pixels"),
    "contrast": ((0.6, 0.35, 0.1), "contrast kept around each image's mean"),
    "noise": ((0.25, 0.5, 1.0), "added Gaussian noise, σ in standardised units"),
    "intensity": ((1.5, 2.0, 3.0), "intensities multiplied (standardised scale)"),
}


@dataclass
class Data:
    """One data set's splits, ``[P, C, 64, 64]`` images and ``[P, 1, 64, 64]`` masks."""

    name: str
    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor
    test_x: Tensor
    test_y: Tensor
    black: float | None  # the value of black on the input scale (None: each image's minimum)
    notes: str


def load_data(name: str, budget: Budget) -> Data:
    """The ``lesions`` or ``nuclei`` splits (fixed data; the seeds vary the training)."""
    if name == "lesions":
        n = budget.n_train + budget.n_val + budget.n_test
        x, y = lesion_dataset(n, 64, generator=torch.Generator().manual_seed(2024))
        a, b = budget.n_train, budget.n_train + budget.n_val
        fg = y[:a].mean().item()
        notes = (
            f"{a} training, {budget.n_val} validation and {budget.n_test} test images, 64×64 RGB, "
            f"foreground share {fg:.3f} (1:{(1 - fg) / fg:.1f})"
        )
        return Data(name, x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:], None, notes)
    if name == "nuclei":
        s = nuclei_patches(64, 32, dtype=torch.float32)
        vx, vy = nuclei_volume_slices(64, dtype=torch.float32)
        test_x, test_y = torch.cat([s.test_x, vx]), torch.cat([s.test_y, vy])
        if budget is QUICK:
            s.train_x, s.train_y = s.train_x[: budget.n_train], s.train_y[: budget.n_train]
            s.val_x, s.val_y = s.val_x[: budget.n_val], s.val_y[: budget.n_val]
        notes = (
            f"{len(s.train_x)} training and {len(s.val_x)} validation patches of the 2-D nuclei "
            f"image; test: its {len(s.test_x)} test-band patches and the {len(vx)} z-slices of "
            "stardist's synthetic 3-D nuclei volume (reflect-padded to 64×64)"
        )
        black = s.normalise(torch.tensor(0.0)).item()
        return Data(name, s.train_x, s.train_y, s.val_x, s.val_y, test_x, test_y, black, notes)
    raise ValueError(f"unknown data set {name!r}; use 'lesions' or 'nuclei'")


def loader(x: Tensor, y: Tensor, batch_size: int = 32) -> DataLoader:
    """Batches of ``(x, y)`` in order."""
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def load_converged(name: str, b: ConvergedBudget) -> tuple[Data, int]:
    """The data set and the number of its in-distribution test images (nuclei: the 2-D patches
    before the volume's slices).

    The nuclei splits are fixed (165 training and 15 validation patches, 31 volume slices); a
    budget that asks for fewer (``n_train``, ``n_val``, ``n_shift``: the quick ones) gets the
    first ones, and the notes say so. The full budgets ask for more than there are (480, 64
    and 32), so a full run sees every patch and slice.
    """
    data = load_data(name, b)
    if name != "nuclei":
        return data, len(data.test_x)
    n_id = len(data.test_x) - len(nuclei_volume_slices(64, dtype=torch.float32)[0])
    sizes = (len(data.train_x), len(data.val_x), len(data.test_x) - n_id)
    data.train_x, data.train_y = data.train_x[: b.n_train], data.train_y[: b.n_train]
    data.val_x, data.val_y = data.val_x[: b.n_val], data.val_y[: b.n_val]
    keep = n_id + b.n_shift
    data.test_x, data.test_y = data.test_x[:keep], data.test_y[:keep]
    kept = (len(data.train_x), len(data.val_x), len(data.test_x) - n_id)
    if kept != sizes:
        data.notes += (
            f" (this budget: the first {kept[0]} training and {kept[1]} validation patches, "
            f"the first {kept[2]} slices)"
        )
    return data, n_id


def boxed(data: Data, b: Budget, seed: int) -> tuple[Tensor, ...]:
    """The first ``n_eval`` test images and masks, with a noise box and a black box each.

    The boxes are a function of the seed, so Table 2 and the diagnosis see the same ones.

    Returns:
        ``(x, y, x_noise, box_noise, x_black, box_black)``.
    """
    x, y = data.test_x[: b.n_eval], data.test_y[: b.n_eval]
    gen = torch.Generator().manual_seed(1000 + seed)
    x_noise, box_noise = noise_box(x, generator=gen)
    x_black, box_black = black_box(x, data.black, generator=gen)
    return x, y, x_noise, box_noise, x_black, box_black


def shift(x: Tensor, kind: str, strength: float) -> Tensor:
    """A distribution shift of standardised images ``[N, C, H, W]`` (Fig. 7)."""
    if kind == "blur":
        r = max(1, math.ceil(3 * strength))
        t = torch.arange(-r, r + 1, dtype=x.dtype)
        k = torch.exp(-0.5 * (t / strength) ** 2)
        k = k / k.sum()
        c = x.shape[1]
        xp = F.pad(x, (r, r, r, r), mode="reflect")
        xp = F.conv2d(xp, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
        return F.conv2d(xp, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)
    if kind == "contrast":
        mean = x.mean((-1, -2), keepdim=True)
        return mean + strength * (x - mean)
    if kind == "noise":
        gen = torch.Generator().manual_seed(int(strength * 1000))
        return x + strength * torch.randn(x.shape, generator=gen, dtype=x.dtype)
    if kind == "intensity":
        return strength * x
    raise ValueError(f"unknown shift {kind!r}; use one of {sorted(SHIFTS)}")


REGIONS = ("band", "fg", "bg")


def region_means(v: Tensor, y: Tensor) -> dict[str, float]:
    """Mean of ``v`` within 2 px of the mask boundary, inside and outside the mask."""
    band = boundary_band(y, 2)
    inside, outside = (y > 0.5) & ~band, (y < 0.5) & ~band
    return {k: float(v[m].mean()) for k, m in zip(REGIONS, (band, inside, outside), strict=True)}


def volume_on_training_scale(volume_x: Tensor) -> Tensor:
    """The nuclei volume's slices as the models see them (standardised by the volume's own
    mean and sd, :func:`lsn_ext.data.nuclei_volume_slices`) brought back to the raw intensities
    and standardised by the 2-D training band's statistics instead, ``[31, 1, 64, 64]``. The
    reflect padding commutes with the affine maps, so this is exact."""
    volume, _ = load_nuclei_3d()
    raw = volume_x.double() * volume.std() + volume.mean()
    return nuclei_patches(64, 32, dtype=torch.float64).normalise(raw).to(volume_x.dtype)


def image_statistics(train_x: Tensor, sets: dict[str, Tensor]) -> dict[str, list[float]]:
    """Model-free shift score: Mahalanobis distance of each image's (intensity mean, intensity
    standard deviation) over all its pixels and channels from the training images' mean of
    those two statistics, under their 2×2 covariance over the training images."""

    def stats(x: Tensor) -> Tensor:
        f = x.double().flatten(1)
        return torch.stack([f.mean(1), f.std(1)], 1)

    s = stats(train_x)
    mu, cov = s.mean(0), torch.cov(s.T) + 1e-9 * torch.eye(2, dtype=torch.float64)
    prec = torch.linalg.inv(cov)

    def dist(x: Tensor) -> list[float]:
        d = stats(x) - mu
        return torch.einsum("ni,ij,nj->n", d, prec, d).sqrt().tolist()

    return {k: dist(v) for k, v in sets.items()}
