"""Synthetic lesion images for tests (made on the spot, nothing is downloaded)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["lesion_dataset", "synthetic_lesions"]


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


# Per-channel mean and standard deviation of the raw RGB (0–1) images of ``lesion_dataset``,
# measured once over 4 × 5000 images (seeds 0–3, size 64, foreground 1/9) and hard-coded, so that
# every call maps to the same scale. At foreground 1/9 a data set then has per-channel mean within
# ±0.01 of 0 and std within 0.01 of 1; more lesion pixels make it darker (foreground 0.25: mean
# about −0.3, std about 1.1).
_MEAN = (0.7256, 0.5341, 0.4681)
_STD = (0.1405, 0.1167, 0.1109)
_F32 = torch.float32  # whatever the default dtype: float32 draws and images
_CHUNK = 1024  # images rendered at a time (bounds the memory of the [m, S, S] temporaries)
_ORDERS = (2, 3, 4, 5, 6)  # Fourier orders of the boundary modulation


def lesion_dataset(
    n: int,
    size: int = 64,
    *,
    foreground: float = 1 / 9,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """ISIC-like dermoscopy images of skin lesions with their masks, made on the spot.

    Imitates the data of the LSN paper (11,028 ISIC images at 64×64, class imbalance about 1:8):

    - **Shape.** One lesion per image (with probability 0.15 a second, smaller one beside it),
      centred near, not at, the middle. Its boundary is a rotated ellipse (axis ratio 0.7–1)
      whose radius is modulated by Fourier harmonics of orders 2–6 with decaying amplitudes,
      ``r(θ) = r₀ (1 + Σ_k c_k cos(kθ + φ_k))``, ``Σ |c_k| ≤ 0.55``.
    - **Size.** The lesion's share of the image ``a`` is lognormal with mean ``foreground``
      (5 % of the images get a tiny lesion of 0.2–1.2 % instead), clipped to ``[0.002, 0.6]``;
      ``r₀`` follows from the area ``π r₀² (1 + ½ Σ_k c_k²)`` and is corrected once by the
      rendered mask's area (border clipping, overlap), so the mean foreground share of a data set
      is ``foreground`` (within 0.01 for ``n ≥ 500`` and ``foreground ≤ 0.25``; larger shares fall
      short, e.g. 0.36 for 0.4, as the shares are capped at 0.6 and lesions clipped by the border).
    - **Appearance.** Skin-coloured background with smooth Gaussian-filtered texture, mild
      vignetting, dark thin hair-like curves on about 20 % of the images; a darker brown lesion
      with its own pigment blotches and contrast ``α ∈ [0.35, 1]``, blended by
      ``α · sigmoid(d / w)``, ``d`` the signed distance to the boundary in pixels (positive
      inside) and ``w ∈ [0.25, 0.9]`` per image: the 10–90 % ramp is ``2 ln 9 · w ≈ 1.1–4`` px
      wide, so the true boundary (``d = 0``) is ambiguous in the image. Then per-image colour,
      brightness and contrast jitter and Gaussian sensor noise.
    - **Scale.** The RGB values (0–1) are standardised per channel with fixed constants measured
      once over a large data set, ``x = (rgb − mean_c) / std_c``: a data set has per-channel mean
      about 0 and standard deviation about 1, and every call has the same scale.

    Args:
        n: Number of images ``N``.
        size: Side length ``S`` (at least 16).
        foreground: Mean share of lesion pixels over the data set, in ``(0, 0.5)``.
        generator: Random generator; the same seed gives identical tensors.

    Returns:
        ``(images, masks)``: ``[N, 3, S, S]`` float32 standardised images and ``[N, 1, S, S]``
        float32 masks in {0, 1}.

    Raises:
        ValueError: If ``n < 1``, ``size < 16`` or ``foreground`` is not in ``(0, 0.5)``.
    """
    if n < 1 or size < 16:
        raise ValueError(f"need n >= 1 and size >= 16; got n={n}, size={size}")
    if not 0 < foreground < 0.5:
        raise ValueError(
            f"foreground is the mean lesion share of the pixels and must lie in (0, 0.5); "
            f"got foreground={foreground}"
        )
    chunks = [
        _lesion_chunk(min(_CHUNK, n - start), size, foreground, generator)
        for start in range(0, n, _CHUNK)
    ]
    images = torch.cat([c[0] for c in chunks])
    masks = torch.cat([c[1] for c in chunks])
    mean = torch.tensor(_MEAN, dtype=_F32).view(1, 3, 1, 1)
    std = torch.tensor(_STD, dtype=_F32).view(1, 3, 1, 1)
    return (images - mean) / std, masks


def _smooth_noise(m: int, size: int, sigma: float | Tensor, g: torch.Generator | None) -> Tensor:
    """White noise filtered by a Gaussian of std ``sigma`` px (circular, via FFT): ``[m, S, S]``.

    ``sigma`` is a number or one per image, ``[m]``. The Gaussian's transfer function is
    ``H(f) = exp(−2 π² σ² |f|²)`` (``f`` in cycles per pixel); the result is divided by the
    filter's energy, ``sqrt((1 / S²) Σ_f H(f)²)`` over the full frequency grid, the standard
    deviation of unit white noise so filtered: every pixel has variance 1.
    """
    freq = torch.fft.fftfreq(size, dtype=_F32)
    f2 = freq.view(-1, 1) ** 2 + freq.view(1, -1) ** 2  # [S, S] cycles per pixel, squared
    sigma = torch.as_tensor(sigma, dtype=_F32).reshape(-1, 1, 1)  # [1 or m, 1, 1]
    h = torch.exp(-2 * torch.pi**2 * sigma**2 * f2)  # [1 or m, S, S]
    scale = h.pow(2).mean((1, 2), keepdim=True).sqrt()
    noise = torch.randn(m, size, size, generator=g, dtype=_F32)
    out = torch.fft.irfft2(torch.fft.rfft2(noise) * h[..., : size // 2 + 1], s=(size, size))
    return out / scale


def _signed_distance(
    centre: Tensor, r0: Tensor, shape: dict[str, Tensor], grid: tuple[Tensor, Tensor]
) -> Tensor:
    """Approximate signed distance in px to a modulated ellipse, positive inside: ``[m, S, S]``.

    ``d = r₀ (1 + Σ_k c_k cos(kθ + φ_k)) − ρ``, with ``(ρ, θ)`` the polar coordinates of a pixel
    in the lesion's rotated and area-preserving stretched frame; ``centre`` is ``[m, 2]`` (y, x)
    in px, ``r0`` is ``[m]``.
    """
    yy, xx = grid
    dy = yy - centre[:, 0, None, None]
    dx = xx - centre[:, 1, None, None]
    cos, sin = shape["angle"].cos()[:, None, None], shape["angle"].sin()[:, None, None]
    stretch = shape["aspect"].sqrt()[:, None, None]
    u = (dx * cos + dy * sin) * stretch
    v = (dy * cos - dx * sin) / stretch
    rho, theta = torch.hypot(u, v), torch.atan2(v, u)
    modulation = torch.ones_like(rho)
    for i, k in enumerate(_ORDERS):
        amp, phase = shape["amp"][:, i, None, None], shape["phase"][:, i, None, None]
        modulation += amp * torch.cos(k * theta + phase)
    return r0[:, None, None] * modulation - rho


def _lesion_chunk(
    m: int, size: int, foreground: float, g: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """``m`` raw RGB images in [0, 1] ``[m, 3, S, S]`` and masks ``[m, 1, S, S]``."""

    def uniform(lo: float, hi: float, *shape: int) -> Tensor:
        return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=_F32)

    S = float(size)
    pix = torch.arange(size, dtype=_F32) + 0.5
    grid = torch.meshgrid(pix, pix, indexing="ij")

    # --- sizes: lognormal share with mean `foreground` (after the 5 % tiny lesions) ------------
    sigma = 0.55
    tiny = torch.rand(m, generator=g, dtype=_F32) < 0.05
    big_mean = (foreground - 0.05 * 0.007) / 0.95
    share = big_mean * torch.exp(sigma * torch.randn(m, generator=g, dtype=_F32) - sigma**2 / 2)
    share = torch.where(tiny, uniform(0.002, 0.012, m), share).clamp(0.002, 0.6)
    second = torch.rand(m, generator=g, dtype=_F32) < 0.15
    split = torch.where(second, uniform(0.15, 0.35, m), torch.zeros(m, dtype=_F32))
    shares = torch.stack([share * (1 - split), share * split])  # [2, m]

    # --- shapes: two lesion slots (the second used where `second`) -----------------------------
    decay = torch.tensor([k**-1.0 for k in _ORDERS], dtype=_F32)
    shapes = []
    for _ in range(2):
        amp = (
            uniform(0.08, 0.3, m, 1) * decay * torch.randn(m, len(_ORDERS), generator=g, dtype=_F32)
        )
        amp = amp * (0.55 / amp.abs().sum(1, keepdim=True).clamp(min=0.55))
        shapes.append(
            {
                "amp": amp,
                "phase": uniform(0, 2 * torch.pi, m, len(_ORDERS)),
                "aspect": uniform(0.7, 1.0, m),
                "angle": uniform(0, torch.pi, m),
            }
        )
    r0 = torch.stack(
        [
            (a * S**2 / (torch.pi * (1 + 0.5 * s["amp"].pow(2).sum(1)))).sqrt()
            for a, s in zip(shares, shapes, strict=True)
        ]
    )  # [2, m] px
    main = S * (0.5 + (0.08 * torch.randn(m, 2, generator=g, dtype=_F32)).clamp(-0.2, 0.2))
    bearing = uniform(0, 2 * torch.pi, m)
    offset = (r0[0] + r0[1]) * uniform(0.9, 1.5, m)
    beside = main + offset[:, None] * torch.stack([bearing.sin(), bearing.cos()], 1)
    centres = (main, beside.clamp(0.12 * S, 0.88 * S))

    def distance(radii: Tensor) -> Tensor:
        d = [
            _signed_distance(c, r, s, grid) for c, r, s in zip(centres, radii, shapes, strict=True)
        ]
        return torch.maximum(d[0], torch.where(second[:, None, None], d[1], -torch.inf))

    # one correction of the radii by the rendered area (border clipping, overlap, pixels)
    rendered = (distance(r0) > 0).float().mean((1, 2)).clamp(min=0.5 / S**2)
    r0 = r0 * (share / rendered).sqrt().clamp(0.5, 2.0)
    d = distance(r0)  # [m, S, S] px, positive inside
    masks = (d > 0).float().unsqueeze(1)

    # --- background: skin colour, smooth texture, vignetting ------------------------------------
    red = uniform(0.72, 0.95, m)
    green = red * uniform(0.66, 0.82, m)
    blue = green * uniform(0.78, 0.98, m)
    skin = torch.stack([red, green, blue], 1)[:, :, None, None]  # [m, 3, 1, 1]
    texture = 0.05 * _smooth_noise(m, size, size / 8, g) + 0.025 * _smooth_noise(m, size, 2.0, g)
    tint = 0.02 * _smooth_noise(m, size, size / 6, g)
    redder = torch.tensor([1.0, -0.5, -0.5], dtype=_F32).view(1, 3, 1, 1)  # towards red
    background = skin * (1 + texture[:, None]) + tint[:, None] * redder

    # --- lesion: brown, pigment blotches, darker core ------------------------------------------
    lred = uniform(0.3, 0.62, m)
    lgreen = lred * uniform(0.5, 0.7, m)
    lblue = lgreen * uniform(0.6, 0.95, m)
    pigment = torch.stack([lred, lgreen, lblue], 1)[:, :, None, None]
    blotch = torch.sigmoid(3 * _smooth_noise(m, size, uniform(1.5, 4.0, m), g))
    core = torch.sigmoid((d - 0.5 * r0.amax(0)[:, None, None]) / 2.0)
    darkening = 1 - uniform(0.2, 0.5, m)[:, None, None] * blotch - 0.15 * core
    lesion = pigment * (darkening + 0.05 * _smooth_noise(m, size, 1.0, g))[:, None]
    width = uniform(0.25, 0.9, m)[:, None, None]
    opacity = (uniform(0.35, 1.0, m)[:, None, None] * torch.sigmoid(d / width))[:, None]
    images = background * (1 - opacity) + lesion * opacity

    # --- hair on about 20 % of the images --------------------------------------------------------
    hairy = torch.nonzero(torch.rand(m, generator=g, dtype=_F32) < 0.2).flatten()
    if len(hairy):
        h = len(hairy)
        yy, xx = grid
        cover = torch.zeros(h, size, size, dtype=_F32)
        count = torch.randint(1, 7, (h,), generator=g)
        for j in range(6):
            angle = uniform(0, torch.pi, h)[:, None, None]
            cy, cx = uniform(0, S, h)[:, None, None], uniform(0, S, h)[:, None, None]
            u = (xx - cx) * angle.cos() + (yy - cy) * angle.sin()
            v = (yy - cy) * angle.cos() - (xx - cx) * angle.sin()
            bend = uniform(-0.015, 0.015, h)[:, None, None]
            wave, freq = uniform(0, 2.0, h)[:, None, None], uniform(0.05, 0.2, h)[:, None, None]
            phase = uniform(0, 2 * torch.pi, h)[:, None, None]
            curve = bend * u**2 + wave * torch.sin(freq * u + phase)
            slope = 2 * bend * u + wave * freq * torch.cos(freq * u + phase)
            dist = (v - curve).abs() / (1 + slope**2).sqrt()
            half = uniform(0.2, 0.8, h)[:, None, None] * S
            along = torch.sigmoid(half - u.abs())
            thick = uniform(0.35, 0.8, h)[:, None, None]
            strand = torch.exp(-0.5 * (dist / thick) ** 2) * along
            on = (count > j).float()[:, None, None]
            cover = torch.maximum(cover, on * uniform(0.5, 0.9, h)[:, None, None] * strand)
        hair_colour = torch.tensor([0.15, 0.1, 0.08], dtype=_F32).view(1, 3, 1, 1)
        images[hairy] = images[hairy] * (1 - cover[:, None]) + hair_colour * cover[:, None]

    # --- vignetting, colour / contrast jitter, sensor noise --------------------------------------
    yy, xx = grid
    radius2 = ((yy - S / 2) ** 2 + (xx - S / 2) ** 2) / (S / 2) ** 2  # 2 in the corners
    images = images * (1 - uniform(0.03, 0.15, m)[:, None, None, None] * radius2)
    images = (
        images
        * uniform(0.92, 1.08, m, 3)[:, :, None, None]
        * uniform(0.85, 1.1, m)[:, None, None, None]
    )
    level = images.mean((1, 2, 3), keepdim=True)
    images = level + uniform(0.8, 1.2, m)[:, None, None, None] * (images - level)
    images = images + uniform(0.01, 0.035, m)[:, None, None, None] * torch.randn(
        m, 3, size, size, generator=g, dtype=_F32
    )
    return images.clamp(0, 1), masks
