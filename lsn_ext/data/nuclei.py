"""A real segmentation task shipped with the package: fluorescence nuclei, and an H&E image.

Files (``lsn_ext/data/nuclei_files/``, see ``PROVENANCE.md`` there): ``img2d.tif``, a 512×512 uint16
fluorescence image of cell nuclei (2018 Data Science Bowl, BBBC038, CC0) with ``mask2d.tif``, its
hand-drawn instance labels (125 nuclei, about 20 % foreground), and ``histo.jpg``, a 300×500 RGB
H&E tissue image without mask, used as far out-of-distribution input. Beside them ``img3d.tif``,
a ``[31, 61, 57]`` (z, y, x) uint16 volume of *synthetic* nuclei (stardist documents it so), and
``mask3d.tif``, its instance labels (162 nuclei, about 38 % foreground). All five come from the
sample data of ``stardist==0.9.2`` (BSD-3-Clause). They are read with Pillow (the 3-D files are
multi-page TIFFs, one page per z-slice).

Split: the image is cut into horizontal bands, so that no pixel of a validation or test patch is
seen in training: rows ``[0, H − 2S)`` train, ``[H − 2S, H − S)`` validation, ``[H − S, H)`` test
(``S`` the patch side). Patches are taken with a stride inside each band.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch
from PIL import Image, ImageSequence
from torch import Tensor

__all__ = [
    "NucleiSplits",
    "histology_patches",
    "load_histology",
    "load_nuclei",
    "load_nuclei_3d",
    "nuclei_patches",
    "nuclei_volume_slices",
    "random_flips",
]


def _read(name: str, *, pages: bool = False) -> np.ndarray:
    """A shipped image as an array; with ``pages``, all pages of a multi-page TIFF stacked first."""
    path = resources.files("lsn_ext.data") / "nuclei_files" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"package data file {name!r} is missing from lsn_ext/data/nuclei_files/; the "
            "installation is incomplete (reinstall lsn-ext, or check [tool.setuptools.package-data]"
            " in pyproject.toml)"
        )
    with path.open("rb") as f, Image.open(f) as image:
        if pages:
            return np.stack([np.array(page) for page in ImageSequence.Iterator(image)])
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
    """The H&E image in grey, ``0.299 R + 0.587 G + 0.114 B``: ``[300, 500]`` float64, 0–255.

    Returns:
        The grey image ``[300, 500]``, float64 on the 0–255 scale.
    """
    rgb = _read("histo.jpg").astype(np.float64)
    return torch.from_numpy(rgb @ np.array([0.299, 0.587, 0.114]))


def load_nuclei_3d() -> tuple[Tensor, Tensor]:
    """The synthetic 3-D nuclei volume of stardist and its binary mask.

    Returns:
        ``(volume, mask)``: ``[31, 61, 57]`` (z, y, x) float64 intensities on the file's scale
        (104–375) and a ``[31, 61, 57]`` bool mask (``labels > 0``, about 38 % foreground).
    """
    volume = torch.from_numpy(_read("img3d.tif", pages=True).astype(np.float64))
    mask = torch.from_numpy(_read("mask3d.tif", pages=True).astype(np.int64) > 0)
    return volume, mask


def _fit(t: Tensor, size: int, dim: int) -> Tensor:
    """Centre-crop or reflect-pad ``t`` along ``dim`` (``-1`` or ``-2``) to length ``size``."""
    side = t.shape[dim]
    if side >= size:
        start = (side - size) // 2
        return t.narrow(dim, start, size)
    before = (size - side) // 2
    after = size - side - before
    pad = (before, after, 0, 0) if dim == -1 else (0, 0, before, after)
    return torch.nn.functional.pad(t, pad, mode="reflect")


def nuclei_volume_slices(
    size: int = 64, *, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """The 31 z-slices of the 3-D nuclei volume as 2-D images with masks, ``size × size``.

    The intensities are standardised by the volume's own statistics,
    ``x = (raw − mean(volume)) / std(volume)``: the volume's scale (104–375, a dim background
    near 110) differs from the 2-D image's (0–235), so :meth:`NucleiSplits.normalise` would not
    suit it. Each slice side (61 rows, 57 columns) is brought to ``size`` on its own: a centre
    crop where it is longer, a reflect padding where it is shorter. Image and mask are padded
    together, so a mirrored pixel keeps its mirrored label and the mask stays correct.

    Args:
        size: Output side ``S``; at least 8, and at most ``3 · 57 − 2 = 169`` so that the
            reflect padding on each side stays shorter than the slice side (torch's limit).
        dtype: Floating dtype of the tensors (default: ``torch.get_default_dtype()``).

    Returns:
        ``(images, masks)``: ``[31, 1, S, S]`` standardised images and ``[31, 1, S, S]`` masks in
        {0, 1}, both of ``dtype``.

    Raises:
        ValueError: If ``size < 8`` or a reflect padding would be as long as the slice side.
    """
    volume, mask = load_nuclei_3d()
    if size < 8:
        raise ValueError(f"need size >= 8 for the nuclei slices; got size={size}")
    for side in volume.shape[1:]:
        if size > side and size - side - (size - side) // 2 >= side:
            raise ValueError(
                f"size={size} would need a reflect padding of {size - side - (size - side) // 2} "
                f"pixels on a slice side of {side}, but it must be shorter than the side; use "
                f"size <= {3 * min(volume.shape[1:]) - 2}"
            )
    dtype = dtype or torch.get_default_dtype()
    images = ((volume - volume.mean()) / volume.std()).unsqueeze(1)  # [Z, 1, H, W]
    masks = mask.to(torch.float64).unsqueeze(1)
    for dim in (-2, -1):
        images, masks = _fit(images, size, dim), _fit(masks, size, dim)
    return images.to(dtype), masks.to(dtype)


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
        """Map raw intensities (0–255 scale) to the model's input scale, ``(raw − mean) / std``.

        Args:
            raw: Images on the 0–255 scale, any shape.

        Returns:
            The normalised images, shaped like ``raw``.
        """
        return (raw - self.mean) / self.std


def nuclei_patches(
    size: int = 64, stride: int = 32, *, dtype: torch.dtype | None = None
) -> NucleiSplits:
    """Cut the nuclei image into patches with a spatially disjoint train/validation/test split.

    With the defaults (64×64, stride 32): 165 training, 15 validation and 15 test patches, from
    the bands ``[0, 384)``, ``[384, 448)`` and ``[448, 512)`` of the rows.

    Args:
        size: Patch side ``S``; ``3 S`` must fit into the image height.
        stride: Step between patches inside a band, ``1 ≤ stride ≤ size`` (``stride < size``
            overlaps them; a larger stride would skip pixels and is refused).
        dtype: Floating dtype of the tensors (default: ``torch.get_default_dtype()``).

    Returns:
        The splits (:class:`NucleiSplits`).

    Raises:
        ValueError: If ``size`` or ``stride`` is out of range, the image is too small, or
            ``dtype`` is not floating (the images are standardised).
    """
    image, mask = load_nuclei()
    H = image.shape[0]
    if size < 1 or stride < 1 or 3 * size > H:
        raise ValueError(
            f"need 1 <= size with 3 * size <= {H} (the image height) and stride >= 1; "
            f"got size={size}, stride={stride}"
        )
    if stride > size:
        raise ValueError(
            f"stride={stride} is larger than the patch side {size}: the pixels between patches "
            "would be left out of every split; use stride <= size"
        )
    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise ValueError(
            f"dtype must be floating (the images are standardised to mean 0, sd 1), got {dtype}"
        )
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

    Args:
        splits: The nuclei splits whose ``mean``/``std`` and dtype the patches take.
        size: Patch side ``S``.

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

    Raises:
        ValueError: If images and masks are not ``[N, *, H, W]`` with the same ``N``, ``H``
            and ``W``.
    """
    if x.dim() < 3 or y.dim() < 3 or x.shape[0] != y.shape[0] or x.shape[-2:] != y.shape[-2:]:
        raise ValueError(
            f"images {tuple(x.shape)} and masks {tuple(y.shape)} must be [N, C, H, W] and "
            "[N, C', H, W] with the same batch size and image size (one mask per image)"
        )
    flips = torch.rand(2, x.shape[0], generator=generator) < 0.5
    x, y = x.clone(), y.clone()
    for dim, chosen in zip((-1, -2), flips, strict=True):
        x[chosen] = x[chosen].flip(dim)
        y[chosen] = y[chosen].flip(dim)
    return x, y
