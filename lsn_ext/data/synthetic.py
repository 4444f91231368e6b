"""Synthetic lesion images for tests (made on the spot, nothing is downloaded)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["synthetic_lesions"]


def synthetic_lesions(
    n: int,
    size: int = 64,
    channels: int = 3,
    *,
    max_lesions: int = 3,
    noise: float = 0.3,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Images with bright elliptic lesions on a textured background, and their masks.

    Each image holds 1 to ``max_lesions`` ellipses with random centre, radii (5–25 % of the side)
    and orientation; the lesion intensity and the Gaussian noise vary per image, so the boundary
    is ambiguous where the noise is strong.

    Args:
        n: Number of images.
        size: Side length ``S``.
        channels: Image channels ``C`` (the lesion shows in all of them, with per-channel gain).
        max_lesions: Most lesions per image.
        noise: Standard deviation of the additive noise.
        generator: Random generator, for reproducible data.

    Returns:
        ``(images, masks)``: ``[n, C, S, S]`` float images and ``[n, 1, S, S]`` masks in {0, 1}.

    Raises:
        ValueError: For non-positive sizes or counts.
    """
    if n < 1 or size < 4 or channels < 1 or max_lesions < 1:
        raise ValueError(
            f"need n >= 1, size >= 4, channels >= 1, max_lesions >= 1; got n={n}, size={size}, "
            f"channels={channels}, max_lesions={max_lesions}"
        )
    g = generator

    def rand(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=g)

    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    masks = torch.zeros(n, 1, size, size)
    for i in range(n):
        for _ in range(int(torch.randint(1, max_lesions + 1, (1,), generator=g))):
            cy, cx = 0.15 + 0.7 * rand(2)
            ry, rx = 0.05 + 0.2 * rand(2)
            angle = torch.pi * rand(1)
            dy, dx = yy - cy, xx - cx
            u = dx * torch.cos(angle) + dy * torch.sin(angle)
            v = -dx * torch.sin(angle) + dy * torch.cos(angle)
            masks[i, 0] = torch.maximum(masks[i, 0], ((u / rx) ** 2 + (v / ry) ** 2 <= 1).float())
    background = 0.2 * torch.sin(6.0 * torch.pi * (xx + rand(n, 1, 1, 1))) * rand(n, 1, 1, 1)
    gain = 0.5 + rand(n, channels, 1, 1)
    images = background + gain * masks + noise * torch.randn(n, channels, size, size, generator=g)
    return images, masks
