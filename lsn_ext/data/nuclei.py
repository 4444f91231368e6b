"""A real segmentation task shipped with the package: fluorescence nuclei, and an H&E image.

Files (``lsn_ext/data/nuclei/``, see ``PROVENANCE.md`` there): ``img2d.tif``, a 512×512 uint16
fluorescence image of cell nuclei (2018 Data Science Bowl, BBBC038, CC0) with ``mask2d.tif``, its
hand-drawn instance labels (125 nuclei, about 20 % foreground), and ``histo.jpg``, a 300×500 RGB
H&E tissue image without mask, used as far out-of-distribution input. All three come from the
sample data of ``stardist==0.9.2`` (BSD-3-Clause). They are read with Pillow.

Split: the image is cut into horizontal bands, so that no pixel of a validation or test patch is
seen in training: rows ``[0, H − 2S)`` train, ``[H − 2S, H − S)`` validation, ``[H − S, H)`` test
(``S`` the patch side). Patches are taken with a stride inside each band.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch
from PIL import Image
from torch import Tensor

__all__ = [
    "NucleiSplits",
    "histology_patches",
    "load_histology",
    "load_nuclei",
    "nuclei_patches",
    "random_flips",
]


def _read(name: str) -> np.ndarray:
    path = resources.files("lsn_ext.data") / "nuclei" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"package data file {name!r} is missing from lsn_ext/data/nuclei/; the installation "
            "is incomplete (reinstall lsn-ext, or check [tool.setuptools.package-data])"
        )
    with path.open("rb") as f, Image.open(f) as image:
        return np.array(image)


def load_nuclei() -> tuple[Tensor, Tensor]:
    """The fluorescence nuclei image and its binary mask.

    Returns:
        ``(image, mask)``: ``[512, 512]`` float64 intensities on the file's scale (0–235) and a
        ``[512, 512]`` bool mask (``labels > 0``).
    """
    image = torch.from_numpy(_read("img2d.tif").astype(np.float64))
    mask = torch.from_numpy(_read("mask2d.tif").astype(np.int64) > 0)
    return image, mask


def load_histology() -> Tensor:
    """The H&E image in grey, ``0.299 R + 0.587 G + 0.114 B``: ``[300, 500]`` float64, 0–255."""
    rgb = _read("histo.jpg").astype(np.float64)
    return torch.from_numpy(rgb @ np.array([0.299, 0.587, 0.114]))


def _patches(image: Tensor, size: int, stride: int) -> Tensor:
    """All ``S × S`` windows of a ``[..., H, W]`` image with a stride: ``[P, ..., S, S]``."""
    windows = image.unfold(-2, size, stride).unfold(-2, size, stride)  # [..., nh, nw, S, S]
    windows = windows.movedim(-4, 0).movedim(-3, 1)  # [nh, nw, ..., S, S]
    return windows.reshape(-1, *windows.shape[2:])


@dataclass
class NucleiSplits:
    """Normalised nuclei patches, spatially disjoint between the splits.

    Attributes:
        train_x: Training images ``[N_train, 1, S, S]``, normalised ``(raw − mean) / std``.
        train_y: Training masks ``[N_train, 1, S, S]`` in {0, 1}.
        val_x: Validation images ``[N_val, 1, S, S]``.
        val_y: Validation masks.
        test_x: Test images ``[N_test, 1, S, S]``.
        test_y: Test masks.
        mean: Mean raw intensity of the training band (used for every split and for OOD images).
        std: Standard deviation of the raw intensities of the training band.
    """

    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor
    test_x: Tensor
    test_y: Tensor
    mean: float
    std: float

    def normalise(self, raw: Tensor) -> Tensor:
        """Map raw intensities (0–255 scale) to the model's input scale."""
        return (raw - self.mean) / self.std


def nuclei_patches(
    size: int = 64, stride: int = 32, *, dtype: torch.dtype | None = None
) -> NucleiSplits:
    """Cut the nuclei image into patches with a spatially disjoint train/validation/test split.

    With the defaults (64×64, stride 32): 165 training, 15 validation and 15 test patches, from
    the bands ``[0, 384)``, ``[384, 448)`` and ``[448, 512)`` of the rows.

    Args:
        size: Patch side ``S``; ``3 S`` must fit into the image height.
        stride: Step between patches inside a band (``stride < size`` overlaps them).
        dtype: Floating dtype of the tensors (default: ``torch.get_default_dtype()``).

    Returns:
        The splits (:class:`NucleiSplits`).

    Raises:
        ValueError: If ``size`` or ``stride`` is not positive or the image is too small.
    """
    image, mask = load_nuclei()
    H = image.shape[0]
    if size < 1 or stride < 1 or 3 * size > H:
        raise ValueError(
            f"need 1 <= size with 3 * size <= {H} (the image height) and stride >= 1; "
            f"got size={size}, stride={stride}"
        )
    dtype = dtype or torch.get_default_dtype()
    bands = {"train": (0, H - 2 * size), "val": (H - 2 * size, H - size), "test": (H - size, H)}
    train_rows = image[: bands["train"][1]]
    mean, std = train_rows.mean().item(), train_rows.std().item()
    out: dict[str, Tensor] = {}
    for name, (lo, hi) in bands.items():
        out[f"{name}_x"] = _patches((image[lo:hi] - mean) / std, size, stride).unsqueeze(1)
        out[f"{name}_y"] = _patches(mask[lo:hi].to(torch.float64), size, stride).unsqueeze(1)
    return NucleiSplits(**{k: v.to(dtype) for k, v in out.items()}, mean=mean, std=std)


def histology_patches(splits: NucleiSplits, size: int = 64) -> Tensor:
    """Non-overlapping ``size × size`` patches of the H&E image, normalised like the nuclei.

    Returns:
        ``[P, 1, S, S]`` (28 patches for ``S = 64``), dtype of ``splits.train_x``.
    """
    grey = splits.normalise(load_histology())
    return _patches(grey, size, size).unsqueeze(1).to(splits.train_x.dtype)


def random_flips(
    x: Tensor, y: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Flip each image and its mask horizontally and vertically, each with probability ½.

    Args:
        x: Images ``[N, C, H, W]``.
        y: Masks ``[N, C', H, W]``, flipped with their image.
        generator: Random generator.

    Returns:
        ``(x, y)`` flipped (new tensors).
    """
    flips = torch.rand(2, x.shape[0], generator=generator) < 0.5
    x, y = x.clone(), y.clone()
    for dim, chosen in zip((-1, -2), flips, strict=True):
        x[chosen] = x[chosen].flip(dim)
        y[chosen] = y[chosen].flip(dim)
    return x, y
